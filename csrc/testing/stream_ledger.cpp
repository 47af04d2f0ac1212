#include "stream_ledger.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace pipecore {
namespace {

struct LedgerMarker final : StreamMarker {
  std::array<int64_t, StreamLedger::kLanes> clock{};
};

const char* name(int lane) {
  return lane == static_cast<int>(Lane::kComm) ? "communication" : lane == StreamLedger::kSideLane ? "second compute"
                                                                                                  : "compute";
}

const void* key(const at::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

}  // namespace

int64_t StreamLedger::tick(int lane) { return ++clocks_[lane][lane]; }

void StreamLedger::refuse(std::string what) {
  violations_.push_back("pipecore stream contract: " + what);
  throw std::logic_error(violations_.back());
}

void StreamLedger::note_violation(const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  violations_.push_back("pipecore stream contract: " + what);
}

std::shared_ptr<StreamMarker> StreamLedger::record(int lane) {
  std::lock_guard<std::mutex> lock(mu_);
  auto marker = std::make_shared<LedgerMarker>();
  marker->clock = clocks_[lane];
  return marker;
}

void StreamLedger::wait(int lane, const StreamMarker& marker) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto& seen = static_cast<const LedgerMarker&>(marker).clock;
  Clock& mine = clocks_[lane];
  for (int l = 0; l < kLanes; ++l) mine[l] = std::max(mine[l], seen[l]);
}

void StreamLedger::allocated(const at::Tensor& t, int lane) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buffers_.find(key(t));
  if (it != buffers_.end() && !it->second.storage.expired()) {  // another part of a live block
    ++it->second.parts;
    return;
  }
  Buffer b;
  b.owner = lane;
  b.allocated_at = tick(lane);  // the owner's work queued before this point may still use the block
  b.parts = 1;
  b.storage = t.storage().getWeakStorageImpl();
  buffers_[key(t)] = b;
}

void StreamLedger::used(const at::Tensor& t, int lane, bool writes, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buffers_.find(key(t));
  if (it == buffers_.end()) return;  // not a message buffer
  Buffer& b = it->second;
  const Clock& mine = clocks_[lane];
  if (lane != b.owner && mine[b.owner] < b.allocated_at) {
    std::ostringstream os;
    os << "the " << name(lane) << " stream uses a message buffer of " << t.nbytes() << " bytes (" << what
       << ") allocated on the " << name(b.owner) << " stream at its operation " << b.allocated_at
       << ", but has waited for that stream only up to operation " << mine[b.owner]
       << ": the caching allocator may have handed out a block that work queued there still reads";
    refuse(os.str());
  }
  if (b.writer >= 0 && b.writer != lane && mine[b.writer] < b.written_at) {
    std::ostringstream os;
    os << "the " << name(lane) << " stream uses a message buffer of " << t.nbytes() << " bytes (" << what
       << ") before waiting for the " << name(b.writer) << " stream's write of it (" << b.written_by
       << ": its operation " << b.written_at << "; waited up to " << mine[b.writer] << ")";
    refuse(os.str());
  }
  const int64_t at = tick(lane);
  b.last_use[lane] = at;
  b.last_user[lane] = what;
  if (writes) {
    b.writer = lane;
    b.written_at = at;
    b.written_by = what;
  }
}

void StreamLedger::freed(const at::Tensor& t, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buffers_.find(key(t));
  if (it == buffers_.end()) return;
  if (--it->second.parts > 0) return;  // other parts still hold the block
  const Buffer b = it->second;
  buffers_.erase(it);
  const Clock& owner = clocks_[b.owner];
  for (int l = 0; l < kLanes; ++l) {
    if (l == b.owner || b.last_use[l] == 0 || owner[l] >= b.last_use[l]) continue;
    std::ostringstream os;
    os << "a message buffer of " << t.nbytes() << " bytes is freed to the " << name(b.owner) << " stream's pool "
       << "(letting go of " << what << ") while the " << name(l) << " stream may still use it ("
       << b.last_user[l] << ": its operation " << b.last_use[l] << "; the " << name(b.owner)
       << " stream waited up to " << owner[l] << "), where the caching allocator may hand it to the next "
       << "allocation";
    refuse(os.str());
  }
}

std::vector<std::string> StreamLedger::violations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return violations_;
}

}  // namespace pipecore
