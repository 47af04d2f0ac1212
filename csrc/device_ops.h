// What the device path (device_comm.cpp: every decision of it, written once) asks of a device: one
// CUDA or NCCL call each on a GPU (cuda/device_ops.cpp), or the same calls modelled on the CPU for
// tests (testing/host_device_comm.cpp: the streams as a ledger that checks the stream contract, NCCL's
// groups over gloo, refusing what NCCL refuses). An implementation makes no choice of its own: which
// stream waits on which, which device is current, when a group is aborted, which header is copied and
// what an error says are device_comm.cpp's.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm_task.h"
#include "connection_counts.h"
#include "stream_contract.h"

namespace pipecore {

class DeviceOps : public StreamSync {
 public:
  virtual c10::DeviceType device_type() const = 0;
  // The executor's device made current on this thread (a launch goes to the current device, and a
  // thread starts on device 0): the device current before, for restore_device.
  virtual int make_device_current() = 0;
  virtual void restore_device(int before) = 0;
  // The compute stream current on this thread (the only call that asks; stream_contract.h).
  virtual ComputeStream compute_stream() const = 0;

  // -- the step status, an int64 on the device (message_status.h), kept by the compute streams; each
  // call queues its work on `on` (begin_step: the start of a step; the CPU model also waits there for
  // what an aborted step left)
  virtual void begin_step(const ComputeStream& on) = 0;
  // status = max(status, the code of the 16-byte `trailer`)
  virtual void fold_trailer(const at::Tensor& trailer, const ComputeStream& on) = 0;
  // trailer = (status, magic), where a foreign trailer's code goes on as "aborted"
  virtual void write_trailer(at::Tensor& trailer, const ComputeStream& on) = 0;
  // seed[0] = status == ok ? value : 0
  virtual void fill_seed(at::Tensor& seed, double value, const ComputeStream& on) = 0;
  // The status copied to the host once `on`'s work is done: that point, and then the code.
  virtual std::shared_ptr<StreamMarker> status_to_host(const ComputeStream& on) = 0;
  virtual int64_t status_on_host() = 0;

  // -- the communicator: a group of sends and receives, queued with the communication stream current
  // (held while the returned object lives)
  virtual std::shared_ptr<void> on_comm_stream() = 0;
  virtual void start_group(c10d::Backend& backend) = 0;
  virtual void post(c10d::Backend& backend, CommTask& task) = 0;  // its parts, as bytes (wire_parts)
  virtual c10::intrusive_ptr<c10d::Work> end_group(c10d::Backend& backend) = 0;
  virtual void abort(c10d::Backend& backend) = 0;
  // One task alone, outside any group (c10d posts it on a communicator of its two ranks): its Work.
  virtual c10::intrusive_ptr<c10d::Work> post_alone(c10d::Backend& backend, CommTask& task) = 0;
  // The communication stream waits for `group` (the host does not).
  virtual void comm_waits(c10d::Work& group) = 0;
  // Connects, on `on`, what a step's first operations would connect inside it, blocking the host until
  // the peers come (DeviceComm::connect says in which order, so that they all do): `backend`'s
  // communicator of all ranks (a group's operations go on it) and its point-to-point connections with
  // `peers` (NCCL makes them at the first group with each peer); or the communicator of this rank and
  // `pair` (c10d posts an operation alone on it).
  virtual void connect(c10d::Backend& backend, const std::vector<int>& peers, const ComputeStream& on) = 0;
  virtual void connect_pair(c10d::Backend& backend, int pair, const ComputeStream& on) = 0;
  virtual ConnectionCounts connection_counts() const { return {}; }

  // -- the host
  // `bytes` copied to pinned host memory on the current stream (readable once a later marker of that
  // stream is done).
  virtual at::Tensor to_host(const at::Tensor& bytes) = 0;
  // Waits for `marker` on the host, at most `timeout`; false then (or a CommError that says why, where the
  // implementation knows: the CPU model names the group that did not complete).
  virtual bool host_wait(const StreamMarker& marker, std::chrono::milliseconds timeout) = 0;
  // Whether `marker` is done, without waiting (its copies to the host then readable).
  virtual bool host_ready(const StreamMarker& marker) = 0;
  // The stream contract's violations seen so far (the CPU model's ledger; none on a device).
  virtual std::vector<std::string> violations() const { return {}; }
};

#ifdef PIPECORE_CUDA
std::unique_ptr<DeviceOps> make_cuda_ops(const c10::Device& device);
#endif
#ifdef PIPECORE_TESTING
// `timeout`: the executor's (read at each wait; it must outlive the ops), bounding each wait for a message;
// `device_index`: the device it models (a launch with another one current is refused);
// `all_ranks_connected`: its groups' communicators of all ranks connected when they were made, as with
// init_process_group(device_id=...) (else each connects at its first operation, as NCCL's do).
// `eager_bytes`: sends of at most that many bytes complete before their receiver posts, as with NCCL's
// eager protocol (0: every send is a rendezvous, the strictest: testing/nccl_model.h).
std::unique_ptr<DeviceOps> make_cpu_model_ops(const std::chrono::milliseconds& timeout, int device_index,
                                              bool all_ranks_connected, int64_t eager_bytes);
// A device-wide synchronisation of modelled device `device` (every CPU model of it alive in this process),
// named `why` in reports (cudaFree with the caching allocator off, empty_cache, an out-of-memory retry):
// the host is held until every stream of the device completed its work; a CommError names what did not,
// within the executor's timeout.
void model_device_synchronize(const std::string& why, int device);
// The CPU model's compute stream for this thread while the returned object lives: a second one
// (`second`), or the default one (torch.cuda.stream(...) on a GPU).
std::shared_ptr<void> make_model_stream_current(bool second);
// The CPU model refuses this thread's `index`-th next post into a group (0: the next) as c10d would refuse
// it before NCCL sees it (out of memory): what follows a posting failure NCCL knows nothing of.
void make_model_refuse_post(int index);
#endif

}  // namespace pipecore
