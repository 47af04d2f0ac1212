// The device path (device_comm.h): each run of consecutive SEND/RECV actions goes as one batch, posted
// at its first action ([Note: NCCL pair order] in device_comm.h), and the step's message status is read
// once, at its end.
#include <c10/util/Exception.h>

#include "comm.h"
#include "comm_worker.h"
#include "device_comm.h"
#include "diagnostics.h"
#include "executor.h"

namespace pipecore {

void Executor::post_batch(size_t index, const RunMode& mode) {
  if (index < posted_through_) return;  // posted with an earlier action of its batch
  // a discovery run cuts before each later receive of activations, whose shapes may come from the
  // forward of a message the group sends (p2p_order.py, rule 5)
  const size_t end = (host_reads_ ? program_.learning_end : program_.batch_end)[index];
  TORCH_CHECK(end > index, "pipecore: action ", index, " is not a send or receive");
  SpentOn spent(profile_, Spent::kPost);
  std::vector<std::shared_ptr<CommTask>> tasks;
  std::vector<size_t> actions;  // tasks[k] is program[actions[k]]'s message
  std::vector<Inbox*> inboxes;  // a receive's, where its ready marker goes
  std::vector<std::pair<int64_t, std::vector<TensorSpec>>> crossings;  // shaped SEND_Fs': (stage, shapes)
  std::vector<std::pair<std::string, at::Tensor>> follow_ups;  // grown messages': (store key, bytes)
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
      if (!follow_up.empty()) follow_ups.emplace_back(follow_up_key(rank_, in.peer, key), follow_up.front());
      task = std::make_shared<CommTask>();
      task->parts = std::move(parts);
    }
    if (!task) continue;
    tasks.push_back(std::move(task));
    actions.push_back(j);
    inboxes.push_back(inbox);
  }
  posted_through_ = end;  // once posting starts nothing of it is posted again
  // in the store before their headers go: their receivers wait for them
  for (const auto& [name, bytes] : follow_ups) {
    TORCH_CHECK(shaped_.store, where(program_[index]), ": a grown message on the device path, and no store "
                "for its follow-up");
    const auto* data = static_cast<const uint8_t*>(bytes.data_ptr());
    try {
      shaped_.store->set(name, std::vector<uint8_t>(data, data + bytes.numel()));
    } catch (const std::exception& e) {
      throw CommError(where(program_[index]) + ": leaving a grown message's follow-up in the store failed: " +
                      e.what());
    }
    ++counts_.grown_messages;
  }
  if (tasks.empty()) return;
  post(tasks, actions, /*tag=*/0, /*here_if_idle=*/false, inboxes);
  // posted: the receivers read them, in this run or its aborted rest, and record them alike
  for (auto& [stage, crossing] : crossings) specs_.crossed_out(stage, std::move(crossing));
}

void Executor::await_step_status() {
  int64_t status = kMessageOk;
  if (!device_comm_->finish_step(timeout_, status)) {
    throw CommError("pipecore rank " + std::to_string(rank_) + ": the step's work on the device did not finish within " +
                    seconds(timeout_) + " (a peer stopped sending or receiving)");
  }
  if (status == kMessageUnknown) throw CommError(step_status_text(rank_, status));
  if (status == kMessageReplan) throw PeerReplan(step_status_text(rank_, status));
  if (status == kMessageAborted) throw PeerAbort(step_status_text(rank_, status));
}

}  // namespace pipecore
