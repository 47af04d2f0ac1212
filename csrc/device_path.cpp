// The device path (message_path.h, device_comm.h): each run of consecutive SEND/RECV actions goes as one
// batch, posted at its first action ([Note: NCCL pair order] in device_comm.h); a received message is
// ordered on the device by its batch's ready marker; statuses fold on the device and the step's is read
// once, at its end; a shaped message's header is read from its copy on the host, and a grown one's
// follow-up comes on a channel of its own. A discovery run's host waits for and reads each message.
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <deque>
#include <utility>

#include "comm_task.h"
#include "device_comm.h"
#include "diagnostics.h"
#include "message_path.h"
#include "message_status.h"
#include "send_tracker.h"

namespace pipecore {
namespace {

class DevicePath final : public MessagePath {
 public:
  DevicePath(PathContext context, MessageFormat format, PathSettings settings, std::unique_ptr<DeviceComm> device)
      : MessagePath(context, std::move(format), std::move(settings)), device_(std::move(device)) {
    format_.exact = true;
  }

  bool on_device() const override { return true; }

  std::vector<std::string> stream_violations() const override { return device_->contract_violations(); }

  void connect(const std::vector<c10d::Backend*>& pair_channels, const std::vector<int>& peers,
               const std::vector<int>& exchange_peers) override {
    device_->connect(*ctx_.pg->getBackend(device_->device_type()), pair_channels, static_cast<int>(ctx_.rank), peers,
                     exchange_peers);
  }
  ConnectionCounts connection_counts() const override { return device_->connection_counts(); }

  at::Tensor exchange(const at::Tensor& tensor, int64_t peer, const std::string& what) override {
    if (tensor.device().type() != device_->device_type()) return MessagePath::exchange(tensor, peer, what);
    return device_->exchange(*ctx_.pg, tensor, static_cast<int>(peer), ctx_.timeout,
                             "rank " + std::to_string(ctx_.rank) + ": " + what);
  }

  void reset(size_t recv_count) override {
    MessagePath::reset(recv_count);
    posted_through_ = 0;
  }

  void begin_step() override { device_->begin_step(device_->compute_stream()); }

  // Receives go with their batch; a grown message's follow-up receive is posted as soon as its header is
  // on the host ([Note: follow-ups posted as their headers land], device_comm.h).
  void before(size_t /*at*/) override { post_landed_follow_ups(); }

  void post(size_t index, const RunMode& mode) override { post_batch(index, mode); }

  void let_go(Inbox& inbox) override {
    if (inbox.task && inbox.ready) {
      CommTask& task = *inbox.task;
      try {
        const ComputeStream on = device_->compute_stream();
        device_->release(task, *inbox.ready, inbox.consumed, on);
        if (task.follow_up) device_->release(*task.follow_up, *task.follow_up_ready, task.follow_up_consumed, on);
      } catch (...) {  // the stream contract's checker keeps its refusals (stream_violations)
      }
      task.follow_up.reset();
    }
    inbox = Inbox();
  }

  void check_step_status() override {
    int64_t status = kMessageOk;
    const WaitingOn waiting(ctx_.flight, -1, -1, "the step's work on the device");
    if (!device_->finish_step(ctx_.timeout, status, device_->compute_stream())) {
      throw CommError(not_within("pipecore " + ctx_.who + ": the step's work on the device did not finish",
                                 ctx_.timeout, "a peer stopped sending or receiving"));
    }
    raise_if_failed(status, [&] { return step_status_text(ctx_.who, status); });
  }

  Outcome explained(Outcome outcome, const std::string& action) override {
    // Computed on what arrived before its status was known: on a peer's aborted or "shapes changed"
    // message (zeros of the old shapes) a stage or the loss may fail (this step's targets against the old
    // shapes). Then the status says what happened; this error is its echo.
    if (outcome.kind != Outcome::kOrigin) return outcome;
    int64_t status = kMessageOk;
    try {
      if (!device_->finish_step(ctx_.timeout, status, device_->compute_stream()) || status == kMessageOk) {
        return outcome;
      }
    } catch (...) {
      return outcome;  // the status cannot be read: this rank's error stands
    }
    Outcome explained = Outcome::of_status(status, step_status_text(ctx_.who, status) + " (here that made action " +
                                                       action + " fail: " + error_text(outcome.origin) + ")");
    explained.at = outcome.at;
    return explained;
  }

  // Posting onto the wedged communicator could block this thread in the group's end until c10d's watchdog
  // ends the process; the caller aborts it (Comm.abandon_group).
  bool may_post_after(const Outcome& outcome) const override { return outcome.kind != Outcome::kComm; }

  at::Tensor seed_of(const at::Tensor& loss, double value) override {
    if (loss.device().type() != device_->device_type()) return MessagePath::seed_of(loss, value);
    at::Tensor seed = at::empty_like(loss);
    device_->fill_seed(seed, value, device_->compute_stream());  // zero unless every message so far was ok
    return seed;
  }

 private:
  // A discovery run: the host waits for and reads each message (its trailer says whether the peer's step
  // was aborted or its shapes changed).
  bool host_reads() const override { return ctx_.owner.discovering(); }

  void forget_unread() override { unread_from_.clear(); }

  void before_reading(Inbox& inbox, const Instr& in, const char* what) override {
    CommTask& task = *inbox.task;
    TORCH_CHECK(inbox.ready, where(in), ": a device receive without its batch's ready marker");
    try {
      // the compute stream (and a discovery run's host reads, which queue there) read it after its batch
      // (stream_contract.h, rule 2); a plain message's trailer folds into the step status on the device
      SpentOn spent(ctx_.profile, Spent::kWait);
      const WaitingOn waiting(ctx_.flight, task.peer, in.mb, what);
      device_->consume(task, *inbox.ready, device_->compute_stream());
      inbox.consumed = true;
      // the host's part is done: its arrival is the device's to see (a hang there is the wait for the step's
      // work on the device, at its end)
      ctx_.flight.completed(task.flight_ticket);
    } catch (const CommError& e) {  // a consume that waits on the host (host_device_comm.cpp)
      throw CommError(wait_failure(where(in), what, in.mb, task.peer, ctx_.timeout, e.what()), e.cause);
    }
  }

  // Posts the batch of SEND/RECV actions that starts at program[index] (if not posted yet).
  void post_batch(size_t index, const RunMode& mode);

  void submit(const std::vector<std::shared_ptr<CommTask>>& tasks, const std::vector<size_t>& actions,
              bool /*here_if_idle*/, const std::vector<Inbox*>& inboxes, c10d::Backend* channel,
              const ComputeStream* on) override {
    TORCH_CHECK(on != nullptr, "pipecore: a device batch posted without its compute stream");
    std::shared_ptr<StreamMarker> ready;
    try {
      ready = device_->post_batch(tasks, *on, /*grouped=*/channel == nullptr);  // (on the tasks' communicator)
    } catch (const std::exception& e) {
      throw post_failure(*tasks.front(), program_[actions.front()], error_text(e));
    }
    for (Inbox* inbox : inboxes) {
      if (inbox) inbox->ready = ready;  // at once: letting go of a receive needs it (stream_contract.h, rule 3)
    }
  }

  void read_in_order(CommTask& task, const Instr& consumer, bool draining) override;
  int64_t read_status(CommTask& task, const Instr& consumer, const char* what, ShapedHeader& header) override;
  std::vector<at::Tensor> follow_up(CommTask& task, const std::vector<TensorSpec>& layout, const Instr& consumer,
                                    const char* what, int64_t key, bool draining, bool& same) override;
  // `task`'s header bytes on the host, waited for (a failed wait names consumer, what, peer).
  at::Tensor header_on_host(CommTask& task, int peer, const Instr& consumer, const char* what);
  // The follow-up of grown `task` (shapes `layout`, keyed `key`) posted, unless it was; false if the key
  // is not the next one from its peer (the channel is out of step).
  bool post_follow_up(CommTask& task, const std::vector<TensorSpec>& layout, int64_t key);
  // The follow-ups of grown messages whose headers are on the host already, read without waiting.
  void post_landed_follow_ups();

  std::unique_ptr<DeviceComm> device_;
  size_t posted_through_ = 0;  // every SEND/RECV before this index is posted
  // per peer: receives posted and not read yet, in posting order (read_in_order)
  std::unordered_map<int, std::deque<std::shared_ptr<CommTask>>> unread_from_;
  std::mutex header_order_mu_;  // read_in_order: the halves of a pair read one peer's headers in order
};

void DevicePath::post_batch(size_t index, const RunMode& mode) {
  if (index < posted_through_) return;  // posted with an earlier action of its batch
  // a discovery run cuts before each later receive of activations from a peer, whose shapes may come
  // from the forward of a message the group sends (p2p_order.py, rule 5)
  const size_t end = (host_reads() ? program_.learning_end : program_.batch_end)[index];
  TORCH_CHECK(end > index, "pipecore: action ", index, " is not a send or receive");
  SpentOn spent(ctx_.profile, Spent::kPost);
  const ComputeStream on = device_->compute_stream();  // the batch's messages are made and posted from it
  // the device path's trailers carry the step status on (device_comm.h)
  const auto trailer = [&](at::Tensor& bytes) { device_->write_trailer(bytes, on); };
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
        inbox = &ctx_.owner.inbox_of(in);
        record_posted_at(program_.recvs_through[j] - 1, index);
        if (task) task->action = static_cast<int64_t>(j);
      } else {
        std::vector<TensorSpec> crossing;
        std::vector<at::Tensor> follow_up;
        int64_t key = 0;
        std::vector<at::Tensor> parts =
            message_of(in, mode.aborted, mode.status, &follow_up, &crossing, &key, trailer);
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
    TORCH_CHECK(follow_ups.empty() || (settings_.up && settings_.down), where(program_[index]),
                ": a grown message on the device path, and no follow-up channels (Executor.set_follow_up_channels)");
    posted_through_ = end;  // once posting starts nothing of it is posted again
    if (tasks.empty()) return;
    post_tasks(tasks, actions, /*tag=*/0, /*here_if_idle=*/false, inboxes, /*channel=*/nullptr, &on);
  } catch (...) {  // (out of memory making a message): its follow-ups are not numbered, as they never go
    format_.follow_ups_numbered = format_.follow_ups_to;
    throw;
  }
  if (!follow_ups.empty()) format_.follow_ups_to = format_.follow_ups_numbered;
  if (format_.shaped) {  // their headers are read in this order (read_in_order)
    for (const auto& task : tasks) {
      if (!task->send) unread_from_[task->peer].push_back(task);
    }
  }
  // posted: the receivers read them, in this run or its aborted rest, and record them alike
  for (auto& [stage, crossing] : crossings) ctx_.specs.crossed_out(stage, std::move(crossing));
  // after their headers, each a batch of its own on the follow-up channel: its receiver posts the
  // receive once it read the header ([Note: NCCL pair order] in device_comm.h)
  for (auto& [action, bytes] : follow_ups) {
    auto task = std::make_shared<CommTask>();
    task->parts = {std::move(bytes)};
    post_tasks({task}, {action}, kFollowUpTag, /*here_if_idle=*/false, {},
               settings_.channel(ctx_.rank, program_[action].peer, /*send=*/true), &on);
  }
}

void DevicePath::read_in_order(CommTask& task, const Instr& consumer, bool draining) {
  // follow-ups match in the order their headers are read ([Note: NCCL pair order]): first every receive
  // from the peer posted before this one and not read yet
  std::lock_guard<std::mutex> lock(header_order_mu_);
  auto& unread = unread_from_[task.peer];
  while (!task.settled) {
    if (unread.empty()) {  // (a discovery run's receives, read on the host as they come)
      read_header(task, consumer, draining);
      return;
    }
    const std::shared_ptr<CommTask> next = unread.front();  // an earlier one is read whole, follow-up too
    read_header(*next, consumer, draining && next.get() == &task);
    unread.pop_front();  // (once read: a failure leaves it first, to be read again by the drain)
  }
}

int64_t DevicePath::read_status(CommTask& task, const Instr& consumer, const char* what, ShapedHeader& header) {
  if (host_reads()) {
    wait_task(task, consumer, what);
    return read_shaped(task.parts, task.layout, format_.large_message_bytes, /*exact=*/true, header);
  }
  // its header's copy on the host, not the data on the device
  const at::Tensor bytes = header_on_host(task, task.peer, consumer, what);
  return read_shaped_header(bytes, task.layout, format_.large_message_bytes, message_bytes(task.parts),
                            /*exact=*/true, header);
}

at::Tensor DevicePath::header_on_host(CommTask& task, int peer, const Instr& consumer, const char* what) {
  SpentOn spent(ctx_.profile, Spent::kWait);
  const WaitingOn waiting(ctx_.flight, peer, consumer.mb, what);
  try {
    at::Tensor header = device_->read_header(task, ctx_.timeout);
    ctx_.flight.completed(task.flight_ticket);  // (its header is copied once the whole message arrived)
    return header;
  } catch (const CommError& e) {
    throw CommError(wait_failure(where(consumer), what, consumer.mb, peer, ctx_.timeout, e.what()), e.cause);
  }
}

bool DevicePath::post_follow_up(CommTask& task, const std::vector<TensorSpec>& layout, int64_t key) {
  if (task.follow_up) return true;
  int64_t& received = format_.follow_ups_from[task.peer];
  if (key != received + 1) return false;  // a follow-up of another message would come
  auto again = std::make_shared<CommTask>();
  again->send = false;
  again->layout = layout;
  again->header_bytes = shaped_header_bytes(layout);  // read by the host, as a shaped message's header
  again->parts = alloc_shaped(layout, ctx_.specs.options(program_[task.action]), kAlwaysPacked, at::Tensor());
  Inbox got;
  const ComputeStream on = device_->compute_stream();
  {
    std::lock_guard<std::mutex> lock(settle_mu_);  // (the halves of an OVERLAP_F_B pair settle at once)
    post_tasks({again}, {static_cast<size_t>(task.action)}, kFollowUpTag, /*here_if_idle=*/false, {&got},
               settings_.channel(ctx_.rank, task.peer, /*send=*/false), &on);
  }
  ++received;
  task.follow_up = again;  // let go of with the message, even if reading it fails
  task.follow_up_ready = got.ready;
  return true;
}

void DevicePath::post_landed_follow_ups() {
  if (!format_.shaped || host_reads() || !settings_.up || !settings_.down) return;
  std::lock_guard<std::mutex> lock(header_order_mu_);
  for (auto& [peer, unread] : unread_from_) {
    for (const auto& task : unread) {  // (one peer's headers land in the order they were posted)
      if (task->settled || task->header_landed) continue;
      if (!device_->header_arrived(*task)) break;
      task->header_landed = true;
      ShapedHeader header;
      int64_t status = kMessageUnknown;
      try {
        status = read_shaped_header(task->header_host, task->layout, format_.large_message_bytes,
                                    message_bytes(task->parts), /*exact=*/true, header);
      } catch (const c10::Error&) {
      }
      if (status != kMessageGrown) continue;  // (anything wrong with it, its consumer says)
      try {
        post_follow_up(*task, with_shapes(task->layout, header.shapes), header.follow_up);
      } catch (...) {  // (out of memory for its buffer): its consumer raises it, naming the action it concerns
        task->follow_up_failure = std::current_exception();
      }
    }
  }
}

std::vector<at::Tensor> DevicePath::follow_up(CommTask& task, const std::vector<TensorSpec>& layout,
                                              const Instr& consumer, const char* what, int64_t key,
                                              bool draining, bool& same) {
  // the follow-up keyed `key` (the key-th from its peer), received packed on the follow-up channel (once:
  // the drain after a failure that came after receiving it reads it again, and its header's landing may
  // have posted it before: post_landed_follow_ups); the compute stream waits for it unless `draining`
  TORCH_CHECK(settings_.up && settings_.down, where(consumer),
              ": a grown message on the device path, and no follow-up channels");
  const ComputeStream on = device_->compute_stream();
  if (task.follow_up_failure && !draining) std::rethrow_exception(std::exchange(task.follow_up_failure, nullptr));
  if (!post_follow_up(task, layout, key)) {  // a follow-up of another message would come: the channel is out of step
    same = false;
    return {};
  }
  CommTask& again = *task.follow_up;
  const at::Tensor bytes = header_on_host(again, task.peer, consumer, what);
  ShapedHeader second;
  same = draining || (read_shaped_header(bytes, layout, kAlwaysPacked, message_bytes(again.parts), /*exact=*/true,
                                         second) == kMessageOk &&
                      second.shapes == task.shapes);
  if (same && !draining && !task.follow_up_consumed) {
    device_->consume(again, *task.follow_up_ready, on);  // the compute stream reads it next
    task.follow_up_consumed = true;
  }
  return again.parts;
}

}  // namespace

std::unique_ptr<MessagePath> make_device_path(PathContext context, MessageFormat format, PathSettings settings,
                                              std::unique_ptr<DeviceComm> device) {
  return std::make_unique<DevicePath>(context, std::move(format), std::move(settings), std::move(device));
}

}  // namespace pipecore
