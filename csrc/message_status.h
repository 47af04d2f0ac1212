// The status word of a message's trailer (see comm.h), shared with the CUDA kernels.
#pragma once

#include <cstdint>

namespace pipecore {

// kMessageUnknown: the trailer is not pipecore's (the channel is out of step); never sent.
// kMessageGrown (shaped messages' headers only, comm.h): the tensors outgrew the receiver's buffers;
// the header carries their shapes and the message follows at its own size (gloo) or on a follow-up
// channel (the device path).
enum MessageStatus : int64_t {
  kMessageUnknown = -1, kMessageOk = 0, kMessageAborted = 1, kMessageReplan = 2, kMessageGrown = 3,
};
// The trailer's second word: "pipecore" in ASCII.
constexpr int64_t kTrailerMagic = 0x65726f6365706970LL;
// A step status (device path, device_comm.h) is the largest code its messages brought; a trailer that
// is not pipecore's counts as this, above every status a message carries.
constexpr int64_t kStatusNotOurs = kMessageGrown + 1;

// The rules of a trailer, written once for the host (comm.cpp, the CPU model) and the CUDA kernels.
#ifdef __CUDACC__
#define PIPECORE_HOST_DEVICE __host__ __device__
#else
#define PIPECORE_HOST_DEVICE
#endif
// The code of a received trailer's words (status, magic): its status, or kStatusNotOurs if they are not
// pipecore's (a trailer never carries kMessageGrown: that is a shaped header's).
PIPECORE_HOST_DEVICE constexpr int64_t trailer_code(int64_t status, int64_t magic) {
  return magic == kTrailerMagic && status >= kMessageOk && status <= kMessageReplan ? status : kStatusNotOurs;
}
// The status a sent trailer carries for a step's code: a foreign trailer's goes on as "aborted".
PIPECORE_HOST_DEVICE constexpr int64_t trailer_status(int64_t code) {
  return code > kMessageReplan ? kMessageAborted : code;
}
// Does a message with this status say that its sender's step failed (aborted, or a first stage's batch
// changed shape)? Else it is ok, grown, or not pipecore's (the channel is out of step).
constexpr bool says_peer_failed(int64_t status) { return status == kMessageAborted || status == kMessageReplan; }
// A step's code as a MessageStatus (kMessageUnknown: a trailer was not pipecore's).
constexpr int64_t status_of_code(int64_t code) { return code == kStatusNotOurs ? kMessageUnknown : code; }

}  // namespace pipecore
