// Point-to-point messages between stages: several tensors travel as one message.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "executor.h"

namespace pipecore {

// One contiguous buffer holding `tensors` (the tensor itself when there is one contiguous tensor).
at::Tensor pack(const std::vector<at::Tensor>& tensors);
// A buffer to receive what `pack` made of tensors shaped like `specs`.
at::Tensor alloc_message(const std::vector<TensorSpec>& specs, const at::TensorOptions& options);
// The tensors inside a received buffer.
std::vector<at::Tensor> unpack(const at::Tensor& buffer, const std::vector<TensorSpec>& specs);

}  // namespace pipecore
