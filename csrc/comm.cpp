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
  return static_cast<int64_t>(c10::elementSize(dtype)) * elements(shape);
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

int64_t message_bytes(const std::vector<at::Tensor>& parts) {
  int64_t bytes = 0;
  for (const auto& p : parts) bytes += static_cast<int64_t>(p.nbytes());
  return bytes;
}

std::vector<std::vector<int64_t>> shapes_of(const std::vector<at::Tensor>& tensors) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& t : tensors) shapes.push_back(t.sizes().vec());
  return shapes;
}

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
  return status_of_code(trailer_code(words[0], words[1]));
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

// -- shaped messages (comm.h) ------------------------------------------------------------------

namespace {

constexpr size_t kHeadWords = 5;  // status, magic, rows, the message's bytes as sent, its follow-up; then the dims

bool packed_layout(const std::vector<TensorSpec>& capacity, int64_t large) {
  return payload_bytes(capacity) < large;
}

// The header's words; `sent`: the bytes of the whole message as it goes.
std::vector<int64_t> header_words(const std::vector<TensorSpec>& capacity, const std::vector<at::Tensor>& tensors,
                                  int64_t status, int64_t rows, int64_t sent, int64_t follow_up) {
  std::vector<int64_t> words(shaped_header_bytes(capacity) / 8, 0);
  words[0] = status;
  words[1] = kMagic;
  words[2] = rows;
  words[3] = sent;
  words[4] = follow_up;
  size_t w = kHeadWords;
  for (size_t k = 0; k < capacity.size(); ++k) {
    for (size_t d = 0; d < capacity[k].shape.size(); ++d) {
      words[w++] = tensors.empty() ? 0 : tensors[k].size(static_cast<int64_t>(d));
    }
  }
  return words;
}

// Writes `words` into the front of `buffer` (a byte tensor).
void write_header(at::Tensor& buffer, const std::vector<int64_t>& words) {
  const auto bytes = static_cast<int64_t>(words.size() * 8);
  if (buffer.is_cpu()) {
    std::memcpy(buffer.data_ptr(), words.data(), bytes);
    return;
  }
  // from pinned memory, queued on the current stream: the host does not wait for the device (the
  // host allocator keeps the pinned block until the copy ran)
  auto host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), words.data(), bytes);
  buffer.narrow(0, 0, bytes).copy_(host, /*non_blocking=*/true);
}

}  // namespace

int64_t shaped_header_bytes(const std::vector<TensorSpec>& capacity) {
  int64_t words = kHeadWords;
  for (const auto& c : capacity) words += static_cast<int64_t>(c.shape.size());
  return aligned(words * 8);
}

bool fits_capacity(const std::vector<TensorSpec>& message, const std::vector<TensorSpec>& capacity, int64_t large) {
  if (packed_layout(capacity, large)) return payload_bytes(message) <= payload_bytes(capacity);
  for (size_t k = 0; k < message.size(); ++k) {
    if (elements(message[k].shape) > elements(capacity[k].shape)) return false;
  }
  return true;
}

std::vector<at::Tensor> frame_shaped(const std::vector<at::Tensor>& tensors, const std::vector<TensorSpec>& capacity,
                                     int64_t large, int64_t status, int64_t rows, const at::TensorOptions& options,
                                     bool exact, const at::Tensor& scratch, int64_t follow_up) {
  TORCH_CHECK(tensors.empty() || tensors.size() == capacity.size(), "pipecore: a message of ", tensors.size(),
              " tensors where ", capacity.size(), " were planned");
  for (size_t k = 0; k < tensors.size(); ++k) {
    TORCH_CHECK(tensors[k].dim() == static_cast<int64_t>(capacity[k].shape.size()) &&
                    tensors[k].scalar_type() == capacity[k].dtype,
                "pipecore: message tensor ", k, " is ", tensors[k].scalar_type(), " of ", tensors[k].dim(),
                " dimensions where ", capacity[k].dtype, " of ", capacity[k].shape.size(), " were planned");
  }
  const bool data = status == kMessageOk;
  TORCH_CHECK(!data || !tensors.empty() || capacity.empty(), "pipecore: a message without its tensors");
  TORCH_CHECK(!data || !exact || fits_capacity(with_shapes(capacity, shapes_of(tensors)), capacity, large),
              "pipecore: a message sent at its capacity must fit it");
  if (!data && exact) {  // the capacity's size, contents that do not matter: a receive's buffers
    std::vector<at::Tensor> parts = alloc_shaped(capacity, options, large, scratch);
    write_header(parts[0], header_words(capacity, tensors, status, rows, message_bytes(parts), follow_up));
    return parts;
  }
  const int64_t header = shaped_header_bytes(capacity);
  if (packed_layout(capacity, large)) {
    const int64_t payload = exact ? payload_bytes(capacity) : data ? payload_bytes(tensors) : 0;
    auto buffer = at::empty({header + payload}, options.dtype(at::kByte));
    write_header(buffer, header_words(capacity, tensors, status, rows, header + payload, follow_up));
    if (data) {
      int64_t offset = header;
      for (const auto& t : tensors) {
        auto n = static_cast<int64_t>(t.nbytes());
        if (n > 0) buffer.narrow(0, offset, n).copy_(t.detach().contiguous().reshape({-1}).view(at::kByte));
        offset += aligned(n);
      }
    }
    return {buffer};
  }
  std::vector<at::Tensor> parts{at::empty({header}, options.dtype(at::kByte))};
  for (size_t k = 0; k < capacity.size(); ++k) {
    const int64_t n = elements(capacity[k].shape);
    if (n == 0) continue;
    const auto dtype = capacity[k].dtype;
    if (data && (!exact || tensors[k].numel() == n)) {
      parts.push_back(tensors[k].detach().contiguous());  // from its own storage
    } else if (data) {  // at the capacity's size (exact: the receive takes all of it)
      auto part = at::empty({n}, options.dtype(dtype));
      if (tensors[k].numel() > 0) part.narrow(0, 0, tensors[k].numel()).copy_(tensors[k].detach().reshape({-1}));
      parts.push_back(part);
    } else {  // gloo: the header alone carries what a message without data says
      parts.push_back(at::empty({0}, options.dtype(dtype)));
    }
  }
  write_header(parts[0], header_words(capacity, tensors, status, rows, message_bytes(parts), follow_up));
  return parts;
}

std::vector<at::Tensor> alloc_shaped(const std::vector<TensorSpec>& capacity, const at::TensorOptions& options,
                                     int64_t large, const at::Tensor& scratch) {
  const int64_t header = shaped_header_bytes(capacity);
  if (packed_layout(capacity, large)) return {at::empty({header + payload_bytes(capacity)}, options.dtype(at::kByte))};
  std::vector<at::Tensor> parts{at::empty({header}, options.dtype(at::kByte))};
  for (const auto& c : capacity) {
    const int64_t n = elements(c.shape);
    if (n == 0) continue;
    if (scratch.defined()) {
      const int64_t bytes = nbytes(c.shape, c.dtype);
      TORCH_CHECK(scratch.numel() >= bytes, "pipecore: abort scratch of ", scratch.numel(), " bytes for a part of ",
                  bytes);
      parts.push_back(scratch.narrow(0, 0, bytes).view(c.dtype));
    } else {
      parts.push_back(at::empty({n}, options.dtype(c.dtype)));
    }
  }
  return parts;
}

int64_t read_shaped_header(const at::Tensor& header, const std::vector<TensorSpec>& capacity, int64_t large,
                           int64_t received_bytes, bool exact, ShapedHeader& out) {
  const int64_t bytes = shaped_header_bytes(capacity);
  TORCH_CHECK(header.is_cpu() && header.is_contiguous() && header.nbytes() >= static_cast<size_t>(bytes),
              "pipecore: a shaped message's header is read from ", bytes, " contiguous host bytes");
  std::vector<int64_t> words(bytes / 8);
  std::memcpy(words.data(), header.data_ptr(), bytes);
  const int64_t status = words[0];
  if (words[1] != kMagic || status < kMessageOk || status > kMessageGrown) return kMessageUnknown;
  out.rows = words[2];
  out.follow_up = words[4];
  if (out.rows < 0 || out.follow_up < 0) return kMessageUnknown;
  // what the sender sent: all of the buffers where receives need their exact size, else no more
  const int64_t sent = words[3];
  if (exact ? sent != received_bytes : (sent < bytes || sent > received_bytes)) return kMessageUnknown;
  out.shapes.assign(capacity.size(), {});
  size_t w = kHeadWords;
  constexpr int64_t kMaxElements = int64_t{1} << 48;  // above any tensor: words that are not shapes
  for (size_t k = 0; k < capacity.size(); ++k) {
    int64_t n = 1;
    for (size_t d = 0; d < capacity[k].shape.size(); ++d) {
      const int64_t dim = words[w++];
      if (dim < 0 || dim > kMaxElements || (dim > 0 && n > kMaxElements / dim)) return kMessageUnknown;
      n *= dim;
      out.shapes[k].push_back(dim);
    }
  }
  if (status != kMessageOk) return status;
  // an ok message fits the capacity it was sent to: one that does not is not this channel's
  return fits_capacity(with_shapes(capacity, out.shapes), capacity, large) ? status : kMessageUnknown;
}

int64_t read_shaped(const std::vector<at::Tensor>& parts, const std::vector<TensorSpec>& capacity, int64_t large,
                    bool exact, ShapedHeader& out) {
  const int64_t bytes = shaped_header_bytes(capacity);
  if (parts.empty() || parts[0].numel() < bytes) return kMessageUnknown;
  at::Tensor header = parts[0].narrow(0, 0, bytes);
  header = header.is_cpu() ? header.contiguous() : header.cpu();  // (a discovery run's host read)
  return read_shaped_header(header, capacity, large, message_bytes(parts), exact, out);
}

std::vector<TensorSpec> with_shapes(const std::vector<TensorSpec>& capacity,
                                    const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<TensorSpec> specs = capacity;
  for (size_t k = 0; k < specs.size(); ++k) specs[k].shape = shapes[k];
  return specs;
}

std::vector<at::Tensor> unframe_shaped(const std::vector<at::Tensor>& parts, const std::vector<TensorSpec>& capacity,
                                       const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<at::Tensor> out;
  out.reserve(capacity.size());
  const bool packed = parts.size() == 1;
  int64_t offset = shaped_header_bytes(capacity);
  size_t next = 1;
  for (size_t k = 0; k < capacity.size(); ++k) {
    const auto dtype = capacity[k].dtype;
    const int64_t n = nbytes(shapes[k], dtype);
    if (packed) {
      out.push_back(n == 0 ? at::empty(shapes[k], parts[0].options().dtype(dtype))
                           : parts[0].narrow(0, offset, n).view(dtype).view(shapes[k]).detach());
      offset += aligned(n);
    } else if (elements(capacity[k].shape) == 0) {
      out.push_back(at::empty(shapes[k], parts[0].options().dtype(dtype)));
    } else {
      out.push_back(parts[next++].narrow(0, 0, elements(shapes[k])).view(shapes[k]).detach());
    }
  }
  return out;
}

}  // namespace pipecore
