// The checker of the stream contract (../stream_contract.h), for the CPU model of the device path
// (host_device_comm.cpp). It keeps what a GPU would do with its streams as vector clocks: the
// communication stream, the compute stream and a second compute stream a thread may make current
// (lanes, kLanes), each counting its operations; an event is a copy of its lane's clock, a wait takes
// the maximum. The model says which lane each use is on (Lane::kCompute: the current one). Per message
// buffer it keeps the lane that allocated it and where, each lane's last use and the last write, with
// the message of each. It refuses (throws, and keeps the text for violations(), naming both uses):
// - a use on another lane than the owner's before that lane waited for the owner's work up to the
//   allocation (a block the caching allocator recycled could still be read by the owner's queued
//   work: hazard 1 of issue 35);
// - a read on another lane than the last writer's before that lane waited for the write (a receive
//   read before its transfer's ready event);
// - a free before the owner waited for every other lane's last use (a receive dropped while the
//   transfer may still write it: the caching allocator returns a block to the stream that allocated
//   it, and hands it to that stream's next allocation at once).
// Message parts that share one live storage (an aborted step's receive scratch; a send of a tensor
// a stage passed on from its input) are one block, allocated once and freed with the last of those
// parts released here; a send's part is never released here (it keeps the block until its Work
// completed, rule 4), so such a block is not checked as freed: it is not freed before then.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../stream_contract.h"

namespace pipecore {

class StreamLedger final {
 public:
  static constexpr int kLanes = 3;  // [compute, communication, second compute]: Lane's values, then a side stream
  static constexpr int kSideLane = 2;
  std::shared_ptr<StreamMarker> record(int lane);
  void wait(int lane, const StreamMarker& marker);
  void allocated(const at::Tensor& t, int lane);
  // `what`: the message whose part it is, for reports ("the receive from rank 0 (4096 bytes, action 12)")
  void used(const at::Tensor& t, int lane, bool writes, const std::string& what);
  void freed(const at::Tensor& t, const std::string& what);
  std::vector<std::string> violations() const;
  // A violation found outside the ledger's own checks (kept, not thrown).
  void note_violation(const std::string& what);

 private:
  using Clock = std::array<int64_t, kLanes>;
  struct Buffer {
    int owner = 0;
    int64_t allocated_at = 0;               // the owner's operation count at the allocation
    Clock last_use{};                       // per lane (0: never)
    std::array<std::string, kLanes> last_user;  // per lane: the message of its last use
    int writer = -1;                        // the last write's lane and operation
    int64_t written_at = 0;
    std::string written_by;
    int parts = 0;                          // message parts in it not released yet
    c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  };
  int64_t tick(int lane);
  void refuse(std::string what);
  mutable std::mutex mu_;
  std::array<Clock, kLanes> clocks_{};      // [lane]: what it has waited for, itself included
  std::unordered_map<const void*, Buffer> buffers_;  // by storage
  std::vector<std::string> violations_;
};

}  // namespace pipecore
