// How far ahead of the program point receives are posted on the host path. gloo moves a message's data
// only once its receive is posted, so a receive posted just before its data is needed costs a round trip;
// posted early, the data is already there. Each receive posted early holds its buffer that much longer:
// the window is a count of RECV actions and a budget of buffer bytes ahead (the next receive always goes).
// The device path posts receives with their batch instead (device_path.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "program.h"

namespace pipecore {

// How many RECV actions ahead of the program point receives are posted by default, and how many
// bytes of buffers they may hold before the program reaches them.
constexpr int64_t kDefaultRecvWindow = 32;
constexpr int64_t kRecvWindowBytes = 16 << 20;

class RecvWindow {
 public:
  // `receives` ahead (0: each at its own action), `max_bytes` of buffers ahead. `past_sends` = false keeps
  // a receive behind an earlier send to its peer that has not run yet: backends that run a peer pair's
  // operations in posting order would deadlock otherwise ([Note: NCCL pair order], device_comm.h).
  void configure(int64_t receives, bool past_sends, int64_t max_bytes);
  int64_t receives() const { return receives_; }
  // A run's start: nothing posted or reached.
  void reset(size_t recv_count);
  // Before program point `at`: the ordinal up to which receives are to be posted now (at least those the
  // program reached), booking the buffer bytes (`bytes_of(k)`) of those it admits ahead: the caller posts
  // every one of them (HostPath::post_recvs_until), or the run is aborted.
  size_t post_through(const Program& program, size_t at, const std::function<int64_t(size_t)>& bytes_of);
  size_t posted() const { return posted_; }
  // RECV `k` is being posted (ordinals go up one at a time).
  void mark_posted(size_t k) { posted_ = k + 1; }

 private:
  int64_t receives_ = kDefaultRecvWindow;
  int64_t max_bytes_ = kRecvWindowBytes;
  bool past_sends_ = true;
  size_t posted_ = 0;               // RECV actions posted so far in this run
  size_t reached_ = 0;              // ... that the program reached (their bytes no longer count ahead)
  int64_t ahead_bytes_ = 0;         // of receives posted ahead and not reached yet
  std::vector<int64_t> ahead_of_;  // [k]: buffer bytes of RECV k if it was posted ahead
};

}  // namespace pipecore
