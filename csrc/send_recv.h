// The send/recv insertion pass of schedule lowering (pipecore/schedule/lowering.py,
// add_send_recv), in C++ for large schedules. Same algorithm, same output; the Python version is
// the reference and runs where the extension is not loaded.
#pragma once

#include <cstdint>
#include <vector>

namespace pipecore {

// Action codes as pipecore/schedule/action.py packs them: kind in the low 4 bits, stage above it,
// microbatch + 1 from bit 20; an OVERLAP_F_B container holds its actions' codes in 52-bit fields
// above its own kind bits.
namespace codes {
constexpr int64_t kF = 0, kI = 1, kW = 2, kB = 3, kSendF = 4, kSendB = 6, kOverlap = 11;
constexpr int kStageShift = 4;
constexpr int kSubShift = 52;
constexpr int64_t kStageMask = (1 << 16) - 1;
}  // namespace codes

// Per stage: what its actions need and send. 0 in a *_need entry means "nothing"; -1 in a *_peer
// entry means "its neighbour is on this rank".
struct StageLinks {
  std::vector<int64_t> fwd_need, fwd_peer, fwd_recv;
  std::vector<int64_t> bwd_need, bwd_peer, bwd_recv;
};

struct SendRecvResult {
  std::vector<std::vector<int64_t>> rows;
  // ranks that could not finish: (rank, position, the key it waits for); empty when none
  std::vector<std::vector<int64_t>> stuck;
};

// `rows`: per rank, action codes; an OVERLAP_F_B container appears as OVERLAP_F_B | (k << 4), k
// indexing `containers` (its leaf codes, in order), and is copied to the output as given.
SendRecvResult add_send_recv(const std::vector<std::vector<int64_t>>& rows,
                             const std::vector<std::vector<int64_t>>& containers, const StageLinks& links);

}  // namespace pipecore
