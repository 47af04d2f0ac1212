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

}  // namespace pipecore
