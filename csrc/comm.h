// Point-to-point messages between stages. A message ends with a 16-byte trailer: a status word
// (ok / the sender's step was aborted / shapes changed) and a magic number. The status lets an
// aborted step run to its end on every rank with no rank left waiting (see Executor::run).
//
// On the wire a message is a list of parts, sent and received in order:
// - small (payload under `large`, by default kLargeMessageBytes): one byte buffer, its tensors packed (each 16-byte
//   aligned) followed by the trailer: one send however many tensors;
// - large: every tensor sent from its own storage (no copy), then the trailer alone.
// Sender and receiver choose the same layout from the byte size of the planned tensors.
//
// Shaped messages (the host path, Executor::set_shapes_travel) carry their tensors' shapes, so that
// the receiver need not know them: a header of int64 words [status, magic, the step's batch rows,
// each tensor's dims] comes first, and receives are posted at a capacity (per tensor, the most
// elements that crossed that boundary so far, as a shape [n, 1, ...] of the tensor's rank) that the
// message may fall short of (gloo accepts a shorter message). The capacity picks the layout:
// - packed (payload capacity under `large`): one buffer, the header then the tensors (each 16-byte
//   aligned at its actual size);
// - large: the header alone, then one part per tensor whose capacity holds any element (a shorter or
//   empty tensor travels as it is).
// A message that does not fit the capacity goes as its header alone, status kMessageGrown, in the
// capacity's layout, then follows at its own size (its shapes as the capacity) on a tag of its own,
// kFollowUpTag + the message's ordinal among those sent to that peer in the step (the receiver
// counts its receives from that peer alike: gloo matches them in that order), so that each rank may
// read its grown messages in any order.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "executor.h"
#include "message_status.h"

namespace pipecore {

// Writes a 16-byte trailer (a byte tensor on the message's device) in place of the default "ok" one.
using TrailerWriter = std::function<void(at::Tensor& trailer)>;

// The parts of a message carrying `tensors` and an "ok" trailer (or one `write_trailer` writes).
std::vector<at::Tensor> frame(const std::vector<at::Tensor>& tensors, int64_t large,
                              const TrailerWriter& write_trailer = {});
// The parts of a message of the size `specs` describe whose trailer carries `status` instead of data.
// A large message's data parts are views of `scratch` (a byte tensor of at least its payload bytes,
// shared by every aborted message: their contents do not matter).
std::vector<at::Tensor> abort_frame(const std::vector<TensorSpec>& specs, const at::TensorOptions& options,
                                    int64_t status, int64_t large, const at::Tensor& scratch);
// Payload bytes of a message of tensors shaped like `specs` (each 16-byte aligned).
int64_t payload_bytes(const std::vector<TensorSpec>& specs);
// Buffers to receive a message of tensors shaped like `specs`. With `scratch` (a message that will be
// dropped unread but its status), a large message's data parts are views of it (see abort_frame).
std::vector<at::Tensor> alloc_frame(const std::vector<TensorSpec>& specs, const at::TensorOptions& options,
                                    int64_t large, const at::Tensor& scratch = at::Tensor());
// The status in a received message's trailer (kMessageUnknown if the trailer is not pipecore's).
int64_t message_status(const std::vector<at::Tensor>& parts);
// The tensors of a received message (views of its buffers).
std::vector<at::Tensor> unframe(const std::vector<at::Tensor>& parts, const std::vector<TensorSpec>& specs);

// Shaped messages (above). The tag of a grown message's second sending is this + its ordinal.
constexpr int kFollowUpTag = 1;
// Whether a message of tensors shaped like `message` fits capacity `capacity` (same count, dtypes and
// ranks assumed): the sender's choice between sending and growing, and the receiver's check.
bool fits_capacity(const std::vector<TensorSpec>& message, const std::vector<TensorSpec>& capacity, int64_t large);
// The parts of a shaped message of capacity `capacity`: `tensors` with `status` ok; otherwise the
// header alone, carrying `status` and the shapes of `tensors` (zeros where none are given). `rows`: the
// first stages' batch rows of the step (Executor::set_batch_rows), which travel with every header.
std::vector<at::Tensor> frame_shaped(const std::vector<at::Tensor>& tensors, const std::vector<TensorSpec>& capacity,
                                     int64_t large, int64_t status, int64_t rows, const at::TensorOptions& options);
// Buffers to receive a shaped message of capacity `capacity`. With `scratch` (see alloc_frame), a large
// message's data parts are views of it; its header always has a buffer of its own (it is read).
std::vector<at::Tensor> alloc_shaped(const std::vector<TensorSpec>& capacity, const at::TensorOptions& options,
                                     int64_t large, const at::Tensor& scratch = at::Tensor());
// A received shaped message's status (kMessageUnknown: not pipecore's header), tensor shapes and rows.
int64_t read_shaped(const std::vector<at::Tensor>& parts, const std::vector<TensorSpec>& capacity, int64_t large,
                    std::vector<std::vector<int64_t>>& shapes, int64_t& rows);
// `capacity` with these shapes: the capacity of a grown message's follow-up.
std::vector<TensorSpec> with_shapes(const std::vector<TensorSpec>& capacity,
                                    const std::vector<std::vector<int64_t>>& shapes);
// The tensors of a received shaped message of capacity `capacity` whose header said `shapes`.
std::vector<at::Tensor> unframe_shaped(const std::vector<at::Tensor>& parts, const std::vector<TensorSpec>& capacity,
                                       const std::vector<std::vector<int64_t>>& shapes);

}  // namespace pipecore
