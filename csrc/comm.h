// Point-to-point messages between stages. A message is the bytes of its tensors (each 16-byte
// aligned) followed by a 16-byte trailer: a status word (ok / the sender's step was aborted) and a
// magic number. The status lets an aborted step run to its end on every rank with no rank left
// waiting (see Executor::run).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "executor.h"

namespace pipecore {

enum MessageStatus : int64_t { kMessageOk = 0, kMessageAborted = 1, kMessageReplan = 2 };

// One byte buffer holding `tensors` and an "ok" trailer.
at::Tensor pack(const std::vector<at::Tensor>& tensors);
// A message of the size `specs` describe whose trailer carries `status` instead of data.
at::Tensor abort_message(const std::vector<TensorSpec>& specs, const at::TensorOptions& options, int64_t status);
// A buffer to receive a message of tensors shaped like `specs`.
at::Tensor alloc_message(const std::vector<TensorSpec>& specs, const at::TensorOptions& options);
// The status in a received message's trailer (throws if the trailer is not pipecore's).
int64_t message_status(const at::Tensor& buffer);
// The tensors inside a received buffer (views of it).
std::vector<at::Tensor> unpack(const at::Tensor& buffer, const std::vector<TensorSpec>& specs);

}  // namespace pipecore
