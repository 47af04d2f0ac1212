// The checker of the stream contract (../stream_contract.h), for the host emulation of the device
// path. It keeps what a GPU would do with the two streams as vector clocks: each lane counts its
// operations, an event is a copy of its lane's clock, a wait takes the maximum. Per message buffer
// it keeps the lane that allocated it and where, each lane's last use and the last write. It
// refuses (throws, and keeps the text for violations()):
// - a use on another lane than the owner's before that lane waited for the owner's work up to the
//   allocation (a block the caching allocator recycled could still be read by the owner's queued
//   work: hazard 1 of issue 35);
// - a read on another lane than the last writer's before that lane waited for the write (a receive
//   read before its transfer's ready event);
// - a free before the owner waited for every other lane's last use (a receive dropped while the
//   transfer may still write it).
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

class StreamLedger final : public StreamSync {
 public:
  std::shared_ptr<StreamMarker> record(Lane lane) override;
  void wait(Lane lane, const StreamMarker& marker) override;
  void allocated(const at::Tensor& t, Lane lane) override;
  void used(const at::Tensor& t, Lane lane, bool writes) override;
  void freed(const at::Tensor& t) override;
  std::vector<std::string> violations() const;
  // A violation found outside the ledger's own checks (kept, not thrown).
  void note_violation(const std::string& what);

 private:
  static constexpr int kLanes = 2;
  using Clock = std::array<int64_t, kLanes>;
  // One compute stream here: the posting one (kOwner) is the compute lane.
  static int lane_index(Lane lane) { return lane == Lane::kOwner ? 0 : static_cast<int>(lane); }
  struct Buffer {
    int owner = 0;
    int64_t allocated_at = 0;               // the owner's operation count at the allocation
    Clock last_use{};                       // per lane (0: never)
    int writer = -1;                        // the last write's lane and operation
    int64_t written_at = 0;
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
