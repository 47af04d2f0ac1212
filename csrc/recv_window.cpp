#include "recv_window.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace pipecore {

void RecvWindow::configure(int64_t receives, bool past_sends, int64_t max_bytes) {
  receives_ = receives;
  past_sends_ = past_sends;
  max_bytes_ = max_bytes;
}

void RecvWindow::reset(size_t recv_count) {
  posted_ = reached_ = 0;
  ahead_bytes_ = 0;
  ahead_of_.assign(recv_count, 0);
}

size_t RecvWindow::post_through(const Program& program, size_t at, const std::function<int64_t(size_t)>& bytes_of) {
  const size_t reached = program.recvs_through[at];
  for (; reached_ < std::min(reached, posted_); ++reached_) ahead_bytes_ -= ahead_of_[reached_];
  const size_t end = std::min(reached + static_cast<size_t>(receives_), program.recv_instrs.size());
  size_t through = std::max(posted_, std::min(reached, end));
  while (through < end) {
    const size_t k = through;
    // a receive behind a send to its peer that has not run yet waits (in-order backends)
    if (!past_sends_ && program.send_before_recv[k] >= static_cast<int64_t>(at)) break;
    if (k >= reached) {  // ahead of the program: within the byte budget, or the next one
      const int64_t bytes = bytes_of(k);
      if (k > reached && ahead_bytes_ + bytes > max_bytes_) break;
      ahead_of_[k] = bytes;
      ahead_bytes_ += bytes;
    }
    through = k + 1;
  }
  return through;
}

}  // namespace pipecore
