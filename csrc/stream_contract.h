// The device path's stream contract, in one place (DeepEP writes its own the same way): which
// stream may touch a message buffer when, and what makes its free safe. The device path
// (device_comm.cpp) applies it; CUDA keeps it with events (cuda/device_ops.cpp), the CPU model of tests
// (testing/host_device_comm.cpp) with a ledger that checks every use and free against it
// (testing/stream_ledger.h).
//
// The executor allocates every message buffer (a send's frame, a receive's buffer, trailers
// included) with the compute stream current, so the caching allocator gives each one to the compute
// stream: it may hand out a block whose earlier tensors are still read by compute kernels queued
// before the allocation, since it orders reuse on the owning stream only. The communication stream
// writes receives and reads sends. Hence:
//  1. Before a batch is posted, the communication stream waits on an event recorded on the compute
//     stream after the batch's buffers were allocated and its sends written. Receive-only batches
//     too: without that wait a transfer could write into a block that queued compute still reads.
//  2. A receive's buffer is read on the compute stream only after that stream waited on the
//     receive's ready event, recorded on the communication stream after its batch.
//  3. A receive dropped without being read (an aborted step) first makes the compute stream that
//     allocated it (the one current when its batch was posted, whatever thread lets go of it) wait
//     on its ready event: freed, its block returns to that stream's pool, which must not hand it out
//     while the transfer may still write it.
//  4. A send's buffers are released once its Work completed (SendTracker polls it), so no stream
//     uses them any more. When that wait failed or timed out, the step raises CommError, the group's
//     communicator is aborted (pipecore/executor/comm.py, Comm.mark_broken), and the buffers are held
//     until the executor goes (SendTracker::held_failed): a transfer may read them until the abort.
//  5. A shaped receive's header (comm.h) is copied to the host on the communication stream after
//     its batch and before the batch's ready event: rules 1 and 3 then cover that read as well; the
//     host reads the copy only after the copy's own event. (The checker sees a copy made after the
//     ready event as a use the compute stream never waited for, refused when the buffer is freed.)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <memory>
#include <optional>
#include <vector>

#include "comm_task.h"

namespace pipecore {

// The compute stream a call of the device path works with: taken once by each entry of the path
// (DeviceComm::compute_stream: the stream current on the calling thread then, the step's or an
// OVERLAP_F_B half's) and passed to every call that records, waits or launches there; never "whatever
// is current" further down. The device's id of it (CUDA's stream; the CPU model's ledger lane).
using ComputeStream = c10::Stream;

// Which stream a record or wait is on: kCompute, the compute stream passed with the call; kComm, the
// communication stream; kOwner (waits only), the compute stream that posted the batch whose ready marker
// it is (StreamMarker::owner), which allocated its buffers and whose pool they return to.
enum class Lane : int { kCompute = 0, kComm = 1, kOwner = 2 };

// A point on one stream's timeline (an event).
struct StreamMarker {
  virtual ~StreamMarker() = default;
  std::optional<ComputeStream> owner;  // a batch's ready marker: the compute stream that posted it (rule 3)
};

// What a device does with its streams. The buffer notes (each naming the message whose part it is)
// are for the checker; a device ignores them.
class StreamSync {
 public:
  virtual ~StreamSync() = default;
  virtual std::shared_ptr<StreamMarker> record(Lane lane, const ComputeStream& compute) = 0;
  virtual void wait(Lane lane, const StreamMarker& marker, const ComputeStream& compute) = 0;
  virtual void allocated(const at::Tensor&, const ComputeStream&) {}
  virtual void used(const at::Tensor&, Lane, const ComputeStream&, bool /*writes*/, const CommTask&) {}
  virtual void freed(const at::Tensor&, const CommTask&) {}
};

// Rule 1 for a batch about to be posted from `compute` (its tasks in program order), then its buffers
// as the communication stream will use them.
void before_batch(StreamSync& sync, const ComputeStream& compute, const std::vector<std::shared_ptr<CommTask>>& tasks);
// Once the batch's group is queued on the communication stream: its ready marker (rules 2 and 3;
// null if it has no receive), owned by `compute`, returned to the executor, which hands it back to read
// or let go of one.
std::shared_ptr<StreamMarker> after_batch(StreamSync& sync, const ComputeStream& compute,
                                          const std::vector<std::shared_ptr<CommTask>>& tasks);
// Rule 5, as the communication stream copies received `task`'s header to the host (before after_batch).
void header_to_host(StreamSync& sync, const ComputeStream& compute, const CommTask& task);
// Rule 2, before `compute` reads a received task.
void before_read(StreamSync& sync, const ComputeStream& compute, const CommTask& task, const StreamMarker& ready);
// Rule 3, as the executor lets go of a received task (`consumed`: rule 2 was kept for it already).
void on_release(StreamSync& sync, const ComputeStream& compute, const CommTask& task, const StreamMarker& ready,
                bool consumed);

}  // namespace pipecore
