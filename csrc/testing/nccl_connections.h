// The CPU model of how NCCL's communicators connect, for the CPU model of the device path
// (host_device_comm.cpp): lazily, at a communicator's first operation, inside the call that posts it.
// c10d makes the communicator there (ProcessGroupNCCL::initNCCLComm): one rank's unique id goes through
// the store (a set, and a blocking get on every other rank: store traffic) and ncclCommInitRank returns
// only once every rank of the communicator joined. So the posting host is held until the peers make
// their first operation on that communicator too, and nothing ends that wait (no timeout of NCCL's;
// ncclCommAbort cannot reach a communicator not made yet). The model holds the host the same way (the
// ranks meet over gloo on a tag of the model's own) and, where the executor's timeout passes first,
// reports the hang it would be. NCCL connects a communicator's point-to-point paths the same way, at the
// first group with each peer. What was connected ahead (DeviceOps::connect; a communicator of all ranks
// also at the group's creation with a device id) costs a step nothing.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "../connection_counts.h"

namespace pipecore {

// Connects `backend`'s communicator of all its ranks (`pair` -1: a group's) or of this rank and `pair`
// (an operation alone) if it is not yet, in this process (communicators live in the backend, as c10d's
// do): `ahead` of any step (DeviceOps::connect) or at a step's operation, named `what` in the report of
// one that would hang (after `timeout`); counted in `counts`.
void connect_communicator(c10d::Backend& backend, int pair, const std::string& what, std::chrono::milliseconds timeout,
                          bool ahead, ConnectionCounts& counts);
// The point-to-point connections of `backend`'s communicator of all ranks with `peers` not made yet, at
// once: NCCL makes them in the first group that sends to or receives from each (ncclGroupEnd), and
// returns only once each of those peers did the same.
void connect_peers(c10d::Backend& backend, const std::vector<int>& peers, const std::string& what,
                   std::chrono::milliseconds timeout, bool ahead, ConnectionCounts& counts);

}  // namespace pipecore
