// Deadlines of the executor's waits: a timeout from now, and what is left of it.
#pragma once

#include <chrono>

namespace pipecore {

// `timeout` from now; the clock's end where that lies beyond it (a timeout of centuries never ends).
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = std::chrono::steady_clock::now();
  const auto end_of_clock = std::chrono::steady_clock::time_point::max();
  return timeout < std::chrono::duration_cast<std::chrono::milliseconds>(end_of_clock - now) ? now + timeout
                                                                                              : end_of_clock;
}

// What is left until `deadline` (none or less: zero or negative).
inline std::chrono::milliseconds time_left(std::chrono::steady_clock::time_point deadline) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
}

}  // namespace pipecore
