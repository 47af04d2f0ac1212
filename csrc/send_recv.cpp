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
  // "done" markers: an action's code with kind bits 1 (forward), 2 (grad-input), 3 (W done)
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

  while (!current.empty()) {
    woken.clear();
    for (int64_t r : current) {
      const int64_t c = rows[r][pos[r]];
      const int64_t kind = c & 0xF;
      auto& dst = out[r];
      if (kind == kF) {
        const std::size_t s = stage_of(c);
        const int64_t d = links.fwd_need[s];
        if (d != 0 && !is_done(c + d)) {
          wait(r, c + d);
          continue;
        }
        dst.push_back(c);
        const int64_t peer = links.fwd_peer[s];
        if (peer >= 0) {
          dst.push_back(c | kSendF);
          out[peer].push_back(c + links.fwd_recv[s]);
        }
        mark(c | 1);
      } else if (kind == kB || kind == kI) {
        const std::size_t s = stage_of(c);
        const int64_t base = c & kKindMask;
        if (!is_done(base | 1)) {
          wait(r, base | 1);
          continue;
        }
        const int64_t d = links.bwd_need[s];
        if (d != 0 && !is_done(base + d)) {
          wait(r, base + d);
          continue;
        }
        dst.push_back(c);
        const int64_t peer = links.bwd_peer[s];
        if (peer >= 0) {
          dst.push_back(base | kSendB);
          out[peer].push_back(base + links.bwd_recv[s]);
        }
        mark(base | 2);
        if (kind == kB) done.insert(base | 3);
      } else if (kind == kW) {
        const int64_t base = c & kKindMask;
        if (!is_done(base | 2)) {
          wait(r, base | 2);
          continue;
        }
        dst.push_back(c);
        done.insert(base | 3);
      } else if (kind == kOverlap) {
        const auto& leaves = containers[static_cast<std::size_t>(c >> kStageShift)];
        int64_t need = 0;
        for (int64_t leaf : leaves) {
          const int64_t lk = leaf & 0xF, base = leaf & kKindMask;
          const std::size_t ls = stage_of(leaf);
          if (lk == kF) {
            const int64_t d = links.fwd_need[ls];
            if (d != 0 && !is_done(leaf + d)) need = leaf + d;
          } else if (lk == kW) {
            if (!is_done(base | 2)) need = base | 2;
          } else if (!is_done(base | 1)) {
            need = base | 1;
          } else if (links.bwd_need[ls] != 0 && !is_done(base + links.bwd_need[ls])) {
            need = base + links.bwd_need[ls];
          }
          if (need) break;
        }
        if (need) {
          wait(r, need);
          continue;
        }
        dst.push_back(c);
        for (int64_t leaf : leaves) {
          const int64_t lk = leaf & 0xF, base = leaf & kKindMask;
          const std::size_t ls = stage_of(leaf);
          if (lk == kF) {
            if (links.fwd_peer[ls] >= 0) {
              dst.push_back(base | kSendF);
              out[links.fwd_peer[ls]].push_back(base + links.fwd_recv[ls]);
            }
            mark(base | 1);
          } else if (lk == kW) {
            mark(base | 3);
          } else {
            if (links.bwd_peer[ls] >= 0) {
              dst.push_back(base | kSendB);
              out[links.bwd_peer[ls]].push_back(base + links.bwd_recv[ls]);
            }
            mark(base | 2);
            if (lk == kB) mark(base | 3);
          }
        }
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
