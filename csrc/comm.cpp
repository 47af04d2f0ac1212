#include "comm.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace pipecore {
namespace {

constexpr int64_t kAlign = 16;
constexpr int64_t kTrailer = 16;
constexpr int64_t kMagic = kTrailerMagic;

int64_t nbytes(const std::vector<int64_t>& shape, c10::ScalarType dtype) {
  int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
  for (auto d : shape) n *= d;
  return n;
}

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

int64_t payload_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += aligned(static_cast<int64_t>(t.nbytes()));
  return total;
}

// Writes status and magic into the last kTrailer bytes of `buffer` (16-byte aligned).
void write_trailer(at::Tensor& buffer, int64_t status) {
  auto trailer = buffer.narrow(0, buffer.numel() - kTrailer, kTrailer);
  if (buffer.is_cpu()) {
    int64_t words[2] = {status, kMagic};
    std::memcpy(trailer.data_ptr(), words, sizeof(words));
  } else {  // two fills on the device's stream: no copy from the host, no wait for the device
    auto words = trailer.view(at::kLong);
    words.narrow(0, 0, 1).fill_(status);
    words.narrow(0, 1, 1).fill_(kMagic);
  }
}

at::Tensor trailer_part(const at::TensorOptions& options, int64_t status, const TrailerWriter& writer = {}) {
  auto t = at::empty({kTrailer}, options.dtype(at::kByte));
  if (writer) {
    writer(t);
  } else {
    write_trailer(t, status);
  }
  return t;
}

}  // namespace

int64_t payload_bytes(const std::vector<TensorSpec>& specs) {
  int64_t total = 0;
  for (const auto& s : specs) total += aligned(nbytes(s.shape, s.dtype));
  return total;
}

std::vector<at::Tensor> frame(const std::vector<at::Tensor>& tensors, int64_t large, const TrailerWriter& writer) {
  TORCH_CHECK(!tensors.empty(), "pipecore: a message needs at least one tensor");
  const int64_t total = payload_bytes(tensors);
  const auto options = tensors[0].options();
  if (total >= large) {  // sent from the tensors' own storage
    std::vector<at::Tensor> parts;
    for (const auto& t : tensors) {
      if (t.numel() > 0) parts.push_back(t.detach().contiguous());
    }
    parts.push_back(trailer_part(options, kMessageOk, writer));
    return parts;
  }
  auto buffer = at::empty({total + kTrailer}, options.dtype(at::kByte));
  int64_t offset = 0;
  for (const auto& t : tensors) {
    auto n = static_cast<int64_t>(t.nbytes());
    if (n > 0) buffer.narrow(0, offset, n).copy_(t.detach().contiguous().reshape({-1}).view(at::kByte));
    offset += aligned(n);
  }
  if (writer) {
    auto trailer = buffer.narrow(0, total, kTrailer);
    writer(trailer);
  } else {
    write_trailer(buffer, kMessageOk);
  }
  return {buffer};
}

std::vector<at::Tensor> alloc_frame(const std::vector<TensorSpec>& specs, const at::TensorOptions& options,
                                    int64_t large, const at::Tensor& scratch) {
  const int64_t total = payload_bytes(specs);
  if (total < large) return {at::empty({total + kTrailer}, options.dtype(at::kByte))};  // small: its own
  TORCH_CHECK(!scratch.defined() || scratch.numel() >= total, "pipecore: abort scratch of ", scratch.numel(),
              " bytes for a message of ", total);
  std::vector<at::Tensor> parts;
  for (const auto& s : specs) {
    const int64_t n = nbytes(s.shape, s.dtype);
    if (n == 0) continue;
    parts.push_back(scratch.defined() ? scratch.narrow(0, 0, n).view(s.dtype).view(s.shape)
                                      : at::empty(s.shape, options.dtype(s.dtype)));
  }
  parts.push_back(at::empty({kTrailer}, options.dtype(at::kByte)));
  return parts;
}

std::vector<at::Tensor> abort_frame(const std::vector<TensorSpec>& specs, const at::TensorOptions& options,
                                    int64_t status, int64_t large, const at::Tensor& scratch) {
  // the data parts' contents do not matter: the trailer says not to use them
  std::vector<at::Tensor> parts = alloc_frame(specs, options, large, scratch);
  if (parts.size() == 1) {
    parts[0].zero_();
    write_trailer(parts[0], status);
  } else {
    parts.back() = trailer_part(options, status);
  }
  return parts;
}

int64_t message_status(const std::vector<at::Tensor>& parts) {
  const at::Tensor& last = parts.back();
  auto trailer = last.narrow(0, last.numel() - kTrailer, kTrailer);
  if (!trailer.is_cpu()) trailer = trailer.cpu();
  int64_t words[2];
  std::memcpy(words, trailer.data_ptr(), sizeof(words));
  if (words[1] != kMagic || words[0] < kMessageOk || words[0] > kMessageReplan) return kMessageUnknown;
  return words[0];
}

std::vector<at::Tensor> unframe(const std::vector<at::Tensor>& parts, const std::vector<TensorSpec>& specs) {
  std::vector<at::Tensor> out;
  out.reserve(specs.size());
  const bool packed = parts.size() == 1;
  const at::Tensor& buffer = parts[0];
  int64_t offset = 0;
  size_t next = 0;
  for (const auto& s : specs) {
    const int64_t n = nbytes(s.shape, s.dtype);
    if (n == 0) {
      out.push_back(at::empty(s.shape, buffer.options().dtype(s.dtype)));
    } else if (packed) {
      out.push_back(buffer.narrow(0, offset, n).view(s.dtype).view(s.shape).detach());
    } else {
      out.push_back(parts[next++]);
    }
    offset += aligned(n);
  }
  return out;
}

}  // namespace pipecore
