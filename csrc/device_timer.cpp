#include "device_timer.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace pipecore {
namespace {
c10::Stream current_stream(c10::Device device) { return c10::impl::VirtualGuardImpl(device.type()).getStream(device); }
}  // namespace

DeviceTimer::DeviceTimer(c10::Device device)
    : device_(device), origin_(device.type(), c10::EventFlag::BACKEND_DEFAULT) {
  TORCH_CHECK(!device.is_cpu(), "pipecore: device timing is for accelerators; the CPU uses the host clock");
}

void DeviceTimer::start(double host_now_us) {
  origin_.record(current_stream(device_));
  origin_.synchronize();  // the device is idle now: its time at origin_ is the host's
  origin_host_us_ = host_now_us;
  used_ = 0;
}

size_t DeviceTimer::mark() {
  if (used_ == marks_.size()) marks_.emplace_back(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
  marks_[used_].record(current_stream(device_));
  return used_++;
}

double DeviceTimer::host_us(size_t i) {
  TORCH_CHECK(i < used_, "pipecore: no device time recorded for trace entry ", i);
  marks_[i].synchronize();
  return origin_host_us_ + origin_.elapsedTime(marks_[i]) * 1000.0;  // elapsedTime is in ms
}

}  // namespace pipecore
