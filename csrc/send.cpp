// Sends on the host path: what a SEND action sends, its message (an aborted step's of the same size),
// the peer's budget of bytes in flight, and waiting for every send at the step's end. The device path
// sends with its batches (device_batches.cpp); both build messages here and post through posting.cpp.
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "comm.h"
#include "device_comm.h"
#include "diagnostics.h"
#include "executor.h"
#include "send_tracker.h"

namespace pipecore {

void Executor::send_action(size_t index, const RunMode& mode) {
  const Instr& in = program_[index];
  if (mode.aborted) {
    if (static_cast<int64_t>(index) == last_send_posted_) return;  // the failure came after its send
    std::vector<at::Tensor> parts = message_of(in, /*aborted=*/true, mode.status);
    if (!parts.empty()) send(std::move(parts), index, /*budgeted=*/mode.wait, /*aborted=*/true);
    return;
  }
  SpentOn spent(profile_, Spent::kPost);
  std::vector<at::Tensor> follow_up;
  std::vector<TensorSpec> crossing;
  std::vector<at::Tensor> parts = message_of(in, /*aborted=*/false, 0, &follow_up, &crossing);
  const int ordinal = counts_.sent_to[static_cast<int>(in.peer)];  // this message's among those to its peer
  if (!parts.empty()) send(std::move(parts), index, /*budgeted=*/true, /*aborted=*/false);
  if (!follow_up.empty()) {
    // outside the peer's budget: it completes when the receiver reads the message, which later sends
    // must not wait for
    send(std::move(follow_up), index, /*budgeted=*/false, /*aborted=*/false, kFollowUpTag + ordinal);
  }
  // posted: the receiver reads it, in this run or its aborted rest, and records it alike
  if (!crossing.empty()) specs_.crossed_out(in.stage, std::move(crossing));
}

std::vector<at::Tensor> Executor::outgoing(const Instr& in) {
  Slot& s = slot(in);
  if (!carries_activations(in.op)) return take_input_grads(s);
  TORCH_CHECK(!s.outputs.empty(), where(in), ": nothing to send (forward produced no tensors)");
  // The slot lets go of the outputs: the message keeps the data alive until sent, the autograd graph
  // lives on through the stored gradient edges.
  std::vector<at::Tensor> tensors = std::move(s.outputs);
  s.outputs.clear();
  if (free_outputs_) {
    ++freed_outputs_;
  } else {
    kept_.insert(kept_.end(), tensors.begin(), tensors.end());
  }
  return tensors;
}

std::vector<at::Tensor> Executor::message_of(const Instr& in, bool aborted, int64_t status,
                                             std::vector<at::Tensor>* follow_up, std::vector<TensorSpec>* crossing,
                                             int64_t* key) {
  const at::TensorOptions& options = specs_.options(in);
  const bool exact = device_comm_ != nullptr;  // NCCL: a message at its capacity's size (comm.h)
  if (aborted) {
    const std::vector<TensorSpec> specs = learn_send_specs(in);
    if (specs.empty()) return {};
    // (a message without data on gloo is its header: no scratch)
    const at::Tensor filler = shaped_.travel && !exact
                                  ? at::Tensor()
                                  : scratch(options, payload_bytes(specs), /*for_sends=*/true);
    if (shaped_.travel) return frame_shaped({}, specs, large_message_bytes_, status, 0, options, exact, filler);
    return abort_frame(specs, options, status, large_message_bytes_, filler);
  }
  std::vector<at::Tensor> tensors = outgoing(in);
  if (tensors.empty()) return {};
  if (shaped_.travel) {
    const std::vector<TensorSpec> cap = specs_.of(in);
    TORCH_CHECK(tensors.size() == cap.size(), where(in), ": a message of ", tensors.size(), " tensors where ",
                cap.size(), " were planned");
    std::vector<TensorSpec> sent = with_shapes(cap, shapes_of(tensors));
    const int64_t rows = std::max<int64_t>(shaped_.batch_rows, 0);
    const bool fits = fits_capacity(sent, cap, large_message_bytes_);
    int64_t follow_up_key = 0;
    if (!fits) {  // its header now (status grown, its shapes), then the message at its own size
      TORCH_CHECK(follow_up != nullptr, where(in), ": a grown message without a follow-up");
      if (exact) {  // packed, on a follow-up channel (set_follow_up_channels)
        TORCH_CHECK(key != nullptr, where(in), ": a grown device message without a key");
        *follow_up = frame_shaped(tensors, sent, kAlwaysPacked, kMessageOk, rows, options);
        follow_up_key = *key = ++shaped_.follow_ups_numbered[static_cast<int>(in.peer)];  // (post_batch commits)
      } else {
        *follow_up = frame_shaped(tensors, sent, large_message_bytes_, kMessageOk, rows, options);
      }
    }
    // a grown device message's header goes at its capacity's size, padded from the scratch
    const at::Tensor filler =
        !fits && exact ? scratch(options, payload_bytes(cap), /*for_sends=*/true) : at::Tensor();
    std::vector<at::Tensor> parts = frame_shaped(tensors, cap, large_message_bytes_, fits ? kMessageOk : kMessageGrown,
                                                 rows, options, exact, filler, follow_up_key);
    if (carries_activations(in.op) && crossing != nullptr) *crossing = std::move(sent);
    return parts;
  }
  if (!device_comm_) return frame(tensors, large_message_bytes_);
  // the device path's trailers carry the step status on (device_comm.h)
  return frame(tensors, large_message_bytes_, [this](at::Tensor& trailer) { device_comm_->write_trailer(trailer); });
}

void Executor::send(std::vector<at::Tensor> parts, size_t index, bool budgeted, bool aborted, int tag) {
  const Instr& in = program_[index];
  const int64_t bytes = message_bytes(parts);
  bool reserved = true;
  if (budgeted) {
    SpentOn spent(profile_, Spent::kWait);
    reserved = sends_->reserve(static_cast<int>(in.peer), bytes, send_budget_, timeout_);
  }
  if (!reserved) {
    throw CommError(not_within(where(in) + ": earlier sends to rank " + std::to_string(in.peer) + " did not complete",
                               timeout_, "the peer stopped receiving"));
  }
  if (!aborted) check_sends();  // an aborted step still releases every peer it can
  auto task = std::make_shared<CommTask>();
  task->parts = std::move(parts);
  // the thread waits for a message next anyway: posting here spares the message the worker's wake-up
  post({task}, {index}, tag, tag == 0 && program_.waits_next[index] && bytes <= kPostHereBytes);
}

void Executor::check_sends() {
  if (sends_->failed()) throw CommError(sends_->failure());
}

void Executor::drain_sends() {
  SpentOn spent(profile_, Spent::kWait);
  if (!sends_->drain(timeout_)) {
    throw CommError(not_within("pipecore " + who_ + ": sends of this step did not complete", timeout_,
                               "a peer stopped receiving"));
  }
  check_sends();
}

at::Tensor Executor::scratch(const at::TensorOptions& options, int64_t bytes, bool for_sends) {
  // sends have their own: a receive dropped unread waits (on the device) for its own transfer only,
  // not for a later send's from the same block (stream_contract.h, rule 3)
  at::Tensor& buffer = for_sends ? send_scratch_ : recv_scratch_;
  if (!buffer.defined() || buffer.device() != options.device() || buffer.numel() < bytes) {
    // zeros: on a device, compute may run on an aborted message before its status is read
    buffer = at::zeros({std::max<int64_t>(bytes, 1)}, options.dtype(at::kByte));
  }
  return buffer;
}

}  // namespace pipecore
