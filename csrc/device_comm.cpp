// The device path's decisions (device_comm.h), written once over the calls of device_ops.h: CUDA and
// NCCL run them on a GPU, the CPU model of tests (testing/host_device_comm.cpp) runs them on the host.
#include "device_comm.h"

#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "device_ops.h"
#include "diagnostics.h"
#include "errors.h"
#include "message_status.h"
#include "stream_contract.h"

namespace pipecore {
namespace {

// The executor's device current while it lives (a guard without an allocation: one per message).
class OnDevice {
 public:
  explicit OnDevice(DeviceOps& ops) : ops_(ops), before_(ops.make_device_current()) {}
  ~OnDevice() { ops_.restore_device(before_); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  DeviceOps& ops_;
  const int before_;
};

}  // namespace

DeviceComm::DeviceComm(std::unique_ptr<DeviceOps> ops) : ops_(std::move(ops)) {}

DeviceComm::~DeviceComm() = default;

c10::DeviceType DeviceComm::device_type() const { return ops_->device_type(); }

ComputeStream DeviceComm::compute_stream() const { return ops_->compute_stream(); }

// Every entry that queues device work first makes the executor's device current (L1 of issue 51: a
// thread starts on device 0, and the step's thread need not have set it).
void DeviceComm::begin_step(const ComputeStream& on) {
  const OnDevice on_device(*ops_);
  ops_->begin_step(on);
}

std::shared_ptr<StreamMarker> DeviceComm::post_batch(const std::vector<std::shared_ptr<CommTask>>& tasks,
                                                     const ComputeStream& on, bool grouped) {
  TORCH_CHECK(grouped || tasks.size() == 1, "pipecore: only one message goes outside a group");
  TORCH_CHECK(!tasks.empty() && tasks.front()->group, "pipecore: a batch of messages without their group");
  c10d::Backend& backend =
      tasks.front()->channel ? *tasks.front()->channel : *tasks.front()->group->getBackend(ops_->device_type());
  for (const auto& task : tasks) {
    TORCH_CHECK(task->group == tasks.front()->group && task->channel == tasks.front()->channel,
                "pipecore: a batch's messages go through one communicator");
  }
  const bool receives = std::any_of(tasks.begin(), tasks.end(), [](const auto& t) { return !t->send; });
  const OnDevice on_device(*ops_);
  before_batch(*ops_, on, tasks);  // the communication stream waits on compute, whatever the batch holds
  std::shared_ptr<StreamMarker> ready;
  {
    // c10d's NCCL stream waits on the current stream at posting: the communication stream, except for a
    // follow-up's send ([Note: streams between communicators])
    const auto on_comm = !grouped && tasks[0]->send ? nullptr : ops_->on_comm_stream();
    const c10::intrusive_ptr<c10d::Work> group = grouped ? post_group(backend, tasks) : post_alone(backend, *tasks[0]);
    TORCH_CHECK(group, "pipecore: the group returned no Work for a batch of sends and receives");
    if (receives) ops_->comm_waits(*group);  // no timeout: the communication stream waits; the host does not
    copy_headers(tasks, on);
    // the receives' ready marker, on the communication stream, owned by `on` (where a dropped receive waits)
    ready = after_batch(*ops_, on, tasks);
    for (const auto& task : tasks) task->works.assign(1, group);  // coalesced operations have no Work of their own
  }
  for (const auto& task : tasks) task->mark_posted(nullptr);
  return ready;
}

void DeviceComm::consume(CommTask& task, const StreamMarker& ready, const ComputeStream& on) {
  const OnDevice on_device(*ops_);
  before_read(*ops_, on, task, ready);
  if (task.header_bytes > 0) return;  // a shaped message: its status was read on the host
  const at::Tensor& last = task.parts.back();
  ops_->fold_trailer(last.narrow(0, last.numel() - 16, 16), on);
}

void DeviceComm::release(CommTask& task, const StreamMarker& ready, bool consumed, const ComputeStream& on) {
  const OnDevice on_device(*ops_);
  on_release(*ops_, on, task, ready, consumed);
}

at::Tensor DeviceComm::read_header(CommTask& task, std::chrono::milliseconds timeout) {
  TORCH_CHECK(task.header_ready, "pipecore: a shaped device receive without its header copy");
  if (!ops_->host_wait(*task.header_ready, timeout)) {
    throw CommError("the message did not arrive (its batch of sends and receives did not complete, so its header "
                    "was not on the host within the timeout)");
  }
  return task.header_host;
}

bool DeviceComm::header_arrived(const CommTask& task) {
  return task.header_ready && ops_->host_ready(*task.header_ready);
}

void DeviceComm::write_trailer(at::Tensor& trailer, const ComputeStream& on) {
  const OnDevice on_device(*ops_);
  ops_->write_trailer(trailer, on);
}

void DeviceComm::fill_seed(at::Tensor& seed, double value, const ComputeStream& on) {
  const OnDevice on_device(*ops_);
  ops_->fill_seed(seed, value, on);
}

bool DeviceComm::finish_step(std::chrono::milliseconds timeout, int64_t& status, const ComputeStream& on) {
  const std::shared_ptr<StreamMarker> read = [&] {
    const OnDevice on_device(*ops_);
    return ops_->status_to_host(on);
  }();
  if (!ops_->host_wait(*read, timeout)) return false;
  const int64_t code = ops_->status_on_host();
  status = status_of_code(code);
  return true;
}

std::vector<std::string> DeviceComm::contract_violations() const { return ops_->violations(); }

void DeviceComm::connect(c10d::Backend& group, const std::vector<c10d::Backend*>& pair_channels, int rank,
                         const std::vector<int>& peers, const std::vector<int>& exchange_peers) {
  const OnDevice on_device(*ops_);
  const ComputeStream on = ops_->compute_stream();
  // ascending, without this rank (a send to self goes in a group, with its receive); for pairs, the
  // ascending (lower rank, higher rank) order ((p, rank) < (rank, q) for every p < rank < q)
  const auto others = [rank](std::vector<int> ranks) {
    ranks.erase(std::remove(ranks.begin(), ranks.end(), rank), ranks.end());
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    return ranks;
  };
  const std::vector<int> order = others(peers);
  std::vector<int> paths = order;
  paths.insert(paths.end(), exchange_peers.begin(), exchange_peers.end());
  // (every rank at once; its paths in one group: each rank's list names the ranks that name it)
  ops_->connect(group, others(paths), on);
  for (int peer : order) {
    for (c10d::Backend* channel : pair_channels) ops_->connect_pair(*channel, peer, on);
  }
}

ConnectionCounts DeviceComm::connection_counts() const { return ops_->connection_counts(); }

at::Tensor DeviceComm::exchange(c10d::ProcessGroup& group, const at::Tensor& tensor, int peer,
                                std::chrono::milliseconds timeout, const std::string& what) {
  auto send = std::make_shared<CommTask>();
  auto recv = std::make_shared<CommTask>();
  send->parts = {tensor.contiguous()};
  recv->send = false;
  recv->parts = {at::empty_like(send->parts[0])};
  for (const auto& task : {send, recv}) {
    task->peer = peer;
    task->group = &group;
  }
  const ComputeStream on = compute_stream();
  std::shared_ptr<StreamMarker> ready;
  bool done = false;
  try {  // every failure is the group's (the caller marks it broken, which aborts the communicator)
    ready = post_batch({send, recv}, on);
    done = ops_->host_wait(*ready, timeout);
  } catch (const CommError& e) {  // (the CPU model says what did not complete)
    unfinished_.insert(unfinished_.end(), {send, recv});
    throw CommError(what + ": " + e.what(), e.cause);
  } catch (const std::exception& e) {  // (c10d's, from the group's end: a connection that failed)
    unfinished_.insert(unfinished_.end(), {send, recv});
    throw CommError(what + " failed: the group refused to post it", error_text(e));
  }
  if (!done) {
    unfinished_.insert(unfinished_.end(), {send, recv});
    throw CommError(failed_waiting(what, timeout, "the exchange did not complete: its peer did not come"));
  }
  const OnDevice on_device(*ops_);
  before_read(*ops_, on, *recv, *ready);
  on_release(*ops_, on, *recv, *ready, /*consumed=*/true);
  return recv->parts[0];
}

c10::intrusive_ptr<c10d::Work> DeviceComm::post_group(c10d::Backend& backend,
                                                      const std::vector<std::shared_ptr<CommTask>>& tasks) {
  // What NCCL would refuse inside the group is refused before it: NCCL keeps such an error for the group's
  // end, which then fails, and c10d goes on counting the group open on this thread (every later operation
  // there would join a group that never ends). Every part goes as bytes, so a peer is all there is to check.
  for (const auto& task : tasks) {
    if (task->peer < 0 || task->peer >= backend.getSize()) {
      throw CommError("posting a batch of sends and receives failed (a " +
                      std::string(task->send ? "send to" : "receive from") + " rank " + std::to_string(task->peer) +
                      ", which a communicator of " + std::to_string(backend.getSize()) +
                      " ranks does not have); nothing of it was posted");
    }
  }
  ops_->start_group(backend);
  try {
    for (const auto& task : tasks) ops_->post(backend, *task);
  } catch (const std::exception& e) {
    // c10d refused an operation (out of memory) after part of the batch was added, and NCCL cannot drop an
    // open group: ending it launches that part, and the abort then ends it (what reached a peer before is
    // half a batch, whose rest never comes: that peer's step fails as on any peer's failure). The group is
    // ended first: an abort inside it frees the communicator the group holds, its end then fails, and c10d
    // goes on counting the group open on this thread, taking every later operation alone there for part
    // of a group that never ends.
    try {
      ops_->end_group(backend);
    } catch (...) {
    }
    ops_->abort(backend);
    throw CommError("posting a batch of sends and receives failed; the group's communicator was aborted",
                    error_text(e));
  }
  return ops_->end_group(backend);
}

c10::intrusive_ptr<c10d::Work> DeviceComm::post_alone(c10d::Backend& backend, CommTask& task) {
  try {
    return ops_->post_alone(backend, task);
  } catch (const std::exception& e) {  // (nothing of it went: no peer waits for a half)
    throw CommError("posting a follow-up failed", error_text(e));
  }
}

// Shaped receives of a batch just queued (the communication stream current): their headers to
// pinned host memory, each ready at a marker, ahead of the action that reads them (stream contract,
// rule 5: the copy is a use by the communication stream, before the batch's ready marker).
void DeviceComm::copy_headers(const std::vector<std::shared_ptr<CommTask>>& tasks, const ComputeStream& on) {
  for (const auto& task : tasks) {
    if (task->send || task->header_bytes == 0) continue;
    header_to_host(*ops_, on, *task);
    task->header_host = ops_->to_host(task->parts[0].narrow(0, 0, task->header_bytes));
    task->header_ready = ops_->record(Lane::kComm, on);
  }
}

std::unique_ptr<DeviceComm> make_device_comm(const c10::Device& device) {
#ifdef PIPECORE_CUDA
  if (device.type() == c10::DeviceType::CUDA) return std::make_unique<DeviceComm>(make_cuda_ops(device));
#endif
  (void)device;  // builds without CUDA sources: messages on any device go through the host-waiting path
  return nullptr;
}

#ifdef PIPECORE_TESTING
std::unique_ptr<DeviceComm> make_host_device_comm(const std::chrono::milliseconds& timeout, int device_index,
                                                  bool all_ranks_connected, int64_t eager_bytes) {
  return std::make_unique<DeviceComm>(make_cpu_model_ops(timeout, device_index, all_ranks_connected, eager_bytes));
}
#endif

}  // namespace pipecore
