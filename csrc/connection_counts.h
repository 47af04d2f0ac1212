// What connecting communicators cost ([Note: connecting before the first step], device_comm.h).
#pragma once

#include <cstdint>

namespace pipecore {

// Communicators connected: ahead of every step (DeviceOps::connect), and by a step's first operation on
// one (which held the posting host until its peers came), with the store operations they cost. The CPU
// model counts them; a device reports none.
struct ConnectionCounts {
  int64_t ahead = 0;
  int64_t in_steps = 0;
  int64_t store_ops = 0;
};

}  // namespace pipecore
