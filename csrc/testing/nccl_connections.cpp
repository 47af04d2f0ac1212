// The model of NCCL's lazy connections (nccl_connections.h).
#include "nccl_connections.h"

#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <condition_variable>
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

// Which communicator a rank is connecting, as the tokens of meet() carry it: -1 for all ranks, else its pair.
int64_t communicator_id(const c10d::Backend& backend, int pair) {
  const int me = backend.getRank();
  return pair < 0 ? -1 : (int64_t{std::min(me, pair)} << 32) + std::max(me, pair);
}

// Every other member's token, and ours to each (ncclCommInitRank returns once every rank joined), on a
// thread of its own: the caller waits for it up to `timeout`, then ends its gloo waits (a gloo wait
// that times out closes every pair of its group) and says which ranks never came. A member whose token
// names another communicator connects them in another order: as on NCCL, neither comes.
std::vector<int> meet(c10d::Backend& backend, int pair, const std::vector<int>& members,
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
    std::vector<at::Tensor> mine{at::full({1}, communicator_id(backend, pair), at::kLong)};
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
      const bool same = meeting->arrived[i] && meeting->buffers[i][0].item<int64_t>() == communicator_id(backend, pair);
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

// Whether a communicator of `backend` is connected: kept with the backend, as c10d keeps its communicators
// (a backend gone and another made at its address starts with none).
class Connected {
 public:
  bool contains(c10d::Backend& backend, int pair) {
    forget_expired();
    for (const auto& [weak, p] : connected_) {
      if (p == pair && weak._unsafe_get_target() == &backend) return true;
    }
    return false;
  }
  void add(c10d::Backend& backend, int pair) {
    connected_.emplace_back(c10::weak_intrusive_ptr<c10d::Backend>(c10::intrusive_ptr<c10d::Backend>::reclaim_copy(&backend)), pair);
  }

 private:
  void forget_expired() {
    connected_.erase(std::remove_if(connected_.begin(), connected_.end(), [](const auto& c) { return c.first.expired(); }),
                     connected_.end());
  }
  std::vector<std::pair<c10::weak_intrusive_ptr<c10d::Backend>, int>> connected_;
};

void connect(c10d::Backend& backend, int pair, const std::string& what, std::chrono::milliseconds timeout, bool ahead,
             ConnectionCounts& counts) {
  static std::mutex mu;  // one connection at a time (c10d makes them under its lock)
  static auto* connected = new Connected();  // (never destroyed: backends may outlive static destruction)
  std::lock_guard<std::mutex> lock(mu);
  if (connected->contains(backend, pair)) return;
  const int me = backend.getRank();
  std::vector<int> members;
  for (int r = 0; r < backend.getSize(); ++r) {
    if (r != me && (pair < 0 || r == pair)) members.push_back(r);
  }
  ++(ahead ? counts.ahead : counts.in_steps);
  if (!members.empty()) ++counts.store_ops;  // rank 0's id set, or this rank's blocking get of it
  const std::vector<int> missing = meet(backend, pair, members, timeout);
  if (!missing.empty()) {
    std::string ranks;
    for (int r : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    throw CommError("pipecore (model of NCCL): this would hang: rank " + std::to_string(me) + "'s " + what +
                    " is the first operation on " + communicator_name(backend, pair) +
                    (ahead ? "" : ", which c10d connects there, inside the step") +
                    " (a unique id through the store, then ncclCommInitRank, which returns once every rank joined); "
                    "rank(s) " + ranks + " did not come to it within the timeout (or came to another first), and "
                    "nothing (no timeout, no abort) ends that wait on a GPU");
  }
  connected->add(backend, pair);
}

}  // namespace

void connect_at_operation(c10d::Backend& backend, int pair, const std::string& what, std::chrono::milliseconds timeout,
                          ConnectionCounts& counts) {
  connect(backend, pair, what, timeout, /*ahead=*/false, counts);
}

void connect_ahead(c10d::Backend& backend, int pair, std::chrono::milliseconds timeout, ConnectionCounts& counts) {
  connect(backend, pair, "connecting it ahead of the first step", timeout, /*ahead=*/true, counts);
}

}  // namespace pipecore
