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

}  // namespace pipecore
