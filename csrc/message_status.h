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
// is not pipecore's counts as this, above every status a trailer carries (kMessageGrown is a header's).
constexpr int64_t kStatusNotOurs = kMessageReplan + 1;

}  // namespace pipecore
