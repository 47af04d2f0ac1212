// What the executor knows of one tensor crossing a stage boundary.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace pipecore {

// Shape, dtype and autograd flag of one tensor crossing a stage boundary (for shaped messages, comm.h:
// the shape is a capacity).
struct TensorSpec {
  std::vector<int64_t> shape;
  c10::ScalarType dtype;
  bool requires_grad;
};

// The number of elements of a tensor of this shape.
inline int64_t elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// The gradients that come back for a message of tensors like `specs`: one for each tensor that needs one,
// in order (what a SEND_B sends and a RECV_B receives for a SEND_F's message).
inline std::vector<TensorSpec> needing_grad(const std::vector<TensorSpec>& specs) {
  std::vector<TensorSpec> out;
  for (const auto& sp : specs) {
    if (sp.requires_grad) out.push_back(sp);
  }
  return out;
}

}  // namespace pipecore
