// Point-to-point messages between stages. A message ends with a 16-byte trailer: a status word
// (ok / the sender's step was aborted / shapes changed) and a magic number. The status lets an
// aborted step run to its end on every rank with no rank left waiting (see Executor::run).
//
// On the wire a message is a list of parts, sent and received in order:
// - small (payload under `large`, by default kLargeMessageBytes): one byte buffer, its tensors packed (each 16-byte
//   aligned) followed by the trailer: one send however many tensors;
// - large: every tensor sent from its own storage (no copy), then the trailer alone.
// Sender and receiver choose the same layout from the byte size of the planned tensors.
//
// Shaped messages (Executor::set_shapes_travel) carry their tensors' shapes, so that the receiver
// need not know them: a header of int64 words [status, magic, the step's batch rows, the message's
// bytes as sent, its follow-up's key (below), each tensor's dims] comes first, and receives are
// posted at a capacity (per tensor, the most elements that crossed that boundary so far, as a shape
// [n, 1, ...] of the tensor's rank).
// The capacity picks the layout:
// - packed (payload capacity under `large`): one buffer, the header then the tensors (each 16-byte
//   aligned at its actual size);
// - large: the header alone, then one part per tensor whose capacity holds any element.
// On gloo a message may fall short of its receive's buffers (gloo accepts a shorter message): a
// shorter or empty tensor travels as it is. NCCL receives need their exact size, so there (`exact`)
// every message goes at its capacity's size: a packed buffer is padded, a shorter tensor copied into
// a part of the capacity's size. The bytes word lets the receiver check either rule.
// A message that does not fit the capacity goes as its header alone, status kMessageGrown, in the
// capacity's layout, naming its follow-up's key: its ordinal among the follow-ups its sender sent to
// that peer (MessageFormat in message_path.h numbers them, one scheme for both paths). On gloo the
// follow-up goes at its own size (its shapes as the capacity) on a tag of its own, follow_up_tag(key),
// so that each rank may read its grown messages in any order. On the device path it goes on a
// follow-up channel instead ([Note: NCCL pair order] in device_comm.h), packed at its own shapes, on tag
// kFollowUpTag (NCCL ignores tags; on the CPU model's gloo one tag matches in order, as NCCL does), and
// the receiver checks the key against the follow-ups it received from that peer
// (Executor::set_follow_up_channels).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "message_status.h"
#include "tensor_spec.h"

namespace pipecore {

// Messages of at least this many payload bytes are sent from their tensors' own storage (below
// this, one packed send costs less than a send per tensor).
constexpr int64_t kLargeMessageBytes = 64 << 10;

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
// Bytes of a message's parts, all of them.
int64_t message_bytes(const std::vector<at::Tensor>& parts);
// Each tensor's shape.
std::vector<std::vector<int64_t>> shapes_of(const std::vector<at::Tensor>& tensors);
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

// Shaped messages (above): the tags of grown messages' follow-ups start here.
constexpr int kFollowUpTag = 1;
// The tag on a gloo group of the boundary descriptions a discovery step sends between ranks
// (pipecore/executor/descriptions.py): above any follow-up's.
constexpr int kDescriptionTag = 1 << 30;
// The gloo tag of the follow-up whose key is `key` (keys count on over steps: they wrap below
// kDescriptionTag, far more than ever travel at once).
inline int follow_up_tag(int64_t key) {
  return kFollowUpTag + static_cast<int>(key % (kDescriptionTag - kFollowUpTag));
}
// A `large` under which every shaped message is packed (a follow-up on the device path).
constexpr int64_t kAlwaysPacked = INT64_MAX;
// What a shaped message's header says besides its status.
struct ShapedHeader {
  int64_t rows = 0;       // the first stages' batch rows of the step
  int64_t follow_up = 0;  // a grown message's follow-up key (0: none)
  std::vector<std::vector<int64_t>> shapes;
};
// Bytes of a shaped message's header for capacity `capacity` (16-byte aligned).
int64_t shaped_header_bytes(const std::vector<TensorSpec>& capacity);
// Whether a message of tensors shaped like `message` fits capacity `capacity` (same count, dtypes and
// ranks assumed): the sender's choice between sending and growing, and the receiver's check.
bool fits_capacity(const std::vector<TensorSpec>& message, const std::vector<TensorSpec>& capacity, int64_t large);
// The parts of a shaped message of capacity `capacity`: `tensors` with `status` ok; otherwise the
// header alone, carrying `status` and the shapes of `tensors` (zeros where none are given). `rows`: the
// first stages' batch rows of the step (Executor::set_batch_rows), which travel with every header.
// `exact`: at the capacity's size (NCCL; above), a message without data then in views of `scratch`
// (see abort_frame) where it is given. `follow_up`: the key of a grown message's follow-up.
std::vector<at::Tensor> frame_shaped(const std::vector<at::Tensor>& tensors, const std::vector<TensorSpec>& capacity,
                                     int64_t large, int64_t status, int64_t rows, const at::TensorOptions& options,
                                     bool exact = false, const at::Tensor& scratch = at::Tensor(),
                                     int64_t follow_up = 0);
// Buffers to receive a shaped message of capacity `capacity`. With `scratch` (see alloc_frame), a large
// message's data parts are views of it; its header always has a buffer of its own (it is read).
std::vector<at::Tensor> alloc_shaped(const std::vector<TensorSpec>& capacity, const at::TensorOptions& options,
                                     int64_t large, const at::Tensor& scratch = at::Tensor());
// A received shaped message's status (kMessageUnknown: not pipecore's header, or not the size its
// sender sent: `exact`, all of `received_bytes`; else no more) and what else its header says, from
// the header's bytes on the host.
int64_t read_shaped_header(const at::Tensor& header, const std::vector<TensorSpec>& capacity, int64_t large,
                           int64_t received_bytes, bool exact, ShapedHeader& out);
// The same, from the received parts (a device message's header is copied to the host and waited for).
int64_t read_shaped(const std::vector<at::Tensor>& parts, const std::vector<TensorSpec>& capacity, int64_t large,
                    bool exact, ShapedHeader& out);
// `capacity` with these shapes: the capacity of a grown message's follow-up.
std::vector<TensorSpec> with_shapes(const std::vector<TensorSpec>& capacity,
                                    const std::vector<std::vector<int64_t>>& shapes);
// The tensors of a received shaped message of capacity `capacity` whose header said `shapes`.
std::vector<at::Tensor> unframe_shaped(const std::vector<at::Tensor>& parts, const std::vector<TensorSpec>& capacity,
                                       const std::vector<std::vector<int64_t>>& shapes);

}  // namespace pipecore
