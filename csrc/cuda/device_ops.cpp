// The device path's calls on CUDA and NCCL (../device_ops.h), one each; the decisions are
// ../device_comm.cpp's. A communication stream per executor, events between it and the compute stream
// each call is given (../stream_contract.h: the one its caller took), NCCL's groups through c10d, and the
// step status kept by one-thread kernels (status_kernels.h).
#include "../device_ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>

#include "status_kernels.h"

namespace pipecore {
namespace {

struct CudaMarker final : StreamMarker {
  c10::Event event{c10::DeviceType::CUDA};
};

// A non-blocking stream of the device's highest priority, created for one executor.
c10::cuda::CUDAStream own_stream(const c10::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  int least = 0;
  int greatest = 0;
  C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t stream = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
  return c10::cuda::getStreamFromExternal(stream, device.index());
}

c10::cuda::CUDAStream on_cuda(const ComputeStream& stream) {
  return c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream);
}

class CudaOps final : public DeviceOps {
 public:
  explicit CudaOps(const c10::Device& device)
      : device_(device),
        // The communication stream carries the batches' waits on compute, their header copies and their
        // ready events; NCCL's kernels run on c10d's own stream, which waits on this one at posting (and this
        // one on it after a batch with receives). Its high priority orders only that small work of its own
        // ahead of compute kernels; it does not make the transfers themselves preempt compute. A stream of
        // its own, not one of torch's pool (32 per priority, handed out in turn: another user of the pool,
        // or another executor, could be given the same stream and so wait for this one's batches).
        comm_(own_stream(device)),
        status_(at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device))),
        host_status_(at::empty({1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true))) {}

  ~CudaOps() override {
    // (CUDA releases a destroyed stream's resources once its queued work completed)
    cudaStreamDestroy(comm_.stream());
  }

  c10::DeviceType device_type() const override { return c10::DeviceType::CUDA; }
  int make_device_current() override { return c10::cuda::ExchangeDevice(device_.index()); }
  void restore_device(int before) override { c10::cuda::ExchangeDevice(static_cast<c10::DeviceIndex>(before)); }
  ComputeStream compute_stream() const override { return c10::cuda::getCurrentCUDAStream(device_.index()); }

  // -- streams and events (stream_contract.h)
  std::shared_ptr<StreamMarker> record(Lane lane, const ComputeStream& compute) override {
    auto marker = std::make_shared<CudaMarker>();
    marker->event.record(stream(lane, compute));
    return marker;
  }
  void wait(Lane lane, const StreamMarker& marker, const ComputeStream& compute) override {
    const auto& cuda = static_cast<const CudaMarker&>(marker);
    TORCH_CHECK(lane != Lane::kOwner || cuda.owner, "pipecore: a wait on the posting stream of a marker without one");
    cuda.event.block(lane == Lane::kOwner ? *cuda.owner : stream(lane, compute));
  }

  // -- the step status
  void begin_step(const ComputeStream& on) override {
    const c10::cuda::CUDAStreamGuard guard(on_cuda(on));
    status_.zero_();
  }
  void fold_trailer(const at::Tensor& trailer, const ComputeStream& on) override {
    cuda::fold_trailer(trailer, status_, on_cuda(on).stream());
  }
  void write_trailer(at::Tensor& trailer, const ComputeStream& on) override {
    cuda::write_trailer(trailer, status_, on_cuda(on).stream());
  }
  void fill_seed(at::Tensor& seed, double value, const ComputeStream& on) override {
    cuda::fill_seed(seed, value, status_, on_cuda(on).stream());
  }
  std::shared_ptr<StreamMarker> status_to_host(const ComputeStream& on) override {
    const c10::cuda::CUDAStreamGuard guard(on_cuda(on));
    host_status_.copy_(status_, /*non_blocking=*/true);
    status_read_->event.record(on);  // one event for every step's read (read before the next)
    return status_read_;
  }
  int64_t status_on_host() override { return host_status_.data_ptr<int64_t>()[0]; }

  // -- the communicator
  std::shared_ptr<void> on_comm_stream() override {
    return std::make_shared<c10::cuda::CUDAStreamGuard>(comm_);  // (its device too)
  }
  void start_group(c10d::Backend& backend) override { backend.startCoalescing(); }
  void post(c10d::Backend& /*backend*/, CommTask& task) override { post_parts(task); }
  c10::intrusive_ptr<c10d::Work> end_group(c10d::Backend& backend) override { return backend.endCoalescing(); }
  void abort(c10d::Backend& backend) override { backend.abort(); }
  c10::intrusive_ptr<c10d::Work> post_alone(c10d::Backend& /*backend*/, CommTask& task) override {
    post_parts(task);  // (one part: a follow-up is packed)
    return task.works.back();
  }
  void comm_waits(c10d::Work& group) override { group.wait(); }  // (no blocking wait: the stream waits)
  // c10d makes a communicator inside the first operation on it, and NCCL a point-to-point connection in
  // the first group with its peer: a one-byte all-reduce for the communicator of all ranks, then one group
  // of a byte each way with every peer; one byte each way alone for a pair's communicator, the lower rank
  // sending first. Their Works and bytes are kept while this lives (nothing waits for them).
  void connect(c10d::Backend& backend, const std::vector<int>& peers, const ComputeStream& on) override {
    const c10::cuda::CUDAStreamGuard guard(on_cuda(on));
    warm_ups_.emplace_back(byte(), nullptr);
    warm_ups_.back().second = backend.allreduce(warm_ups_.back().first);
    if (peers.empty()) return;
    backend.startCoalescing();
    for (int peer : peers) {
      for (const bool send : {true, false}) {
        warm_ups_.emplace_back(byte(), nullptr);
        auto& bytes = warm_ups_.back().first;
        send ? backend.send(bytes, peer, 0) : backend.recv(bytes, peer, 0);
      }
    }
    warm_ups_.emplace_back(std::vector<at::Tensor>{}, backend.endCoalescing());
  }
  void connect_pair(c10d::Backend& backend, int pair, const ComputeStream& on) override {
    const c10::cuda::CUDAStreamGuard guard(on_cuda(on));
    const bool lower = backend.getRank() < pair;
    for (const bool send : {lower, !lower}) {
      warm_ups_.emplace_back(byte(), nullptr);
      auto& bytes = warm_ups_.back().first;
      warm_ups_.back().second = send ? backend.send(bytes, pair, 0) : backend.recv(bytes, pair, 0);
    }
  }
  std::vector<at::Tensor> byte() const {
    return {at::zeros({1}, at::TensorOptions().dtype(at::kByte).device(device_))};
  }

  // -- the host
  at::Tensor to_host(const at::Tensor& bytes) override {
    at::Tensor host = at::empty({bytes.numel()}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    host.copy_(bytes, /*non_blocking=*/true);
    return host;
  }
  bool host_ready(const StreamMarker& marker) override { return static_cast<const CudaMarker&>(marker).event.query(); }
  // Queried, not synchronized: a stuck peer ends in a timeout, not a hang.
  bool host_wait(const StreamMarker& marker, std::chrono::milliseconds timeout) override {
    const c10::Event& event = static_cast<const CudaMarker&>(marker).event;
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

 private:
  c10::Stream stream(Lane lane, const ComputeStream& compute) const {
    return lane == Lane::kComm ? c10::Stream(comm_) : compute;
  }

  c10::Device device_;
  c10::cuda::CUDAStream comm_;
  at::Tensor status_;       // int64[1] on the device: the largest status code seen this step
  at::Tensor host_status_;  // pinned: where the status lands at the end of a step
  std::shared_ptr<CudaMarker> status_read_ = std::make_shared<CudaMarker>();
  std::vector<std::pair<std::vector<at::Tensor>, c10::intrusive_ptr<c10d::Work>>> warm_ups_;  // connect's
};

}  // namespace

std::unique_ptr<DeviceOps> make_cuda_ops(const c10::Device& device) {
  c10::Device d = device;
  if (!d.has_index()) d = c10::Device(c10::DeviceType::CUDA, c10::cuda::current_device());
  return std::make_unique<CudaOps>(d);
}

}  // namespace pipecore
