"""Interleaved schedules over loop placement (stage s on rank s % R, V stages per rank):
Megatron's interleaved 1F1B (depth first), its zero-bubble form (ZB-H1 for V=1: backward split
into I and W, W fills the bubbles), and looped BFS (breadth first)."""

from ..schedule import Schedule
from ..topology import Topology
from ..action import MB_SHIFT, STAGE_SHIFT
from ._codes import B, F, I, W, code


def rounds(num_ranks: int, num_microbatches: int) -> int:
    return max(1, num_microbatches // num_ranks)


def _interleaved_rank(rank, R, V, m, warmup_factor, zero_bubble):
    per_round = m // rounds(R, m)
    total = V * m
    warmup = min((V - 1) * per_round + warmup_factor * (R - 1 - rank), total)
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
            v = (op // per_round) % V
            append(base[v] + (next_f[v] + 1) * unit)  # F is kind 0
            next_f[v] += 1
        if op >= warmup:
            v = V - 1 - ((op - warmup) // per_round) % V
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


def _check_rounds(name, R, m):
    n = rounds(R, m)
    if m % n:
        lower, upper = (m // n) * n, (m // n + 1) * n
        raise ValueError(
            f"{name} needs the number of microbatches to be a multiple of the number of rounds "
            f"max(1, microbatches // ranks) = {n}; got {m} microbatches on {R} ranks "
            f"(use e.g. {lower} or {upper})")


def build_interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    R, m, V = num_ranks, num_microbatches, stages_per_rank
    _check_rounds("interleaved_1f1b", R, m)
    codes = [_interleaved_rank(r, R, V, m, 2, False) for r in range(R)]
    return Schedule._from_codes(codes, Topology.loop(R, R * V, m), "interleaved_1f1b")


def build_interleaved_zb(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    R, m, V = num_ranks, num_microbatches, stages_per_rank
    _check_rounds("interleaved_zb", R, m)
    codes = [_interleaved_rank(r, R, V, m, 1, True) for r in range(R)]
    return Schedule._from_codes(codes, Topology.loop(R, R * V, m), "interleaved_zb")


def build_looped_bfs(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    R, m, V = num_ranks, num_microbatches, stages_per_rank
    codes = []
    for r in range(R):
        stages = range(r, R * V, R)
        row = [code(s, F, mb) for s in stages for mb in range(m)]
        row += [code(s, B, mb) for s in reversed(stages) for mb in reversed(range(m))]
        codes.append(row)
    return Schedule._from_codes(codes, Topology.loop(R, R * V, m), "looped_bfs")
