// DeviceComm on CUDA: a communication stream per executor, events between it and the compute
// stream as ../stream_contract.h says, one NCCL group per batch, message statuses on the device
// (see ../device_comm.h).
#include "../device_comm.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "../errors.h"
#include "../message_status.h"
#include "../stream_contract.h"
#include "status_kernels.h"

namespace pipecore {
namespace {

struct CudaMarker final : StreamMarker {
  c10::Event event{c10::DeviceType::CUDA};
  std::optional<c10::cuda::CUDAStream> owner;  // a batch's ready marker: the compute stream that posted it
};

// The contract's two lanes: the compute stream is the current stream of the thread that asks (the
// step's, or a pair's half that runs on it), the communication stream the executor's own.
class CudaStreams final : public StreamSync {
 public:
  CudaStreams(const c10::Device& device, c10::cuda::CUDAStream comm) : device_(device), comm_(comm) {}
  std::shared_ptr<StreamMarker> record(Lane lane) override {
    c10::cuda::CUDAGuard device_guard(device_);
    auto marker = std::make_shared<CudaMarker>();
    marker->event.record(stream(lane));
    return marker;
  }
  void wait(Lane lane, const StreamMarker& marker) override {
    c10::cuda::CUDAGuard device_guard(device_);
    const auto& cuda = static_cast<const CudaMarker&>(marker);
    TORCH_CHECK(lane != Lane::kOwner || cuda.owner, "pipecore: a wait on the posting stream of a marker without one");
    cuda.event.block(lane == Lane::kOwner ? *cuda.owner : stream(lane));
  }

 private:
  c10::cuda::CUDAStream stream(Lane lane) const {
    return lane == Lane::kComm ? comm_ : c10::cuda::getCurrentCUDAStream(device_.index());
  }
  c10::Device device_;
  c10::cuda::CUDAStream comm_;
};

class CudaComm final : public DeviceComm {
 public:
  explicit CudaComm(const c10::Device& device)
      : device_(device),
        // The communication stream carries the batches' waits on compute, their header copies and their
        // ready events; NCCL's kernels run on c10d's own stream, which waits on this one at posting (and this
        // one on it after a batch with receives). Its high priority orders only that small work of its own
        // ahead of compute kernels; it does not make the transfers themselves preempt compute.
        comm_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())),
        streams_(std::make_shared<CudaStreams>(device, comm_)),
        status_(at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device))),
        host_status_(at::empty({1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true))),
        status_read_(c10::DeviceType::CUDA) {}

  c10::DeviceType device_type() const override { return c10::DeviceType::CUDA; }

  void begin_step() override {
    c10::cuda::CUDAGuard device_guard(device_);
    status_.zero_();
  }

  std::shared_ptr<StreamMarker> post_batch(c10d::Backend& backend,
                                           const std::vector<std::shared_ptr<CommTask>>& tasks) override {
    c10::cuda::CUDAGuard device_guard(device_);
    const c10::cuda::CUDAStream posting = compute_stream();  // (the guard below makes the comm stream current)
    const bool recvs = std::any_of(tasks.begin(), tasks.end(), [](const auto& t) { return !t->send; });
    before_batch(*streams_, tasks);  // the communication stream waits on compute, whatever the batch holds
    c10::intrusive_ptr<c10d::Work> work;
    std::shared_ptr<StreamMarker> ready;
    {
      // c10d's NCCL stream waits on the current stream at posting: our communication stream
      c10::cuda::CUDAStreamGuard on_comm(comm_);
      backend.startCoalescing();
      try {
        for (const auto& task : tasks) post_parts(*task);
      } catch (const std::exception& e) {
        // part of the batch was added: ending the group would launch that half, whose peers would wait
        // for the rest. The communicator is aborted first; the group is then closed on it.
        backend.abort();
        try {
          backend.endCoalescing();
        } catch (...) {
        }
        throw CommError(std::string("posting a batch of sends and receives failed (") + e.what() +
                        "); the group's communicator was aborted");
      }
      work = backend.endCoalescing();
      TORCH_CHECK(work, "pipecore: the group returned no Work for a batch of sends and receives");
      if (recvs) work->wait();  // no timeout: the communication stream waits for the group; the host does not
      copy_headers(tasks);
      ready = after_batch(*streams_, tasks);  // the receives' ready event, on the communication stream
      if (ready) static_cast<CudaMarker&>(*ready).owner = posting;  // where a dropped receive waits (rule 3)
      for (const auto& task : tasks) task->works.assign(1, work);  // coalesced operations have no Work of their own
    }
    for (const auto& task : tasks) task->mark_posted(nullptr);
    return ready;
  }

  void consume(CommTask& task, const StreamMarker& ready) override {
    c10::cuda::CUDAGuard device_guard(device_);
    before_read(*streams_, task, ready);
    if (task.header_bytes > 0) return;  // a shaped message: its status was read on the host
    const at::Tensor& last = task.parts.back();
    cuda::fold_trailer(last.narrow(0, last.numel() - 16, 16), status_, compute_stream().stream());
  }

  void release(CommTask& task, const StreamMarker& ready, bool consumed) override {
    c10::cuda::CUDAGuard device_guard(device_);
    on_release(*streams_, task, ready, consumed);
  }

  at::Tensor read_header(CommTask& task, std::chrono::milliseconds timeout) override {
    TORCH_CHECK(task.header_ready, "pipecore: a shaped device receive without its header copy");
    const auto& marker = static_cast<const CudaMarker&>(*task.header_ready);
    if (!poll(marker.event, timeout)) {
      throw CommError("the message did not arrive (its batch of sends and receives did not complete, so its header "
                      "was not on the host within the timeout)");
    }
    return task.header_host;
  }

  void write_trailer(at::Tensor& trailer) override {
    c10::cuda::CUDAGuard device_guard(device_);  // a launch goes to the current device
    cuda::write_trailer(trailer, status_, compute_stream().stream());
  }

  void fill_seed(at::Tensor& seed, double value) override {
    c10::cuda::CUDAGuard device_guard(device_);
    cuda::fill_seed(seed, value, status_, compute_stream().stream());
  }

  bool finish_step(std::chrono::milliseconds timeout, int64_t& status) override {
    c10::cuda::CUDAGuard device_guard(device_);
    auto stream = compute_stream();
    host_status_.copy_(status_, /*non_blocking=*/true);
    status_read_.record(stream);
    if (!poll(status_read_, timeout)) return false;
    const int64_t code = host_status_.data_ptr<int64_t>()[0];
    status = code == kStatusNotOurs ? kMessageUnknown : code;
    return true;
  }

 private:
  // Queried, not synchronized: a stuck peer ends in a timeout, not a hang. False once `timeout` passed.
  static bool poll(const c10::Event& event, std::chrono::milliseconds timeout) {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout;
    auto pause = std::chrono::microseconds(10);
    while (!event.query()) {
      const auto now = std::chrono::steady_clock::now();
      if (now > deadline) return false;
      if (now - start < std::chrono::microseconds(50)) {  // a header is usually there within microseconds,
        std::this_thread::yield();                          // and a sleep takes tens of them
        continue;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(500));
    }
    return true;
  }

  // Shaped receives of a batch just queued (the communication stream current): their headers to
  // pinned host memory, each ready at an event, ahead of the action that reads them (stream contract,
  // rule 5: the copy is a use by the communication stream, before the batch's ready event).
  void copy_headers(const std::vector<std::shared_ptr<CommTask>>& tasks) {
    for (const auto& task : tasks) {
      if (task->send || task->header_bytes == 0) continue;
      header_to_host(*streams_, *task);
      task->header_host =
          at::empty({task->header_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      task->header_host.copy_(task->parts[0].narrow(0, 0, task->header_bytes), /*non_blocking=*/true);
      task->header_ready = streams_->record(Lane::kComm);
    }
  }

  c10::cuda::CUDAStream compute_stream() const { return c10::cuda::getCurrentCUDAStream(device_.index()); }

  c10::Device device_;
  c10::cuda::CUDAStream comm_;
  std::shared_ptr<CudaStreams> streams_;
  at::Tensor status_;       // int64[1] on the device: the largest status code seen this step
  at::Tensor host_status_;  // pinned: where the status lands at the end of a step
  c10::Event status_read_;
};

}  // namespace

std::unique_ptr<DeviceComm> make_device_comm(const c10::Device& device) {
  if (device.type() != c10::DeviceType::CUDA) return nullptr;
  c10::Device d = device;
  if (!d.has_index()) d = c10::Device(c10::DeviceType::CUDA, c10::cuda::current_device());
  return std::make_unique<CudaComm>(d);
}

}  // namespace pipecore
