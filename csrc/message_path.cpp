// What both message paths share (message_path.h): a message's buffers and framing, posting and counting,
// the send tracker, the scratch and reading a shaped message's header; and the factory, the one place
// that chooses a path.
#include "message_path.h"

#include <ATen/ops/full_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>

#include "collectives.h"
#include "comm_task.h"
#include "device_comm.h"
#include "diagnostics.h"
#include "message_status.h"
#include "send_tracker.h"

namespace pipecore {

std::unique_ptr<MessagePath> make_message_path(PathContext context, const c10::Device* device, MessagePath* replacing) {
  if (!device) return make_host_path(context, MessageFormat(), PathSettings());
  TORCH_CHECK(replacing != nullptr, "pipecore: a device path replaces the executor's first path");
  std::unique_ptr<DeviceComm> on_device = make_device_comm(*device);  // first: if it throws, nothing moved
  if (!on_device) return nullptr;
  auto [format, settings] = replacing->pass_on();
  return make_device_path(context, std::move(format), std::move(settings), std::move(on_device));
}

MessagePath::MessagePath(PathContext context, MessageFormat format, PathSettings settings)
    : ctx_(context),
      program_(context.program),
      format_(std::move(format)),
      settings_(std::move(settings)),
      sends_(std::make_unique<SendTracker>(context.flight)) {
#ifdef PIPECORE_TESTING
  rng_.seed(settings_.delay_seed);
#endif
}

MessagePath::~MessagePath() = default;

void MessagePath::join_threads() { sends_.reset(); }

std::pair<MessageFormat, PathSettings> MessagePath::pass_on() {
  MessageFormat format = std::move(format_);
  format.shaped = false;
  format.follow_ups_numbered.clear();
  format.follow_ups_to.clear();
  format.follow_ups_from.clear();
  return {std::move(format), std::move(settings_)};
}

void MessagePath::reset(size_t recv_count) {
  counts_ = MessageCounts();
#ifdef PIPECORE_TESTING
  recv_posted_at_.assign(recv_count, -1);
#endif
  sends_->clear_failure();
  sends_->reset_peak();
}

int64_t MessagePath::peak_send_bytes() const { return sends_->peak_bytes(); }
int64_t MessagePath::held_failed_sends() const { return sends_->held_failed(); }

// --- receives

std::shared_ptr<CommTask> MessagePath::make_recv(const Instr& in, bool aborted) {
  const bool activations = carries_activations(in.op);
  // output gradients whose shapes were never learnt: this stage's forward did not run, nothing comes
  if (activations ? !ctx_.owner.learn_specs(in, aborted) : !ctx_.specs.output_known(ctx_.specs.key(in))) {
    return nullptr;
  }
  const auto& specs = ctx_.specs.received(in);
  if (specs.empty()) return nullptr;  // nothing of the message needs a gradient, or it never comes
  const at::TensorOptions& options = ctx_.specs.options(in);
  auto task = std::make_shared<CommTask>();
  task->send = false;
  // allocated before anything records the receive as posted: a failed allocation leaves it unposted
  const at::Tensor dropped = aborted ? scratch(options, payload_bytes(specs), /*for_sends=*/false) : at::Tensor();
  const int64_t large = format_.large_message_bytes;
  task->parts =
      format_.shaped ? alloc_shaped(specs, options, large, dropped) : alloc_frame(specs, options, large, dropped);
  if (format_.shaped) {
    task->layout = specs;
    if (format_.exact) task->header_bytes = shaped_header_bytes(specs);  // read by the host (device_comm.h)
  }
  ctx_.owner.inbox_of(in).task = task;
  return task;
}

at::Tensor MessagePath::exchange(const at::Tensor& tensor, int64_t peer, const std::string& what) {
  return pipecore::exchange(ctx_.pg, tensor, peer, std::chrono::duration<double>(ctx_.timeout).count(), what);
}

std::vector<at::Tensor> MessagePath::take(Inbox& inbox, const Instr& in, const std::vector<TensorSpec>& specs) {
  const std::vector<at::Tensor>& parts = receive(inbox, in, message_name(in.op));
  std::vector<at::Tensor> tensors =
      format_.shaped ? unframe_shaped(parts, inbox.task->layout, inbox.task->shapes) : unframe(parts, specs);
  let_go(inbox);
  return tensors;
}

const std::vector<at::Tensor>& MessagePath::receive(Inbox& inbox, const Instr& in, const char* what) {
  CommTask& task = *inbox.task;
  if (host_reads()) wait_task(task, in, what);
  before_reading(inbox, in, what);
  if (format_.shaped) {
    settle(task, in, what, /*draining=*/false);  // the host reads its header (on the device path its copy)
  } else if (host_reads()) {  // (else the device reads it: DeviceComm::consume)
    const int64_t status = message_status(task.parts);
    raise_if_failed(status, [&] {
      return message_status_text(where(in), what, in.mb, task.peer, status, "do not end with pipecore's trailer");
    });
  }
  return task.follow_up_parts.empty() ? task.parts : task.follow_up_parts;
}

void MessagePath::drop(Inbox& inbox, const Instr& in, bool wait) {
  if (wait && inbox.task) {
    if (format_.shaped) {
      // waited for and read: its header says whether it comes again (grown) and what crossed, as the sender
      // counts it
      settle(*inbox.task, in, message_name(in.op), /*draining=*/true);
    } else if (host_reads()) {  // (else the device waits on its own)
      wait_task(*inbox.task, in, message_name(in.op));
    }
  }
  let_go(inbox);
}

void MessagePath::wait_task(CommTask& task, const Instr& in, const char* what) {
  SpentOn spent(ctx_.profile, Spent::kWait);
  const WaitingOn waiting(ctx_.flight, task.peer, in.mb, what, task.send);
  if (task.queued) await_posted(task, in);
  for (auto& work : task.works) {
    if (!work) continue;
    try {
      work->wait(ctx_.timeout);
    } catch (const std::exception& e) {
      throw CommError(wait_failure(where(in), what, in.mb, task.peer, ctx_.timeout), error_text(e));
    }
    work.reset();
  }
  task.works.clear();
  ctx_.flight.completed(task.flight_ticket);
}

void MessagePath::settle(CommTask& task, const Instr& action, const char* what, bool draining) {
  Instr in = action;  // the action that consumes the message (F, B, I): it came from the task's peer
  in.peer = task.peer;
  if (!task.settled) read_in_order(task, in, draining);
  if (draining) return;
  raise_if_failed(task.status, [&] {
    return message_status_text(where(in), what, in.mb, in.peer, task.status,
                               task.follow_up_failed ? "came again (grown) with other shapes than their header said"
                                                     : "do not start with pipecore's header");
  });
}

void MessagePath::read_header(CommTask& task, const Instr& consumer, bool draining) {
  if (task.settled) return;
  const Instr& in = program_[task.action];  // its RECV (waits are the consuming action's, in errors)
  const char* what = message_name(in.op);
  ShapedHeader header;
  task.status = read_status(task, consumer, what, header);
  task.shapes = header.shapes;
  if (task.status == kMessageGrown) {
    // its data follows as a message of its own shapes (comm.h): on gloo at its own size on a tag of
    // its own, on the device path on the follow-up channel ([Note: NCCL pair order])
    const std::vector<TensorSpec> layout = with_shapes(task.layout, task.shapes);
    bool same = draining;
    std::vector<at::Tensor> parts = follow_up(task, layout, consumer, what, header.follow_up, draining, same);
    task.status = same ? kMessageOk : kMessageUnknown;
    task.follow_up_failed = !same;
    if (same && !draining) {
      task.follow_up_parts = std::move(parts);
      task.layout = layout;
    }
  }
  task.settled = true;
  if (task.status == kMessageOk && carries_activations(in.op)) {
    std::lock_guard<std::mutex> lock(settle_mu_);
    ctx_.specs.crossed_in(in.stage, with_shapes(task.layout, task.shapes));
    if (format_.batch_rows < 0) format_.batch_rows = header.rows;  // (Executor::set_batch_rows)
  }
}

// --- sends

std::vector<at::Tensor> MessagePath::message_of(const Instr& in, bool aborted, int64_t status,
                                                std::vector<at::Tensor>* follow_up, std::vector<TensorSpec>* crossing,
                                                int64_t* key, const std::function<void(at::Tensor&)>& trailer) {
  const at::TensorOptions& options = ctx_.specs.options(in);
  const bool exact = format_.exact;  // NCCL: a message at its capacity's size (comm.h)
  const int64_t large = format_.large_message_bytes;
  if (aborted) {
    const std::vector<TensorSpec> specs = ctx_.owner.learn_send_specs(in);
    if (specs.empty()) return {};
    // (a message without data on gloo is its header: no scratch)
    const at::Tensor filler = format_.shaped && !exact
                                  ? at::Tensor()
                                  : scratch(options, payload_bytes(specs), /*for_sends=*/true);
    if (format_.shaped) return frame_shaped({}, specs, large, status, 0, options, exact, filler);
    return abort_frame(specs, options, status, large, filler);
  }
  std::vector<at::Tensor> tensors = ctx_.owner.outgoing(in);
  if (tensors.empty()) return {};
  if (!format_.shaped) return frame(tensors, large, trailer);
  const std::vector<TensorSpec> cap = ctx_.specs.of(in);
  TORCH_CHECK(tensors.size() == cap.size(), where(in), ": a message of ", tensors.size(), " tensors where ",
              cap.size(), " were planned");
  std::vector<TensorSpec> sent = with_shapes(cap, shapes_of(tensors));
  const int64_t rows = std::max<int64_t>(format_.batch_rows, 0);
  const bool fits = fits_capacity(sent, cap, large);
  int64_t follow_up_key = 0;
  if (!fits) {  // its header now (status grown, its shapes, its follow-up's key), then the message at its own size
    TORCH_CHECK(follow_up != nullptr && key != nullptr, where(in), ": a grown message without a follow-up");
    // on the device path packed, on a follow-up channel (Executor::set_follow_up_channels)
    *follow_up = frame_shaped(tensors, sent, exact ? kAlwaysPacked : large, kMessageOk, rows, options);
    follow_up_key = *key = ++format_.follow_ups_numbered[static_cast<int>(in.peer)];
  }
  // a grown device message's header goes at its capacity's size, padded from the scratch
  const at::Tensor filler = !fits && exact ? scratch(options, payload_bytes(cap), /*for_sends=*/true) : at::Tensor();
  std::vector<at::Tensor> parts = frame_shaped(tensors, cap, large, fits ? kMessageOk : kMessageGrown, rows, options,
                                               exact, filler, follow_up_key);
  if (carries_activations(in.op) && crossing != nullptr) *crossing = std::move(sent);
  return parts;
}

Outcome MessagePath::finish_step() {
  try {
    drain_sends();
    check_step_status();
  } catch (...) {
    return Outcome::of_current_exception();
  }
  return Outcome();
}

void MessagePath::check_sends() {
  if (sends_->failed()) sends_->raise_failure();
}

void MessagePath::drain_sends() {
  SpentOn spent(ctx_.profile, Spent::kWait);
  const WaitingOn waiting(ctx_.flight, -1, -1, "the step's last sends", /*send=*/true);
  if (!sends_->drain(ctx_.timeout)) {
    throw CommError(not_within("pipecore " + ctx_.who + ": sends of this step did not complete", ctx_.timeout,
                               "a peer stopped receiving"));
  }
  check_sends();
}

at::Tensor MessagePath::seed_of(const at::Tensor& loss, double value) { return at::full_like(loss, value); }

at::Tensor MessagePath::scratch(const at::TensorOptions& options, int64_t bytes, bool for_sends) {
  // sends have their own: a receive dropped unread waits (on the device) for its own transfer only,
  // not for a later send's from the same block (stream_contract.h, rule 3)
  at::Tensor& buffer = for_sends ? send_scratch_ : recv_scratch_;
  if (!buffer.defined() || buffer.device() != options.device() || buffer.numel() < bytes) {
    // zeros: on a device, compute may run on an aborted message before its status is read
    buffer = at::zeros({std::max<int64_t>(bytes, 1)}, options.dtype(at::kByte));
  }
  return buffer;
}

void MessagePath::drop_scratch(bool receives_too) {
  send_scratch_ = at::Tensor();  // (sends in flight keep theirs alive as long as needed)
  if (receives_too) recv_scratch_ = at::Tensor();
}

// --- posting: the one posting path of every message (as DualPipe's _commit_and_wait_comm owns post, wait
// and free): each message is addressed here, posted by its path (submit), counted, and a send handed to
// the send tracker, which frees it once it completed.

void MessagePath::post_tasks(const std::vector<std::shared_ptr<CommTask>>& tasks, const std::vector<size_t>& actions,
                             int tag, bool here_if_idle, const std::vector<Inbox*>& inboxes, c10d::Backend* channel,
                             const ComputeStream* on) {
  for (size_t k = 0; k < tasks.size(); ++k) {
    CommTask& task = *tasks[k];
    task.peer = static_cast<int>(program_[actions[k]].peer);
    task.tag = tag;
    task.group = ctx_.pg.get();
    task.channel = channel;
  }
  const bool follow_up_receive = tag != 0 && !tasks.front()->send;
  if (!follow_up_receive) maybe_delay();  // (posted under settle_mu_: the other half would wait out the delay)
  submit(tasks, actions, here_if_idle, inboxes, channel, on);
  for (size_t k = 0; k < tasks.size(); ++k) {  // (before the tracker, which completes them, has the sends)
    CommTask& task = *tasks[k];
    task.flight_ticket = ctx_.flight.posted(static_cast<int64_t>(actions[k]), task.peer, message_bytes(task.parts),
                                            task.send, /*follow_up=*/tag != 0);
  }
  for (size_t k = 0; k < tasks.size(); ++k) {
    if (!tasks[k]->send) continue;
    const Instr& in = program_[actions[k]];
    if (tag == 0) {
      ++counts_.sent_messages;
    } else {
      ++counts_.grown_messages;
    }
    counts_.sent_parts += static_cast<int64_t>(tasks[k]->parts.size());
    const int64_t bytes = message_bytes(tasks[k]->parts);
    sends_->track(tasks[k], bytes, where(in) + ": send to rank " + std::to_string(in.peer), ctx_.timeout,
                  /*aside=*/tag != 0);
  }
}

CommError MessagePath::post_failure(const CommTask& task, const Instr& in, const std::string& cause) const {
  return CommError(where(in) + ": " + (task.send ? "sending to" : "receiving from") + " rank " +
                   std::to_string(task.peer) + " failed",
                   cause);
}

void MessagePath::await_posted(CommTask& task, const Instr& in) {
  if (!task.wait_posted(ctx_.timeout)) throw CommError(not_posted(where(in), task.send, task.peer, ctx_.timeout));
  if (task.error) throw post_failure(task, in, error_text(task.error));
}

#ifdef PIPECORE_TESTING
void MessagePath::maybe_delay() {
  if (settings_.delay_us <= 0) return;
  std::uniform_int_distribution<int64_t> dist(0, settings_.delay_us);
  std::this_thread::sleep_for(std::chrono::microseconds(dist(rng_)));
}
#endif

}  // namespace pipecore
