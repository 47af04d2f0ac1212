// Point-to-point messages between stages. A message ends with a 16-byte trailer: a status word
// (ok / the sender's step was aborted / shapes changed) and a magic number. The status lets an
// aborted step run to its end on every rank with no rank left waiting (see Executor::run).
//
// On the wire a message is a list of parts, sent and received in order:
// - small (payload under `large`, by default kLargeMessageBytes): one byte buffer, its tensors packed (each 16-byte
//   aligned) followed by the trailer: one send however many tensors;
// - large: every tensor sent from its own storage (no copy), then the trailer alone.
// Sender and receiver choose the same layout from the byte size of the planned tensors.
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

}  // namespace pipecore
