// Per-action trace events of the last run (Executor::set_trace): host times, or on an accelerator
// events on its current stream, resolved to host times when read.
#include <chrono>

#include "device_timer.h"
#include "executor.h"

namespace pipecore {

void Executor::set_trace(bool on, const std::string& device) {
  tracing_.on = on;
  const c10::Device dev(device);
  tracing_.timer.reset();
  if (on && !dev.is_cpu()) tracing_.timer = std::make_unique<DeviceTimer>(dev);
}

namespace {
double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void Executor::begin_trace() {
  tracing_.events.clear();
  if (tracing_.on && tracing_.timer) tracing_.timer->start(now_us());
  tracing_.resolved = !tracing_.timer;
}

double Executor::trace_time() { return tracing_.timer ? static_cast<double>(tracing_.timer->mark()) : now_us(); }

const std::vector<Executor::TraceEvent>& Executor::trace() {
  if (!tracing_.resolved && tracing_.timer) {
    for (auto& e : tracing_.events) {
      e.start_us = tracing_.timer->host_us(static_cast<size_t>(e.start_us));
      e.end_us = tracing_.timer->host_us(static_cast<size_t>(e.end_us));
    }
  }
  tracing_.resolved = true;
  return tracing_.events;
}

void Executor::exec_traced(size_t i) {
  if (!tracing_.on) return exec(i, RunMode());
  const double t0 = trace_time();
  exec(i, RunMode());
  tracing_.events.push_back({program_[i].label, t0, trace_time(), 0});
}

}  // namespace pipecore
