// The CPU model of how NCCL's communicators connect, for the CPU model of the device path
// (host_device_comm.cpp): lazily, at a communicator's first operation, inside the call that posts it.
// c10d makes the communicator there (ProcessGroupNCCL::initNCCLComm): one rank's unique id goes through
// the store (a set, and a blocking get on every other rank: store traffic) and ncclCommInitRank returns
// only once every rank of the communicator joined. So the posting host is held until the peers make
// their first operation on that communicator too, and nothing ends that wait (no timeout of NCCL's;
// ncclCommAbort cannot reach a communicator not made yet). The model holds the host the same way (the
// ranks meet over gloo on a tag of the model's own) and, where the executor's timeout passes first,
// reports the hang it would be. A communicator connected ahead (DeviceOps::connect, or at the group's
// creation with a device id) costs a step nothing.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <cstdint>
#include <string>

#include "../connection_counts.h"

namespace pipecore {

// Before an operation on `backend`'s communicator of all its ranks (`pair` -1: a group's) or of this
// rank and `pair` (an operation alone): connects it if this is its first in this process (the
// communicators live in the backend, as c10d's do), counted in `counts` as a step's. `what` names the
// operation in the report of a connection that would hang, after `timeout`.
void connect_at_operation(c10d::Backend& backend, int pair, const std::string& what, std::chrono::milliseconds timeout,
                          ConnectionCounts& counts);
// Connects it ahead of any step (DeviceOps::connect), counted as such.
void connect_ahead(c10d::Backend& backend, int pair, std::chrono::milliseconds timeout, ConnectionCounts& counts);

}  // namespace pipecore
