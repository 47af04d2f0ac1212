"""Interleaved schedules over loop placement (stage s on rank s % R, V stages per rank):
Megatron's interleaved 1F1B (depth first), its zero-bubble form (ZB-H1 for V=1: backward split
into I and W, W fills the bubbles), and looped BFS (breadth first).

Depth first runs microbatches in groups (Megatron's `microbatch_group_size_per_vp_stage`, N): a
rank runs the forwards of a group on its first local stage, then on its second, and so on; the
last group takes the rest of the microbatches. Megatron accepts R <= N <= m with m % N either 0 or
at least R; so does `group_size` here. The default group is torch's (m // max(1, m // R), where m
is a multiple of that round count), else the smallest N that Megatron accepts: every m works.
"""

from pipecore.schedule.schedule import Schedule
from pipecore.schedule.topology import Topology
from pipecore.schedule.action import MB_SHIFT, STAGE_SHIFT
from pipecore.schedule.builders._codes import B, F, I, W, code


def rounds(num_ranks: int, num_microbatches: int) -> int:
    return max(1, num_microbatches // num_ranks)


def default_group_size(num_ranks: int, num_microbatches: int) -> int:
    """torch's round size where torch accepts m, else the smallest group Megatron accepts."""
    R, m = num_ranks, num_microbatches
    n = rounds(R, m)
    if m % n == 0:
        return m // n
    return next(N for N in range(R, m + 1) if m % N == 0 or m % N >= R)


def check_group_size(name: str, R: int, m: int, group_size) -> int:
    if group_size is None:
        return default_group_size(R, m)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an integer, got {group_size!r}")
    low = min(R, m)  # fewer microbatches than ranks: one group of all of them
    if not low <= group_size <= m or (m % group_size and m % group_size < R):
        fits = [N for N in range(low, min(m, low + 200) + 1) if m % N == 0 or m % N >= R][:10]
        raise ValueError(
            f"{name}: group_size={group_size} does not fit {m} microbatches on {R} ranks: a group holds between "
            f"min(ranks, microbatches) and microbatches microbatches, and the last group (m % group_size, "
            f"when not 0) at least one per rank, as in Megatron; e.g. {fits}{' or ' + str(m) if m not in fits else ''}")
    return group_size


def chunk_order(V: int, m: int, N: int) -> list[int]:
    """The local stage of a rank's k-th forward (Megatron's schedule table, chunks only)."""
    order: list[int] = []
    for first in range(0, m, N):
        size = m - first if first + N >= m else N
        for v in range(V):
            order += [v] * size
    return order


def _interleaved_rank(rank, R, V, m, warmup_factor, zero_bubble, N):
    total = V * m
    warmup = min((V - 1) * N + warmup_factor * (R - 1 - rank), total)
    chunks = chunk_order(V, m, N)
    delay_w = rank  # zero bubble: rank r starts deferring W after r backwards in steady state
    # per local stage: base code (stage bits, microbatch "-1") and next microbatch per kind
    base = [((v * R + rank) << STAGE_SHIFT) for v in range(V)]
    next_f, next_b, next_w = [0] * V, [0] * V, [0] * V
    unit = 1 << MB_SHIFT
    back_kind = I if zero_bubble else B
    row = []
    append = row.append
    backward_local: list[int] = []  # local stage of each backward, in order (for W)
    w_done = 0
    for op in range(total + warmup):
        if op < total:
            v = chunks[op]
            append(base[v] + (next_f[v] + 1) * unit)  # F is kind 0
            next_f[v] += 1
        if op >= warmup:
            v = V - 1 - chunks[op - warmup]
            append(base[v] + (next_b[v] + 1) * unit + back_kind)
            next_b[v] += 1
            if zero_bubble:
                backward_local.append(v)
                if op - warmup >= delay_w:
                    v = backward_local[w_done]
                    append(base[v] + (next_w[v] + 1) * unit + W)
                    next_w[v] += 1
                    w_done += 1
    while w_done < len(backward_local):
        v = backward_local[w_done]
        append(base[v] + (next_w[v] + 1) * unit + W)
        next_w[v] += 1
        w_done += 1
    return row


def build_interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int,
                           group_size: int | None = None) -> Schedule:
    R, m, V = num_ranks, num_microbatches, stages_per_rank
    N = check_group_size("interleaved_1f1b", R, m, group_size)
    codes = [_interleaved_rank(r, R, V, m, 2, False, N) for r in range(R)]
    return Schedule.from_codes(codes, Topology.loop(R, R * V, m), "interleaved_1f1b")


def build_interleaved_zb(num_ranks: int, num_microbatches: int, stages_per_rank: int,
                         group_size: int | None = None) -> Schedule:
    R, m, V = num_ranks, num_microbatches, stages_per_rank
    N = check_group_size("interleaved_zb", R, m, group_size)
    codes = [_interleaved_rank(r, R, V, m, 1, True, N) for r in range(R)]
    return Schedule.from_codes(codes, Topology.loop(R, R * V, m), "interleaved_zb")


def build_looped_bfs(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    R, m, V = num_ranks, num_microbatches, stages_per_rank
    codes = []
    for r in range(R):
        stages = range(r, R * V, R)
        row = [code(s, F, mb) for s in stages for mb in range(m)]
        row += [code(s, B, mb) for s in reversed(stages) for mb in reversed(range(m))]
        codes.append(row)
    return Schedule.from_codes(codes, Topology.loop(R, R * V, m), "looped_bfs")
