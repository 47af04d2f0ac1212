#include "device_comm.h"

namespace pipecore {

#ifndef PIPECORE_CUDA
// Builds without CUDA sources: messages on any device go through the host-waiting path.
std::unique_ptr<DeviceComm> make_device_comm(const c10::Device&) { return nullptr; }
#endif

}  // namespace pipecore
