// Single-thread kernels that keep a step's message status on the device (see device_comm.h), so
// that no message's trailer is copied to the host.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

namespace pipecore::cuda {

// Device status codes (message_status.h): 0 ok, 1 a peer's step aborted, 2 shapes changed,
// kStatusNotOurs a trailer was not pipecore's. The step status is the largest code seen.

// status = max(status, the code of the 16-byte `trailer`)
void fold_trailer(const at::Tensor& trailer, at::Tensor& status, cudaStream_t stream);
// trailer = (status, magic), where a foreign trailer's code goes on as "aborted"
void write_trailer(at::Tensor& trailer, const at::Tensor& status, cudaStream_t stream);
// seed[0] = status == ok ? value : 0
void fill_seed(at::Tensor& seed, double value, const at::Tensor& status, cudaStream_t stream);

}  // namespace pipecore::cuda
