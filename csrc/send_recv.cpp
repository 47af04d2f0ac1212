#include "send_recv.h"

#include <cstddef>
#include <unordered_map>
#include <unordered_set>

namespace pipecore {
using namespace codes;  // NOLINT: the code layout's names
namespace {
constexpr int64_t kKindMask = ~int64_t{0xF};
}  // namespace

SendRecvResult add_send_recv(const std::vector<std::vector<int64_t>>& rows,
                             const std::vector<std::vector<int64_t>>& containers, const StageLinks& links) {
  const std::size_t num_ranks = rows.size();
  SendRecvResult result;
  auto& out = result.rows;
  out.resize(num_ranks);
  std::size_t total = 0;
  for (std::size_t r = 0; r < num_ranks; ++r) {
    out[r].reserve(rows[r].size() * 2);
    total += rows[r].size();
  }
  std::vector<std::size_t> pos(num_ranks, 0);
  // "done" markers: an action's code with kind bits 1 (forward done), 2 (grad-input done)
  std::unordered_set<int64_t> done;
  done.reserve(total * 2);
  std::unordered_map<int64_t, std::vector<int64_t>> waiting;  // marker -> ranks, in waiting order
  std::vector<int64_t> blocked(num_ranks, 0);
  std::vector<int64_t> current, woken;
  for (std::size_t r = 0; r < num_ranks; ++r) {
    if (!rows[r].empty()) current.push_back(static_cast<int64_t>(r));
  }
  auto wait = [&](int64_t r, int64_t need) {
    waiting[need].push_back(r);
    blocked[r] = need;
  };
  auto mark = [&](int64_t m) {
    done.insert(m);
    auto it = waiting.find(m);
    if (it != waiting.end()) {
      woken.insert(woken.end(), it->second.begin(), it->second.end());
      waiting.erase(it);
    }
  };
  auto stage_of = [](int64_t c) { return static_cast<std::size_t>((c >> kStageShift) & kStageMask); };
  auto is_done = [&](int64_t key) { return done.count(key) != 0; };
  // The done marker a single action (or a container's part) waits for; 0 when it can run.
  auto need_of = [&](int64_t code) -> int64_t {
    const int64_t kind = code & 0xF, base = code & kKindMask;
    const std::size_t s = stage_of(code);
    if (kind == kF) {
      const int64_t d = links.fwd_need[s];
      return d != 0 && !is_done(code + d) ? code + d : 0;
    }
    if (kind == kW) return is_done(base | 2) ? 0 : base | 2;
    if (!is_done(base | 1)) return base | 1;  // I, B: after the forward
    const int64_t d = links.bwd_need[s];
    return d != 0 && !is_done(base + d) ? base + d : 0;
  };
  // After `code` ran on the rank whose list is `dst`: its SEND there, the matching RECV on the peer,
  // its done marker (nothing waits for a W).
  auto complete = [&](std::vector<int64_t>& dst, int64_t code) {
    const int64_t kind = code & 0xF, base = code & kKindMask;
    const std::size_t s = stage_of(code);
    if (kind == kF) {
      if (links.fwd_peer[s] >= 0) {
        dst.push_back(base | kSendF);
        out[links.fwd_peer[s]].push_back(base + links.fwd_recv[s]);
      }
      mark(base | 1);
    } else if (kind == kB || kind == kI) {
      if (links.bwd_peer[s] >= 0) {
        dst.push_back(base | kSendB);
        out[links.bwd_peer[s]].push_back(base + links.bwd_recv[s]);
      }
      mark(base | 2);
    }
  };

  while (!current.empty()) {
    woken.clear();
    for (int64_t r : current) {
      const int64_t c = rows[r][pos[r]];
      const int64_t kind = c & 0xF;
      auto& dst = out[r];
      if (kind == kOverlap) {
        const auto& leaves = containers[static_cast<std::size_t>(c >> kStageShift)];
        int64_t need = 0;
        for (int64_t leaf : leaves) {
          if ((need = need_of(leaf)) != 0) break;
        }
        if (need) {
          wait(r, need);
          continue;
        }
        dst.push_back(c);
        for (int64_t leaf : leaves) complete(dst, leaf);
      } else if (kind == kF || kind == kI || kind == kW || kind == kB) {
        if (const int64_t need = need_of(c)) {
          wait(r, need);
          continue;
        }
        dst.push_back(c);
        complete(dst, c);
      } else {  // REDUCE_GRAD, UNSHARD, RESHARD: never wait
        dst.push_back(c);
      }
      if (++pos[r] < rows[r].size()) woken.push_back(r);
    }
    current.swap(woken);
  }
  for (std::size_t r = 0; r < num_ranks; ++r) {
    if (pos[r] < rows[r].size()) {
      result.stuck.push_back({static_cast<int64_t>(r), static_cast<int64_t>(pos[r]), blocked[r]});
    }
  }
  return result;
}

}  // namespace pipecore
