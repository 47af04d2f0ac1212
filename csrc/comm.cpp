#include "comm.h"

#include <ATen/ops/empty.h>

namespace pipecore {
namespace {

constexpr int64_t kAlign = 16;  // every tensor starts 16-byte aligned inside a packed message

int64_t nbytes(const std::vector<int64_t>& shape, c10::ScalarType dtype) {
  int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
  for (auto d : shape) n *= d;
  return n;
}

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

at::Tensor pack(const std::vector<at::Tensor>& tensors) {
  if (tensors.size() == 1) {
    return tensors[0].detach().contiguous();
  }
  int64_t total = 0;
  for (const auto& t : tensors) total += aligned(static_cast<int64_t>(t.nbytes()));
  auto buffer = at::empty({total}, tensors.empty() ? at::TensorOptions().dtype(at::kByte)
                                                   : tensors[0].options().dtype(at::kByte));
  int64_t offset = 0;
  for (const auto& t : tensors) {
    auto n = static_cast<int64_t>(t.nbytes());
    if (n > 0) {
      buffer.narrow(0, offset, n).copy_(t.detach().contiguous().reshape({-1}).view(at::kByte));
    }
    offset += aligned(n);
  }
  return buffer;
}

at::Tensor alloc_message(const std::vector<TensorSpec>& specs, const at::TensorOptions& options) {
  if (specs.size() == 1) {
    return at::empty(specs[0].shape, options.dtype(specs[0].dtype));
  }
  int64_t total = 0;
  for (const auto& s : specs) total += aligned(nbytes(s.shape, s.dtype));
  return at::empty({total}, options.dtype(at::kByte));
}

std::vector<at::Tensor> unpack(const at::Tensor& buffer, const std::vector<TensorSpec>& specs) {
  std::vector<at::Tensor> out;
  out.reserve(specs.size());
  if (specs.size() == 1) {
    out.push_back(buffer);
    return out;
  }
  int64_t offset = 0;
  for (const auto& s : specs) {
    int64_t n = nbytes(s.shape, s.dtype);
    at::Tensor t;
    if (n > 0) {
      t = buffer.narrow(0, offset, n).view(s.dtype).view(s.shape);
    } else {
      t = at::empty(s.shape, buffer.options().dtype(s.dtype));
    }
    out.push_back(t);
    offset += aligned(n);
  }
  return out;
}

}  // namespace pipecore
