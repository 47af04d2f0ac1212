"""DeepSeek's DualPipe (bidirectional) and DualPipeV (its V-shaped, single-direction fold).

Both run the same eight phases per rank, with overlapped forward/backward pairs (OVERLAP_F_B) in
the steady state and I/W split backwards to fill the ends:
  1 nF0   2 nF0F1   3 nI1W1F1   4 n(F0B1)(F1B0)   5 nB1(F1B0)   6 nB1B0 (second half I)   7 nWB0   8 nW
"Phase 0" is the chunk a rank reaches first in its direction of travel, "phase 1" the other.
"""

from collections import deque

from pipecore.schedule.schedule import Schedule
from pipecore.schedule.topology import Topology
from pipecore.schedule.builders._codes import B, F, I, W, code, overlap


def _dual_rank(n, hr, chunks, stage_of, mb_base):
    """Actions of one rank. n: ranks per leg, hr: the rank's position along its leg,
    chunks: microbatches per phase, stage_of[p]/mb_base[p]: stage and first microbatch of phase p."""
    next_f = [0, 0]
    next_b = [0, 0]
    pending_w: deque[int] = deque()
    row: list[int] = []

    def fwd(p):
        c = code(stage_of[p], F, mb_base[p] + next_f[p])
        next_f[p] += 1
        return c

    def bwd(p, split=False):
        mb = mb_base[p] + next_b[p]
        next_b[p] += 1
        if split:
            pending_w.append(code(stage_of[p], W, mb))
            return code(stage_of[p], I, mb)
        return code(stage_of[p], B, mb)

    def weight():
        if pending_w:
            row.append(pending_w.popleft())

    for _ in range(2 * (n - hr - 1)):
        row.append(fwd(0))
    for _ in range(hr + 1):
        row.append(fwd(0))
        row.append(fwd(1))
    for _ in range(n - hr - 1):
        row.append(bwd(1, split=True))
        weight()
        row.append(fwd(1))
    for i in range(chunks - 2 * n + hr + 1):
        if i == 0 and hr == n - 1:
            # the turning point: no overlap, to shorten the bubble
            row.append(fwd(0))
            row.append(bwd(1))
        else:
            row.append(overlap(fwd(0), bwd(1)))
        row.append(overlap(fwd(1), bwd(0)))
    for _ in range(n - hr - 1):
        row.append(bwd(1))
        row.append(overlap(fwd(1), bwd(0)))
    split = False
    steps = hr + 1
    for i in range(steps):
        if i == steps // 2 and hr % 2 == 1:
            split = True
        row.append(bwd(1, split))
        if i == steps // 2 and hr % 2 == 0:
            split = True
        row.append(bwd(0, split))
    for _ in range(n - hr - 1):
        weight()
        row.append(bwd(0, split))
    while pending_w:
        weight()
    assert next_f == [chunks, chunks] and next_b == [chunks, chunks], (next_f, next_b)
    return row


def dualpipev_sizes(R: int, m: int) -> str | None:
    """Why dualpipev does not run R ranks and m microbatches (None: it does)."""
    if m < 2 * R:
        return f"dualpipev needs at least 2 * ranks = {2 * R} microbatches (one per stage), got {m}"
    return None


def dualpipe_sizes(R: int, m: int) -> str | None:
    """Why dualpipe does not run R ranks and m microbatches (None: it does)."""
    if R % 2:
        return f"dualpipe needs an even number of ranks (two mirrored halves), got {R}"
    if m % 2 or m < 2 * R:
        return (f"dualpipe needs an even number of microbatches, at least 2 * ranks = {2 * R} (each direction takes "
                f"half), got {m}")
    return None


def build_dualpipev(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    R, m = num_ranks, num_microbatches
    codes = [_dual_rank(R, r, m, (r, 2 * R - 1 - r), (0, 0)) for r in range(R)]
    return Schedule.from_codes(codes, Topology.v(R, 2 * R, m), "dualpipev")


def build_dualpipe(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    R, m = num_ranks, num_microbatches
    half = m // 2
    codes = []
    for r in range(R):
        down, up = r, 2 * R - 1 - r  # stage r of the down pipe, mirror stage R-1-r of the up pipe
        if r < R // 2:
            stage_of, mb_base = (down, up), (0, half)
        else:
            stage_of, mb_base = (up, down), (half, 0)
        codes.append(_dual_rank(R // 2, min(r, R - 1 - r), half, stage_of, mb_base))
    return Schedule.from_codes(codes, Topology.dualpipe(R, m), "dualpipe")
