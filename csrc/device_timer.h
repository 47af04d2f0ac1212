// Action times on an accelerator (CUDA events): the host only queues an action's work, so host
// clock times would show when work was queued, not when it ran. Events are recorded on the
// current stream around each action and read once, when the trace is asked for.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <cstddef>
#include <vector>

namespace pipecore {

class DeviceTimer {
 public:
  explicit DeviceTimer(c10::Device device);
  // At a step's start: waits for the device once, so that its clock can be placed on the host's.
  void start(double host_now_us);
  // Records an event on the device's current stream; returns its index.
  size_t mark();
  // Host-clock time (microseconds) at which mark `i` was reached on the device. The first call
  // after a step waits for the device.
  double host_us(size_t i);

 private:
  c10::Device device_;
  c10::Event origin_;
  double origin_host_us_ = 0.0;
  std::vector<c10::Event> marks_;
  size_t used_ = 0;
};

}  // namespace pipecore
