#include "status_kernels.h"

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>

#include "../message_status.h"

namespace pipecore::cuda {
namespace {

__global__ void fold_trailer_kernel(const int64_t* trailer, int64_t* status) {
  const int64_t code = trailer_code(trailer[0], trailer[1]);
  // atomic: the two halves of an overlapped pair enqueue folds from two host threads
  atomicMax(reinterpret_cast<unsigned long long*>(status), static_cast<unsigned long long>(code));
}

__global__ void write_trailer_kernel(int64_t* trailer, const int64_t* status) {
  trailer[0] = trailer_status(*status);
  trailer[1] = kTrailerMagic;
}

template <typename T>
__global__ void fill_seed_kernel(T* seed, double value, const int64_t* status) {
  seed[0] = static_cast<T>(*status == kMessageOk ? value : 0.0);
}

const int64_t* words(const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda() && t.nbytes() >= 16 && t.is_contiguous(), "pipecore: a trailer is 16 contiguous device bytes");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 8 == 0, "pipecore: misaligned trailer");
  return static_cast<const int64_t*>(t.const_data_ptr());
}

}  // namespace

void fold_trailer(const at::Tensor& trailer, at::Tensor& status, cudaStream_t stream) {
  fold_trailer_kernel<<<1, 1, 0, stream>>>(words(trailer), status.mutable_data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void write_trailer(at::Tensor& trailer, const at::Tensor& status, cudaStream_t stream) {
  write_trailer_kernel<<<1, 1, 0, stream>>>(const_cast<int64_t*>(words(trailer)), status.const_data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fill_seed(at::Tensor& seed, double value, const at::Tensor& status, cudaStream_t stream) {
  TORCH_CHECK(seed.is_cuda() && seed.numel() == 1, "pipecore: a loss seed is one device element");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, seed.scalar_type(), "pipecore_fill_seed", [&] {
    fill_seed_kernel<scalar_t><<<1, 1, 0, stream>>>(seed.mutable_data_ptr<scalar_t>(), value,
                                                     status.const_data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pipecore::cuda
