#include "comm.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace pipecore {
namespace {

constexpr int64_t kAlign = 16;
constexpr int64_t kTrailer = 16;
constexpr int64_t kMagic = 0x65726f6365706970LL;  // "pipecore"

int64_t nbytes(const std::vector<int64_t>& shape, c10::ScalarType dtype) {
  int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
  for (auto d : shape) n *= d;
  return n;
}

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

int64_t payload_bytes(const std::vector<TensorSpec>& specs) {
  int64_t total = 0;
  for (const auto& s : specs) total += aligned(nbytes(s.shape, s.dtype));
  return total;
}

void write_trailer(at::Tensor& buffer, int64_t status) {
  int64_t words[2] = {status, kMagic};
  auto trailer = buffer.narrow(0, buffer.numel() - kTrailer, kTrailer);
  if (buffer.is_cpu()) {
    std::memcpy(trailer.data_ptr(), words, sizeof(words));
  } else {
    auto host = at::empty({kTrailer}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(host.data_ptr(), words, sizeof(words));
    trailer.copy_(host, /*non_blocking=*/false);
  }
}

}  // namespace

at::Tensor pack(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(!tensors.empty(), "pipecore: a message needs at least one tensor");
  int64_t total = 0;
  for (const auto& t : tensors) total += aligned(static_cast<int64_t>(t.nbytes()));
  auto buffer = at::empty({total + kTrailer}, tensors[0].options().dtype(at::kByte));
  int64_t offset = 0;
  for (const auto& t : tensors) {
    auto n = static_cast<int64_t>(t.nbytes());
    if (n > 0) {
      buffer.narrow(0, offset, n).copy_(t.detach().contiguous().reshape({-1}).view(at::kByte));
    }
    offset += aligned(n);
  }
  write_trailer(buffer, kMessageOk);
  return buffer;
}

at::Tensor abort_message(const std::vector<TensorSpec>& specs, const at::TensorOptions& options, int64_t status) {
  auto buffer = at::zeros({payload_bytes(specs) + kTrailer}, options.dtype(at::kByte));
  write_trailer(buffer, status);
  return buffer;
}

at::Tensor alloc_message(const std::vector<TensorSpec>& specs, const at::TensorOptions& options) {
  return at::empty({payload_bytes(specs) + kTrailer}, options.dtype(at::kByte));
}

int64_t message_status(const at::Tensor& buffer) {
  auto trailer = buffer.narrow(0, buffer.numel() - kTrailer, kTrailer);
  if (!trailer.is_cpu()) trailer = trailer.cpu();
  int64_t words[2];
  std::memcpy(words, trailer.data_ptr(), sizeof(words));
  TORCH_CHECK(words[1] == kMagic, "pipecore: received a message without pipecore's trailer: the two ranks "
              "disagree on the message order or size (was the schedule lowered differently on the peer?)");
  return words[0];
}

std::vector<at::Tensor> unpack(const at::Tensor& buffer, const std::vector<TensorSpec>& specs) {
  std::vector<at::Tensor> out;
  out.reserve(specs.size());
  int64_t offset = 0;
  for (const auto& s : specs) {
    int64_t n = nbytes(s.shape, s.dtype);
    at::Tensor t;
    if (n > 0) {
      t = buffer.narrow(0, offset, n).view(s.dtype).view(s.shape).detach();
    } else {
      t = at::empty(s.shape, buffer.options().dtype(s.dtype));
    }
    out.push_back(t);
    offset += aligned(n);
  }
  return out;
}

}  // namespace pipecore
