"""V-Half and V-Min: the V-shaped schedules of "Pipeline Parallelism with Controllable Memory"
(Qi, Wan, Amar, Lin; NeurIPS 2024), rank r holding stages r and 2R-1-r as in ZB-V.

Each rank repeats one building block every 6 time slots (F, I and W of both stages, one slot
each): microbatch k's forward on stage r runs at slot offset + 6k, and so on. The offsets set the
block's lifespan, and the lifespan the activation memory: about half of 1F1B's for V-Half,
(R + 2) // 2 microbatches in the paper's units, and a third for V-Min, (R + 4) // 3. A W takes
the first free slot after its I. Then, as the paper does, the warm-up (until rank 0's first
backward of stage 0) and the cool-down (after the last microbatch's first forward) are reordered:
each action moves to the earliest free slot after its inputs where it keeps every rank within
the block's peak memory; then the cool-down's backwards move up once more without their W, and
the W go back into the free slots. A rank runs its actions in slot order; the simulator squeezes
out the empty slots. The makespans equal those of the authors' generator at the tested points
(4, 8 and 16 ranks, 4 microbatches per rank; tests/test_auto_schedules.py).
"""

from pipecore.schedule.schedule import Schedule
from pipecore.schedule.topology import Topology
from pipecore.schedule.action import KIND_MASK, MB_SHIFT, stage_of
from pipecore.schedule.simulate import peak_activations
from pipecore.schedule.readiness import inputs
from pipecore.schedule.builders._codes import F, I, W, code

PERIOD = 6


def _offsets_v_min(R: int, r: int) -> tuple[int, int, int, int]:
    gap = 2 if R % 3 == 0 else 0
    return r, 2 * R - r - 1, 2 * R + gap + r, 4 * R + gap - r - 1


def _offsets_v_half(R: int, r: int) -> tuple[int, int, int, int]:
    gap = 3 if R % 2 == 0 else 0
    return 2 * r, 3 * R - r - 2, 3 * R + gap + 2 * r - 1, 6 * R + gap - r - 2


def _place_w(slots: dict[int, int]) -> None:
    """Each I's W (those not placed yet) in the first free slot after it, in the order of the I's."""
    placed = {c for c in slots.values() if c & KIND_MASK == W}
    pending, t, last = [], 0, max(slots)
    while t <= last or pending:
        c = slots.get(t)
        if c is None:
            if pending:
                slots[t] = pending.pop(0)
        elif c & KIND_MASK == I and c - I + W not in placed:
            pending.append(c - I + W)
        t += 1


def _block_slots(R: int, m: int, offsets) -> list[dict[int, int]]:
    """Per rank, slot -> action code of the repeated block, W in the first free slot after its I."""
    ranks = []
    for r in range(R):
        f0, f1, i1, i0 = offsets(R, r)  # slots of: forward on r, forward on 2R-1-r, their backwards
        down, up = r, 2 * R - 1 - r
        slots = {}
        for k in range(m):
            base = PERIOD * k
            slots[f0 + base] = code(down, F, k)
            slots[f1 + base] = code(up, F, k)
            slots[i1 + base] = code(up, I, k)
            slots[i0 + base] = code(down, I, k)
        _place_w(slots)
        ranks.append(slots)
    return ranks


def _reorder(ranks: list[dict[int, int]], topo: Topology, m: int) -> None:
    """Move warm-up and cool-down actions to the earliest free slot after their inputs that keeps
    each rank's memory (F: +1, W: -1) within the highest peak of any rank."""
    R = len(ranks)
    srank = topo.stage_rank
    at: dict[int, int] = {c: t for slots in ranks for t, c in slots.items()}
    horizon = max(at.values()) + 2
    memory = []
    for slots in ranks:
        level, row = 0, [0] * horizon  # memory held after each slot
        for t in range(horizon):
            c = slots.get(t)
            if c is not None and c & KIND_MASK in (F, W):
                level += 1 if c & KIND_MASK == F else -1
            row[t] = level
        memory.append(row)
    peak = max(max(row) for row in memory)
    one = 1 << MB_SHIFT

    def after(c):  # the rule's inputs, and the stage's previous microbatch of the same kind
        k = (c >> MB_SHIFT) - 1
        return inputs(c, topo, grad=I) + ((c - one,) if k > 0 else ())

    warmup_end = at[code(0, I, 0)]  # rank 0's first backward of stage 0
    cooldown_start = _cooldown_start(at, R, m)
    moving = [(c, t) for c, t in at.items() if not warmup_end <= t <= cooldown_start]
    for c, old in sorted(moving, key=lambda item: (item[1], srank[stage_of(item[0])])):
        r = srank[stage_of(c)]
        slots, row = ranks[r], memory[r]
        earliest = max((at[d] for d in after(c)), default=-1) + 1
        for t in range(earliest, old):
            if t in slots:
                continue
            if c & KIND_MASK == F and max(row[t:old]) + 1 > peak:
                continue
            del slots[old]
            slots[t] = c
            at[c] = t
            delta = 1 if c & KIND_MASK == F else -1 if c & KIND_MASK == W else 0
            for u in range(t, old):
                row[u] += delta
            break


def _squeeze_cooldown_backwards(ranks: list[dict[int, int]], topo: Topology, m: int) -> None:
    """The paper's second pass: the cool-down's W out, each of its I to the earliest free slot
    after its inputs where the W, put back in the first free slots after their I, keep the rank
    within the highest peak; then the W back in."""
    srank = topo.stage_rank
    at = {c: t for slots in ranks for t, c in slots.items()}
    cooldown_start = _cooldown_start(at, topo.num_ranks, m)
    peak = max(peak_activations([[slots[t] for t in sorted(slots)] for slots in ranks]))
    for slots in ranks:
        for t in [t for t, c in slots.items() if c & KIND_MASK == W and t > cooldown_start]:
            del at[slots.pop(t)]
    at_start = []  # per rank: memory held and W missing at the cool-down's start
    for slots in ranks:
        placed = {c for c in slots.values() if c & KIND_MASK == W}
        early = [c for t, c in slots.items() if t <= cooldown_start]
        at_start.append((sum(1 if c & KIND_MASK == F else -1 if c & KIND_MASK == W else 0 for c in early),
                         sum(c & KIND_MASK == I and c - I + W not in placed for c in early)))
    one = 1 << MB_SHIFT
    moving = [(c, t) for c, t in at.items() if t > cooldown_start and c & KIND_MASK == I]
    for c, old in sorted(moving, key=lambda item: (item[1], srank[stage_of(item[0])])):
        s, k = stage_of(c), (c >> MB_SHIFT) - 1
        deps = inputs(c, topo, grad=I) + ((c - one,) if k > 0 else ())
        r = srank[s]
        slots = ranks[r]
        for t in range(max(max(at[d] for d in deps) + 1, cooldown_start + 1), old):
            if t in slots:
                continue
            del slots[old]
            slots[t] = c
            if _cooldown_peak(slots, cooldown_start, *at_start[r]) <= peak:
                at[c] = t
                break
            del slots[t]
            slots[old] = c
    for slots in ranks:
        _place_w(slots)


def _cooldown_peak(slots: dict[int, int], start: int, level: int, pending: int) -> int:
    """The rank's peak after `start` once the missing W take the first free slots after their I
    (`_place_w` without placing them); `level` and `pending`: memory held and W missing at `start`."""
    peak, t, last = level, start + 1, max(slots)
    while t <= last or pending:
        c = slots.get(t)
        if c is None:
            if pending:
                pending -= 1
                level -= 1
        elif c & KIND_MASK == F:
            level += 1
            peak = max(peak, level)
        elif c & KIND_MASK == I:  # every W of the cool-down is out
            pending += 1
        t += 1
    return peak


def _cooldown_start(at: dict[int, int], R: int, m: int) -> int:
    """The slot of the first forward of the last microbatch (rank 0's, on stage 0)."""
    return min(at[code(s, F, m - 1)] for s in range(R))


def _build(R: int, m: int, offsets, name: str) -> Schedule:
    topo = Topology.v(R, 2 * R, m)
    ranks = _block_slots(R, m, offsets)
    _reorder(ranks, topo, m)
    _squeeze_cooldown_backwards(ranks, topo, m)
    codes = [[slots[t] for t in sorted(slots)] for slots in ranks]
    return Schedule.from_codes(codes, topo, name)


def build_v_half(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    return _build(num_ranks, num_microbatches, _offsets_v_half, "v_half")


def build_v_min(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    return _build(num_ranks, num_microbatches, _offsets_v_min, "v_min")
