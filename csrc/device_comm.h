// Communication on an accelerator without host waits (device_comm.cpp, over the calls of device_ops.h).
//
// The host only queues work there; it never waits for a transfer inside a step (the host waits the
// path does make are listed in docs/cuda.md, "Host waits on the device path"):
// - A batch of sends and receives (a run of consecutive SEND/RECV actions, see
//   pipecore/schedule/p2p_order.py for why that order cannot deadlock) is posted as one group on a
//   communication stream, which first waits on the compute stream (stream_contract.h: when each
//   stream may touch a message buffer, and what makes its free safe).
// - A receive's data is ready at an event recorded on the communication stream after its group;
//   the compute stream waits on that event when an action consumes the message, or when the
//   executor drops it unconsumed.
// - Shaped messages (comm.h, Executor::set_shapes_travel): their headers, which the host needs to
//   know the tensors' shapes, are copied to pinned host memory on the communication stream right
//   after their batch; the host waits for that copy (not for the compute stream) when an action
//   consumes the message: one small device-to-host read per received message. Their statuses are
//   then read on the host, as on the host path.
// - Other messages' statuses (a peer's step aborted, shapes changed, channel out of step) are checked on
//   the device: each received trailer folds into a step status on the device, each sent trailer
//   carries that status on, and a last stage's loss seed is zero unless it is ok, so a failed step
//   adds nothing to any gradient. The host reads the status once, when the step ends.
//
// [Note: NCCL pair order]
// NCCL runs the point-to-point operations between two ranks in posting order, and matches a receive
// with the pair's next send by that order alone: it has no tags. gloo runs each operation on its own
// and matches by tag. Three rules follow; each place that applies one names this note:
//  - a receive posted ahead of an earlier send to the same peer would wait for that send's receiver,
//    which may wait for it in turn: on in-order backends the receive window keeps receives behind sends
//    (RecvWindow, pipecore/runtime/message_path.py), and the device path posts a receive with its batch;
//  - posted one by one, a send and a receive that cross between two ranks would wait for each other:
//    a batch (a run of consecutive SEND/RECV actions) goes as one group, in the order
//    pipecore/schedule/p2p_order.py proves cannot deadlock, a discovery run cutting a batch before each
//    later receive of activations (its rule 5);
//  - a grown shaped message cannot follow on a tag of its own as on gloo (a receive posted ahead would
//    take it): on the device path it follows on a communicator of the same ranks that carries only
//    follow-ups, so they match in the order receivers take them, and receivers read the headers from
//    one peer in the order they were posted (DevicePath::read_in_order). A follow-up's send waits
//    on its stream until the receiver has read the header, so a follow-up must not share a stream with
//    any other rank's: two ranks each sending one, each to read the other's later, would wait for each
//    other, and so would a chain of ranks, each sending one to the next before it receives one from
//    the previous (the CPU model found that cycle: interleaved_zb on 4 ranks). One communicator carries
//    the follow-ups to higher ranks, another those to lower ranks (Executor::set_follow_up_channels),
//    and each follow-up goes alone, outside any group: c10d then posts it on a communicator of its
//    pair, with a stream of its own, which carries only that pair's follow-ups in that direction (and
//    which only those two ranks connect: [Note: connecting before the first step]).
//
// [Note: streams between communicators]
// c10d makes a communicator's stream wait on the stream current when an operation is posted, and a
// Work's wait() makes the current stream wait on the communicator's. One communicator's stream waits on
// another's work in one place only, where the protocol needs it: a follow-up's receive is posted with
// the communication stream current and that stream waits for it, since the receive's ready marker,
// through which the compute stream reads it, is recorded there (later batches then wait for it too). A
// follow-up's send is posted with the compute stream current: its data is compute's, and posted from the
// communication stream it would wait for every receive posted before it, one of which its receiver may
// send only after the follow-up arrived (the CPU model, once it made a communicator's stream wait on the
// stream current at posting, found that cycle: a batch sending a grown message's header and receiving
// from the same peer, which posts that receive's send after the follow-up's receive; 42 of the 76 device
// path tests with growing messages hung, on 2, 3 and 4 ranks).
//
// [Note: follow-ups posted as their headers land]
// A follow-up's send waits on its stream until the receiver posts the receive (NCCL's rendezvous; only
// small sends complete without it), and a device-wide synchronisation on the sender (cudaFree, which the
// caching allocator calls when it is off, on an out-of-memory retry and in empty_cache) holds its host
// until that send completed. Were the receive posted only when the consuming action reads the header, a
// receiver that first needs what the held host posts next would never post it: replayed over every
// schedule (replay_device_syncs in pipecore/schedule/p2p_order.py, a synchronisation in every compute
// action, every message grown), 351 of 612 configurations hung so; the CPU model (model_device_synchronize)
// hung the same way. So before each action the receiver looks, without waiting, at the headers of the
// receives it has not read (each peer's in posting order, the order follow-ups match in: [Note: NCCL pair
// order]), and posts the follow-up of each grown one whose header is on the host
// (DevicePath::post_landed_follow_ups); its consumer still reads the message, and says what was wrong with
// it (a failure to post it early is raised there too, at the action it concerns). That leaves 78 of the
// 612 hanging (docs/cuda.md): a receiver already held in its own synchronisation, for a batch whose
// partner the first host posts after its own, cannot post; and a follow-up's receive posted early still
// runs behind the batches posted on the communication stream before it.
//
// [Note: connecting before the first step]
// NCCL connects a communicator at its first operation, inside the call that posts it (c10d: a unique id
// through the store, then ncclCommInitRank, which returns once every rank of it joined), and nothing
// ends that wait: no timeout, no abort. Inside a step that is a cycle waiting to close: a rank held
// there until its peers post, while a peer waits on its host for something the held rank sends later (a
// boundary's description in a discovery run; a header before a follow-up). So the device path connects
// every communicator it will post on before the Pipeline's first step runs (DeviceComm::connect, at its
// first agreement, which every rank of the group reaches): the group's communicator of all ranks
// (where its batches go) with its paths to the peers of its messages and of its exchanges (a tie's or a
// dualpipe mirror's sum after a step, sent as one group there: DeviceComm::exchange; c10d would post a
// send alone on a communicator of the two ranks, made inside the step), then the communicators of two
// ranks that operations posted alone go on (the follow-ups', the descriptions'), pair by pair in one
// order all ranks share, (lower rank, higher rank) ascending. Each rank meets its pairs in that order, so
// the least pair not yet connected always has both ranks waiting at it: no cycle.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm_task.h"
#include "device_ops.h"
#include "stream_contract.h"

namespace pipecore {

// The device path's decisions, made once over a device's calls (DeviceOps: CUDA and NCCL, or the CPU
// model of tests), which it owns.
class DeviceComm {
 public:
  explicit DeviceComm(std::unique_ptr<DeviceOps> ops);
  ~DeviceComm();
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  // The device whose tensors it posts and gates (loss seeds elsewhere are not gated).
  c10::DeviceType device_type() const;
  // The compute stream current on this thread: each entry of the device path takes it once and passes it
  // to every call below that records, waits or launches on a compute stream (stream_contract.h).
  ComputeStream compute_stream() const;
  // Start of a step (on `on`): the step status is ok.
  void begin_step(const ComputeStream& on);
  // Posts `tasks` (program order, made on `on`) as one group on the communication stream, on the
  // communicator their fields name (CommTask::channel, else the group's backend for this device: the one
  // place that says where a message goes, which the device's calls are given), and marks them posted;
  // sends hold the group's Work. Returns
  // the batch's ready marker, an event on the communication stream after the group (stream_contract.h,
  // rules 2 and 3), which the executor keeps with each of its receives until it lets go of them (null:
  // the batch has no receive). A batch NCCL would refuse (a peer out of range) is refused before its group
  // opens; a posting error inside the group ends the group, then aborts `backend` (CommError), so that
  // what was added ends with the communicator. Not `grouped` (a follow-up: one task): the
  // task goes alone, outside any group, which c10d posts on a communicator of its two ranks with a
  // stream of its own ([Note: NCCL pair order]).
  std::shared_ptr<StreamMarker> post_batch(const std::vector<std::shared_ptr<CommTask>>& tasks, const ComputeStream& on,
                                           bool grouped = true);
  // Before compute stream `on` reads received `task`: it waits on `ready` (its batch's marker) and folds
  // the trailer into the step status (a shaped message's status was read on the host).
  void consume(CommTask& task, const StreamMarker& ready, const ComputeStream& on);
  // The executor (on `on`) lets go of received `task`: its buffers go back to the pool of the compute
  // stream that posted it, so unless it was consumed (a compute stream waited already) that stream first
  // waits on `ready` (rule 3).
  void release(CommTask& task, const StreamMarker& ready, bool consumed, const ComputeStream& on);
  // A shaped message (task.header_bytes > 0): its header's bytes on the host, waited for up to
  // `timeout` (CommError after that), not waiting for the compute stream.
  at::Tensor read_header(CommTask& task, std::chrono::milliseconds timeout);
  // Whether a shaped message's header is on the host already (read_header would not wait).
  bool header_arrived(const CommTask& task);
  // Writes the step status (ok, or the first bad status a message brought) into a 16-byte trailer, on `on`.
  void write_trailer(at::Tensor& trailer, const ComputeStream& on);
  // `seed` (one element) = value if the step status is ok, else 0, on `on`.
  void fill_seed(at::Tensor& seed, double value, const ComputeStream& on);
  // End of step: the step status (a MessageStatus; kMessageUnknown if a trailer was not pipecore's),
  // read once `on`'s work is done. False if that took longer than `timeout`.
  bool finish_step(std::chrono::milliseconds timeout, int64_t& status, const ComputeStream& on);
  // The stream contract's violations seen so far (the CPU model's checker; none on a device).
  std::vector<std::string> contract_violations() const;
  // Connects, before the first step, every communicator the path posts on: `group`'s of all ranks with its
  // paths to `peers` and `exchange_peers` (exchange's), then the communicator of this rank (`rank`) and each
  // of `peers` on each of `pair_channels`, in the order of [Note: connecting before the first step]. Every
  // rank of the group calls it at the same point.
  void connect(c10d::Backend& group, const std::vector<c10d::Backend*>& pair_channels, int rank,
               const std::vector<int>& peers, const std::vector<int>& exchange_peers);
  ConnectionCounts connection_counts() const;
  // `tensor` sent to group rank `peer` of `group` and what `peer` sends (the same size), as one group on the
  // communicator of all ranks (connect made its path to `peer` ahead), waited for on the host within
  // `timeout` (CommError "<what> failed ..."); the compute stream current reads the result.
  at::Tensor exchange(c10d::ProcessGroup& group, const at::Tensor& tensor, int peer, std::chrono::milliseconds timeout,
                      const std::string& what);

 private:
  c10::intrusive_ptr<c10d::Work> post_group(c10d::Backend& backend,
                                            const std::vector<std::shared_ptr<CommTask>>& tasks);
  c10::intrusive_ptr<c10d::Work> post_alone(c10d::Backend& backend, CommTask& task);
  // Shaped receives of a batch just queued (the communication stream current): their headers to
  // pinned host memory, each ready at a marker, ahead of the action that reads them (stream contract,
  // rule 5: the copy is a use by the communication stream, before the batch's ready marker).
  void copy_headers(const std::vector<std::shared_ptr<CommTask>>& tasks, const ComputeStream& on);

  std::unique_ptr<DeviceOps> ops_;
  // Exchanges that failed: the communicator may still read and write their buffers until the group is
  // aborted, so they are let go of with this object (stream_contract.h, rules 3 and 4), before ops_.
  std::vector<std::shared_ptr<CommTask>> unfinished_;
};

// A DeviceComm for `device`, or null where this build has none (CPU devices; builds without CUDA).
std::unique_ptr<DeviceComm> make_device_comm(const c10::Device& device);

#ifdef PIPECORE_TESTING
// Test builds: the same decisions over the CPU model's calls (testing/host_device_comm.cpp), on CPU
// tensors over gloo, for tests on machines without a GPU; `timeout` (the executor's, read at each
// wait; it must outlive the DeviceComm) bounds each wait for a message; `device_index`: the device it
// models (a launch while another one is current is refused); `all_ranks_connected`, `eager_bytes`:
// make_cpu_model_ops's.
std::unique_ptr<DeviceComm> make_host_device_comm(const std::chrono::milliseconds& timeout, int device_index,
                                                  bool all_ranks_connected = false, int64_t eager_bytes = 0);
#endif

}  // namespace pipecore
