// The model of NCCL's lazy connections (nccl_connections.h).
#include "nccl_connections.h"

#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../deadline.h"
#include "../errors.h"
#include "nccl_notes.h"

namespace pipecore {
namespace {

// The model's own tag for ranks meeting at a communicator's creation (beside its notes' tags).
constexpr int kConnectTag = kReceiveNoteTag + 1;

std::string communicator_name(const c10d::Backend& backend, int pair) {
  const int me = backend.getRank();
  if (pair < 0) return "the communicator of all " + std::to_string(backend.getSize()) + " ranks";
  return "the communicator of ranks " + std::to_string(std::min(me, pair)) + " and " + std::to_string(std::max(me, pair));
}

// What a rank is connecting with `member`, as the tokens of meet() carry it: a communicator (-1 for all
// ranks', else its pair's), or (`transport`) the point-to-point connection of the two ranks.
int64_t connection_id(const c10d::Backend& backend, int pair, int member, bool transport) {
  const int me = backend.getRank();
  const int other = transport ? member : pair;
  const int64_t pair_id = (int64_t{std::min(me, other)} << 24) + std::max(me, other);
  return transport ? (int64_t{1} << 60) + pair_id : pair < 0 ? -1 : pair_id;
}

// Every member's token, and ours to each (ncclCommInitRank, and NCCL's point-to-point setup, return once
// every member came), on a thread of its own: the caller waits for it up to `timeout`, then ends its gloo
// waits (a gloo wait that times out closes every pair of its group) and says which ranks never came. A
// member whose token names another connection connects them in another order: as on NCCL, neither comes.
std::vector<int> meet(c10d::Backend& backend, const std::vector<int>& members, const std::function<int64_t(int)>& id_of,
                      std::chrono::milliseconds timeout) {
  struct Meeting {
    std::mutex mu;
    std::condition_variable done;
    std::vector<bool> arrived;
    bool finished = false;
    std::vector<c10::intrusive_ptr<c10d::Work>> receives;
    std::vector<c10::intrusive_ptr<c10d::Work>> sends;
    std::vector<std::vector<at::Tensor>> buffers;
  };
  auto meeting = std::make_shared<Meeting>();
  meeting->arrived.assign(members.size(), false);
  for (int peer : members) {
    std::vector<at::Tensor> mine{at::full({1}, id_of(peer), at::kLong)};
    meeting->sends.push_back(backend.send(mine, peer, kConnectTag));
    meeting->buffers.push_back({at::zeros({1}, at::kLong)});
    meeting->receives.push_back(backend.recv(meeting->buffers.back(), peer, kConnectTag));
  }
  std::thread waiter([meeting] {
    for (size_t i = 0; i < meeting->receives.size(); ++i) {
      bool arrived = false;
      try {
        arrived = meeting->receives[i]->wait(std::chrono::milliseconds(0)) &&
                  meeting->sends[i]->wait(std::chrono::milliseconds(0));
      } catch (...) {
      }
      std::lock_guard<std::mutex> lock(meeting->mu);
      meeting->arrived[i] = arrived;
    }
    std::lock_guard<std::mutex> lock(meeting->mu);
    meeting->finished = true;
    meeting->done.notify_all();
  });
  std::vector<int> missing;
  {
    std::unique_lock<std::mutex> lock(meeting->mu);
    if (!meeting->done.wait_for(lock, timeout, [&] { return meeting->finished; })) {
      for (auto& work : meeting->receives) work->abort();
      for (auto& work : meeting->sends) work->abort();
      meeting->done.wait(lock, [&] { return meeting->finished; });
    }
    for (size_t i = 0; i < members.size(); ++i) {
      const bool same = meeting->arrived[i] && meeting->buffers[i][0].item<int64_t>() == id_of(members[i]);
      if (!same) missing.push_back(members[i]);
    }
  }
  waiter.join();
  if (!missing.empty()) {  // (gloo may still write into them: kept as long as the process)
    static std::mutex mu;
    static auto* kept = new std::vector<std::shared_ptr<Meeting>>();  // (never destroyed)
    std::lock_guard<std::mutex> lock(mu);
    kept->push_back(meeting);
  }
  return missing;
}

// Which connections of which backends are made, or being made (by another thread, which a second one
// waits for): kept with the backend, as c10d keeps its communicators (a backend gone and another made at
// its address starts with none). Keys: a communicator's pair (-1: all ranks'), or -2 - peer for the
// point-to-point connection with `peer` of the communicator of all ranks.
class Registry {
 public:
  // Of `keys`, those this thread is to connect now (marked in progress), once no other thread is making
  // one of them; those made already are left out.
  std::vector<int> claim(c10d::Backend& backend, const std::vector<int>& keys) {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(lock, [&] {
      return std::none_of(keys.begin(), keys.end(), [&](int k) { return state(backend, k) == kInProgress; });
    });
    std::vector<int> mine;
    for (int k : keys) {
      if (state(backend, k) == kNone) {
        set(backend, k, kInProgress);
        mine.push_back(k);
      }
    }
    return mine;
  }
  // They are made (or, `made` false, not: another thread may try again).
  void settle(c10d::Backend& backend, const std::vector<int>& keys, bool made, ConnectionCounts& counts, bool ahead,
              bool store) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int k : keys) set(backend, k, made ? kMade : kNone);
    ++(ahead ? counts.ahead : counts.in_steps);
    if (store) ++counts.store_ops;
    changed_.notify_all();
  }

 private:
  enum State { kNone, kInProgress, kMade };
  State state(c10d::Backend& backend, int key) {
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [](const Entry& e) { return e.backend.expired(); }),
                   entries_.end());
    for (const auto& e : entries_) {
      if (e.key == key && e.backend._unsafe_get_target() == &backend) return e.state;
    }
    return kNone;
  }
  void set(c10d::Backend& backend, int key, State to) {
    for (auto& e : entries_) {
      if (e.key == key && e.backend._unsafe_get_target() == &backend) {
        e.state = to;
        return;
      }
    }
    entries_.push_back({c10::weak_intrusive_ptr<c10d::Backend>(c10::intrusive_ptr<c10d::Backend>::reclaim_copy(&backend)),
                        key, to});
  }
  struct Entry {
    c10::weak_intrusive_ptr<c10d::Backend> backend;
    int key;
    State state;
  };
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<Entry> entries_;
};

Registry& registry() {
  static auto* made = new Registry();  // (never destroyed: backends may outlive static destruction)
  return *made;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

}  // namespace

void connect_communicator(c10d::Backend& backend, int pair, const std::string& what, std::chrono::milliseconds timeout,
                          bool ahead, ConnectionCounts& counts) {
  if (registry().claim(backend, {pair}).empty()) return;
  const int me = backend.getRank();
  std::vector<int> members;
  for (int r = 0; r < backend.getSize(); ++r) {
    if (r != me && (pair < 0 || r == pair)) members.push_back(r);
  }
  std::vector<int> missing;
  try {
    missing = meet(backend, members, [&](int member) { return connection_id(backend, pair, member, false); }, timeout);
  } catch (...) {
    registry().settle(backend, {pair}, false, counts, ahead, !members.empty());
    throw;
  }
  // (rank 0's unique id set in the store, or this rank's blocking get of it)
  registry().settle(backend, {pair}, missing.empty(), counts, ahead, !members.empty());
  if (!missing.empty()) {
    throw CommError("pipecore (model of NCCL): this would hang: rank " + std::to_string(me) + "'s " + what +
                    " is the first operation on " + communicator_name(backend, pair) +
                    (ahead ? "" : ", which c10d connects there, inside the step") +
                    " (a unique id through the store, then ncclCommInitRank, which returns once every rank joined); "
                    "rank(s) " + ranks_text(missing) + " did not come to it within the timeout (or came to another "
                    "first), and no timeout of NCCL's and no abort ends that wait on a GPU");
  }
}

void connect_peers(c10d::Backend& backend, const std::vector<int>& peers, const std::string& what,
                   std::chrono::milliseconds timeout, bool ahead, ConnectionCounts& counts) {
  const int me = backend.getRank();
  std::vector<int> keys;
  for (int peer : peers) {
    if (peer != me) keys.push_back(-2 - peer);
  }
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  const std::vector<int> mine = registry().claim(backend, keys);
  if (mine.empty()) return;
  std::vector<int> members;
  for (int k : mine) members.push_back(-2 - k);
  std::vector<int> missing;
  try {
    missing = meet(backend, members, [&](int member) { return connection_id(backend, -1, member, true); }, timeout);
  } catch (...) {
    registry().settle(backend, mine, false, counts, ahead, false);
    throw;
  }
  registry().settle(backend, mine, missing.empty(), counts, ahead, false);
  if (!missing.empty()) {
    throw CommError("pipecore (model of NCCL): this would hang: rank " + std::to_string(me) + "'s " + what +
                    " is its first group with rank(s) " + ranks_text(members) + " on " +
                    communicator_name(backend, -1) + (ahead ? "" : ", where NCCL connects them, inside the step") +
                    " (ncclGroupEnd sets up each new peer's point-to-point connection, which returns once that peer "
                    "did the same); rank(s) " + ranks_text(missing) + " did not come to it within the timeout");
  }
}

}  // namespace pipecore
