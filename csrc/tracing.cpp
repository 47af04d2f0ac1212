// Per-action trace events of the last run (Executor::set_trace): host times, or on an accelerator
// events on its current stream, resolved to host times when read.
#include <chrono>

#include "device_timer.h"
#include "executor.h"

namespace pipecore {

void Executor::set_trace(bool on, const std::string& device) {
  trace_on_ = on;
  const c10::Device dev(device);
  timer_.reset();
  if (on && !dev.is_cpu()) timer_ = std::make_unique<DeviceTimer>(dev);
}

namespace {
double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void Executor::begin_trace() {
  trace_.clear();
  if (trace_on_ && timer_) timer_->start(now_us());
  trace_resolved_ = !timer_;
}

double Executor::trace_time() { return timer_ ? static_cast<double>(timer_->mark()) : now_us(); }

const std::vector<Executor::TraceEvent>& Executor::trace() {
  if (!trace_resolved_ && timer_) {
    for (auto& e : trace_) {
      e.start_us = timer_->host_us(static_cast<size_t>(e.start_us));
      e.end_us = timer_->host_us(static_cast<size_t>(e.end_us));
    }
  }
  trace_resolved_ = true;
  return trace_;
}

void Executor::exec_traced(size_t i) {
  if (!trace_on_) return exec(i, RunMode());
  const double t0 = trace_time();
  exec(i, RunMode());
  trace_.push_back({program_[i].label, t0, trace_time(), 0});
}

}  // namespace pipecore
