// Receives: their buffers, the host path's window of receives posted ahead, waiting for them, and
// reading what arrived (a trailer's status, a shaped message's header, a grown message's follow-up).
#include <c10/util/Exception.h>

#include <cstring>

#include "comm.h"
#include "comm_task.h"
#include "device_comm.h"
#include "diagnostics.h"
#include "executor.h"
#include "outcome.h"

namespace pipecore {

std::shared_ptr<CommTask> Executor::make_recv(const Instr& in, bool aborted) {
  const bool activations = carries_activations(in.op);
  // output gradients whose shapes were never learnt: this stage's forward did not run, nothing comes
  if (activations ? !learn_specs(in, aborted) : !specs_.output_known(grid_.key(in))) return nullptr;
  const auto& specs = specs_.received(in);
  if (specs.empty()) return nullptr;  // nothing of the message needs a gradient, or it never comes
  const at::TensorOptions& options = specs_.options(in);
  auto task = std::make_shared<CommTask>();
  task->send = false;
  // allocated before anything records the receive as posted: a failed allocation leaves it unposted
  const at::Tensor dropped = aborted ? scratch(options, payload_bytes(specs), /*for_sends=*/false) : at::Tensor();
  task->parts = shaped_.travel ? alloc_shaped(specs, options, large_message_bytes_, dropped)
                               : alloc_frame(specs, options, large_message_bytes_, dropped);
  if (shaped_.travel) {
    task->layout = specs;
    if (device_comm_) task->header_bytes = shaped_header_bytes(specs);  // read by the host (device_comm.h)
  }
  slot(in).inbox_of(in.op).task = task;
  return task;
}

void Executor::post_recvs_until(size_t end, size_t at, bool aborted) {
  if (window_.posted() >= end) return;
  SpentOn spent(profile_, Spent::kPost);
  while (window_.posted() < end) {
    const size_t k = window_.posted();
    const size_t index = program_.recv_instrs[k];
    const Instr& in = program_[index];
    // a failed allocation leaves the receive unposted (an aborted step posts it); once posting
    // starts it counts as posted: a posting failure breaks the group, and parts must not go twice
    std::shared_ptr<CommTask> task = make_recv(in, aborted);
    if constexpr (kTesting) recv_posted_at_[k] = static_cast<int64_t>(at);
    window_.mark_posted(k);
    if (!task) continue;
    task->action = static_cast<int64_t>(index);
    task->ordinal = counts_.received_from[static_cast<int>(in.peer)]++;  // (a grown message's follow-up tag)
    post({task}, {index});
  }
}

void Executor::prefetch_recvs(size_t at) {
  if (run_.discovering()) return;  // each receive at its own action (its shapes may not be known before)
  auto bytes_of = [this](size_t k) { return payload_bytes(specs_.received(program_[program_.recv_instrs[k]])); };
  post_recvs_until(window_.post_through(program_, at, bytes_of), at);
}

const std::vector<at::Tensor>& Executor::receive(Inbox& inbox, const Instr& in, const char* what) {
  CommTask& task = *inbox.task;
  if (device_comm_ && !host_reads()) {
    TORCH_CHECK(inbox.ready, where(in), ": a device receive without its batch's ready marker");
    if (shaped_.travel) settle(task, in, what, /*draining=*/false);  // the host reads its header
    try {
      SpentOn spent(profile_, Spent::kWait);
      device_comm_->consume(task, *inbox.ready);  // (a trailer's status folds on the device, read at the step's end)
      inbox.consumed = true;
    } catch (const CommError& e) {  // a consume that waits on the host (host_device_comm.cpp)
      throw CommError(wait_failure(where(in), what, in.mb, task.peer, timeout_, e.what()));
    }
  } else if (shaped_.travel) {
    settle(task, in, what, /*draining=*/false);  // (waits for it)
  } else {
    wait_task(task, in, what);
    const int64_t status = message_status(task.parts);
    raise_if_failed(status, [&] {
      return message_status_text(where(in), what, in.mb, task.peer, status, "do not end with pipecore's trailer");
    });
  }
  return task.follow_up_parts.empty() ? task.parts : task.follow_up_parts;
}

void Executor::drain(Inbox& inbox, const Instr& in, const char* what, bool wait) {
  if (wait && inbox.task) {
    if (shaped_.travel) {
      // waited for and read: its header says whether it comes again (grown) and what crossed, as the
      // sender counts it
      settle(*inbox.task, in, what, /*draining=*/true);
    } else if (!device_comm_ || host_reads()) {  // (the device waits on its own)
      wait_task(*inbox.task, in, what);
    }
  }
  let_go(inbox);
}

void Executor::let_go(Inbox& inbox) {
  if (inbox.task && inbox.ready) {
    CommTask& task = *inbox.task;
    try {
      device_comm_->release(task, *inbox.ready, inbox.consumed);
      if (task.follow_up) device_comm_->release(*task.follow_up, *task.follow_up_ready, task.follow_up_consumed);
    } catch (...) {  // the stream contract's checker keeps its refusals (stream_violations)
    }
    task.follow_up.reset();
  }
  inbox = Inbox();
}

void Executor::clear_slots() {
  for (auto& s : slots_) {
    let_go(s.recv_f);
    let_go(s.recv_b);
    s = Slot();
  }
  shaped_.unread_from.clear();
}

void Executor::wait_task(CommTask& task, const Instr& in, const char* what) {
  SpentOn spent(profile_, Spent::kWait);
  if (task.queued) await_posted(task, in);
  for (auto& work : task.works) {
    if (!work) continue;
    try {
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw CommError(wait_failure(where(in), what, in.mb, task.peer, timeout_, e.what()));
    }
    work.reset();
  }
  task.works.clear();
}

void Executor::settle(CommTask& task, const Instr& action, const char* what, bool draining) {
  Instr in = action;  // the action that consumes the message (F, B, I): it came from the task's peer
  in.peer = task.peer;
  if (!task.settled) {
    if (device_comm_) {
      read_headers_through(task, in, draining);
    } else {
      read_header(task, in, draining);
    }
  }
  if (draining) return;
  raise_if_failed(task.status, [&] {
    return message_status_text(where(in), what, in.mb, in.peer, task.status,
                               task.follow_up_failed ? "came again (grown) with other shapes than their header said"
                                                     : "do not start with pipecore's header");
  });
}

void Executor::read_header(CommTask& task, const Instr& consumer, bool draining) {
  if (task.settled) return;
  const Instr& in = program_[task.action];  // its RECV (waits are the consuming action's, in errors)
  const char* what = message_name(in.op);
  const bool exact = device_comm_ != nullptr;  // NCCL: every message at its capacity's size (comm.h)
  ShapedHeader header;
  if (device_comm_ && !host_reads()) {  // its header's copy on the host, not the data on the device
    const at::Tensor bytes = header_on_host(task, task.peer, consumer, what);
    task.status = read_shaped_header(bytes, task.layout, large_message_bytes_, message_bytes(task.parts), exact,
                                     header);
  } else {
    wait_task(task, consumer, what);
    task.status = read_shaped(task.parts, task.layout, large_message_bytes_, exact, header);
  }
  task.shapes = header.shapes;
  if (task.status == kMessageGrown) {
    // its data follows as a message of its own shapes (comm.h): on gloo at its own size on a tag of
    // its own, on the device path on the follow-up channel ([Note: NCCL pair order])
    const std::vector<TensorSpec> layout = with_shapes(task.layout, task.shapes);
    bool same = draining;
    std::vector<at::Tensor> parts;
    if (exact) {
      parts = follow_up_on_channel(task, layout, consumer, what, header.follow_up, draining, same);
    } else {
      parts = follow_up_by_tag(task, layout, consumer, what, draining);
      ShapedHeader second;
      same = same || (read_shaped(parts, layout, large_message_bytes_, exact, second) == kMessageOk &&
                      second.shapes == task.shapes);
    }
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
    specs_.crossed_in(in.stage, with_shapes(task.layout, task.shapes));
    if (shaped_.batch_rows < 0) shaped_.batch_rows = header.rows;  // (set_batch_rows)
  }
}

std::vector<at::Tensor> Executor::follow_up_by_tag(const CommTask& task, const std::vector<TensorSpec>& layout,
                                                   const Instr& consumer, const char* what, bool draining) {
  const Instr& in = program_[task.action];
  auto again = std::make_shared<CommTask>();
  again->send = false;
  again->layout = layout;
  const at::TensorOptions& options = specs_.options(in);
  // dropped unread: as an aborted step's receives, its data into the scratch, so that a rank out of
  // memory still releases its peer
  const at::Tensor dropped = draining ? scratch(options, payload_bytes(layout), /*for_sends=*/false) : at::Tensor();
  again->parts = alloc_shaped(layout, options, large_message_bytes_, dropped);
  {
    std::lock_guard<std::mutex> lock(settle_mu_);  // (the halves of an OVERLAP_F_B pair settle at once)
    post({again}, {static_cast<size_t>(task.action)}, kFollowUpTag + task.ordinal);
  }
  wait_task(*again, consumer, what);
  return std::move(again->parts);
}

at::Tensor Executor::header_on_host(CommTask& task, int peer, const Instr& consumer, const char* what) {
  SpentOn spent(profile_, Spent::kWait);
  try {
    return device_comm_->read_header(task, timeout_);
  } catch (const CommError& e) {
    throw CommError(wait_failure(where(consumer), what, consumer.mb, peer, timeout_, e.what()));
  }
}

void Executor::read_headers_through(CommTask& task, const Instr& consumer, bool draining) {
  std::lock_guard<std::mutex> lock(header_order_mu_);
  auto& unread = shaped_.unread_from[task.peer];
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

std::vector<at::Tensor> Executor::follow_up_on_channel(CommTask& task, const std::vector<TensorSpec>& layout,
                                                       const Instr& consumer, const char* what, int64_t ordinal,
                                                       bool draining, bool& same) {
  TORCH_CHECK(shaped_.up && shaped_.down, where(consumer), ": a grown message on the device path, and no follow-up "
              "channels");
  if (!task.follow_up) {
    int64_t& received = shaped_.follow_ups_from[task.peer];
    if (ordinal != received + 1) {  // a follow-up of another message would come: the channel is out of step
      same = false;
      return {};
    }
    auto again = std::make_shared<CommTask>();
    again->send = false;
    again->layout = layout;
    again->header_bytes = shaped_header_bytes(layout);  // read by the host, as a shaped message's header
    again->parts = alloc_shaped(layout, specs_.options(program_[task.action]), kAlwaysPacked, at::Tensor());
    Inbox got;
    {
      std::lock_guard<std::mutex> lock(settle_mu_);  // (the halves of an OVERLAP_F_B pair settle at once)
      post({again}, {static_cast<size_t>(task.action)}, kFollowUpTag, /*here_if_idle=*/false, {&got},
           shaped_.channel(rank_, task.peer, /*send=*/false));
    }
    ++received;
    task.follow_up = again;  // let go of with the message, even if reading it fails
    task.follow_up_ready = got.ready;
  }
  CommTask& again = *task.follow_up;
  const at::Tensor bytes = header_on_host(again, task.peer, consumer, what);
  ShapedHeader second;
  same = draining || (read_shaped_header(bytes, layout, kAlwaysPacked, message_bytes(again.parts), /*exact=*/true,
                                         second) == kMessageOk &&
                      second.shapes == task.shapes);
  if (same && !draining && !task.follow_up_consumed) {
    device_comm_->consume(again, *task.follow_up_ready);  // the compute stream reads it next
    task.follow_up_consumed = true;
  }
  return again.parts;
}

}  // namespace pipecore
