"""V-Half and V-Min: the V-shaped schedules of "Pipeline Parallelism with Controllable Memory"
(Qi, Wan, Amar, Lin; NeurIPS 2024), rank r holding stages r and 2R-1-r as in ZB-V.

Each rank repeats one building block every 6 time slots (F, I and W of both stages, one slot
each): microbatch k's forward on stage r runs at slot offset + 6k, and so on. The offsets set the
block's lifespan, and the lifespan the activation memory: about half of 1F1B's for V-Half,
(R + 2) // 2 microbatches in the paper's units, and a third for V-Min, (R + 4) // 3. A W takes
the first free slot after its I. A rank runs its actions in slot order; the simulator squeezes
out the empty slots.
"""

from ..schedule import Schedule
from ..topology import Topology
from ._codes import F, I, W, code

PERIOD = 6


def _offsets_v_min(R: int, r: int) -> tuple[int, int, int, int]:
    gap = 2 if R % 3 == 0 else 0
    return r, 2 * R - r - 1, 2 * R + gap + r, 4 * R + gap - r - 1


def _offsets_v_half(R: int, r: int) -> tuple[int, int, int, int]:
    gap = 3 if R % 2 == 0 else 0
    return 2 * r, 3 * R - r - 2, 3 * R + gap + 2 * r - 1, 6 * R + gap - r - 2


def _build(R: int, m: int, offsets, name: str) -> Schedule:
    codes = []
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
        # each W in the first free slot after its I, in the order the I's ran
        pending, row, t = [], [], 0
        last = max(slots)
        while t <= last or pending:
            c = slots.get(t)
            if c is None:
                if pending:
                    row.append(pending.pop(0))
            else:
                row.append(c)
                if c & 0xF == I:
                    pending.append(c - I + W)
            t += 1
        codes.append(row)
    return Schedule._from_codes(codes, Topology.v(R, 2 * R, m), name)


def build_v_half(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    return _build(num_ranks, num_microbatches, _offsets_v_half, "v_half")


def build_v_min(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    return _build(num_ranks, num_microbatches, _offsets_v_min, "v_min")
