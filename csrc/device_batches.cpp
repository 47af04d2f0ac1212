// The device path (device_comm.h): each run of consecutive SEND/RECV actions goes as one batch, posted
// at its first action ([Note: NCCL pair order] in device_comm.h), and the step's message status is read
// once, at its end.
#include <c10/util/Exception.h>

#include "comm.h"
#include "comm_task.h"
#include "device_comm.h"
#include "diagnostics.h"
#include "executor.h"
#include "outcome.h"

namespace pipecore {

void Executor::post_batch(size_t index, const RunMode& mode) {
  if (index < posted_through_) return;  // posted with an earlier action of its batch
  // a discovery run cuts before each later receive of activations from a peer, whose shapes may come
  // from the forward of a message the group sends (p2p_order.py, rule 5)
  const size_t end = (host_reads() ? program_.learning_end : program_.batch_end)[index];
  TORCH_CHECK(end > index, "pipecore: action ", index, " is not a send or receive");
  SpentOn spent(profile_, Spent::kPost);
  std::vector<std::shared_ptr<CommTask>> tasks;
  std::vector<size_t> actions;  // tasks[k] is program[actions[k]]'s message
  std::vector<Inbox*> inboxes;  // a receive's, where its ready marker goes
  std::vector<std::pair<int64_t, std::vector<TensorSpec>>> crossings;  // shaped SEND_Fs': (stage, shapes)
  std::vector<std::pair<size_t, at::Tensor>> follow_ups;  // grown messages': (action, packed at their own size)
  try {
    for (size_t j = index; j < end; ++j) {
      const Instr& in = program_[j];
      std::shared_ptr<CommTask> task;
      Inbox* inbox = nullptr;
      if (is_recv(in.op)) {
        task = make_recv(in, mode.aborted);
        inbox = &slot(in).inbox_of(in.op);
        if constexpr (kTesting) recv_posted_at_[program_.recvs_through[j] - 1] = static_cast<int64_t>(index);
        if (task) task->action = static_cast<int64_t>(j);
      } else {
        std::vector<TensorSpec> crossing;
        std::vector<at::Tensor> follow_up;
        int64_t key = 0;
        std::vector<at::Tensor> parts = message_of(in, mode.aborted, mode.status, &follow_up, &crossing, &key);
        if (parts.empty()) continue;
        if (!crossing.empty()) crossings.emplace_back(in.stage, std::move(crossing));
        if (!follow_up.empty()) follow_ups.emplace_back(j, follow_up.front());
        task = std::make_shared<CommTask>();
        task->parts = std::move(parts);
      }
      if (!task) continue;
      tasks.push_back(std::move(task));
      actions.push_back(j);
      inboxes.push_back(inbox);
    }
    TORCH_CHECK(follow_ups.empty() || (shaped_.up && shaped_.down), where(program_[index]), ": a grown message on the "
                "device path, and no follow-up channels (Executor.set_follow_up_channels)");
    posted_through_ = end;  // once posting starts nothing of it is posted again
    if (tasks.empty()) return;
    post(tasks, actions, /*tag=*/0, /*here_if_idle=*/false, inboxes);
  } catch (...) {  // (out of memory making a message): its follow-ups are not numbered, as they never go
    shaped_.follow_ups_numbered = shaped_.follow_ups_to;
    throw;
  }
  if (!follow_ups.empty()) shaped_.follow_ups_to = shaped_.follow_ups_numbered;
  if (shaped_.travel) {  // their headers are read in this order (read_headers_through)
    for (const auto& task : tasks) {
      if (!task->send) shaped_.unread_from[task->peer].push_back(task);
    }
  }
  // posted: the receivers read them, in this run or its aborted rest, and record them alike
  for (auto& [stage, crossing] : crossings) specs_.crossed_out(stage, std::move(crossing));
  // after their headers, each a batch of its own on the follow-up channel: its receiver posts the
  // receive once it read the header ([Note: NCCL pair order] in device_comm.h)
  for (auto& [action, bytes] : follow_ups) {
    auto task = std::make_shared<CommTask>();
    task->parts = {std::move(bytes)};
    post({task}, {action}, kFollowUpTag, /*here_if_idle=*/false, {},
         shaped_.channel(rank_, program_[action].peer, /*send=*/true));
  }
}

void Executor::await_step_status() {
  int64_t status = kMessageOk;
  if (!device_comm_->finish_step(timeout_, status)) {
    throw CommError(not_within("pipecore " + who_ + ": the step's work on the device did not finish", timeout_,
                               "a peer stopped sending or receiving"));
  }
  raise_if_failed(status, [&] { return step_status_text(who_, status); });
}

}  // namespace pipecore
