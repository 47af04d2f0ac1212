"""Event-driven cost-model simulator.

Each rank runs its actions in order; an action starts when its rank is free and its inputs are
there: the producer's end, plus `comm` when the producer is on another rank. Communication
actions of a lowered schedule take no rank time (their latency is the `comm` cost).
"""

from __future__ import annotations

import math

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipecore.schedule.action import STAGE_MASK, STAGE_SHIFT, Action, Kind, decode, leaf_codes, stage_of
from pipecore.schedule.errors import ScheduleError

F, I, W, B = int(Kind.F), int(Kind.I), int(Kind.W), int(Kind.B)
OVERLAP = int(Kind.OVERLAP_F_B)
_EXTRA_KINDS = {int(Kind.REDUCE_GRAD): "REDUCE_GRAD", int(Kind.UNSHARD): "UNSHARD", int(Kind.RESHARD): "RESHARD"}
# how the executor runs an OVERLAP_F_B pair's halves (Pipeline's `overlap_f_b`), its default first
OVERLAP_MODES = ("lockstep", "concurrent", "sequential")
_COST_KEYS = ("F", "B", "I", "W", "comm", "OVERLAP_F_B", "REDUCE_GRAD", "UNSHARD", "RESHARD")


@dataclass
class SimResult:
    makespan: float
    bubble_ratio: float  # idle share of all ranks' time: 1 - sum(busy) / (ranks * makespan)
    busy: list[float]  # per rank
    peak_activations: list[int]  # per rank: most microbatch-stages whose forward is not yet freed
    timeline: list[list[tuple[Action, float, float]]] = field(repr=False)  # per rank (action, start, end)

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]


def cost_table(costs: Mapping[str, object] | None, num_stages: int) -> dict[str, list[float]]:
    costs = dict(costs or {})
    unknown = set(costs) - set(_COST_KEYS)
    if unknown:
        raise ValueError(f"unknown cost keys {sorted(unknown)}; use {_COST_KEYS}")

    def per_stage(name, value):
        if isinstance(value, (int, float)):
            vals = [float(value)] * num_stages
        elif isinstance(value, Sequence) and len(value) == num_stages:
            vals = [float(v) for v in value]
        else:
            raise ValueError(f"cost {name!r} must be a number or one number per stage ({num_stages}), got {value!r}")
        if not all(math.isfinite(v) and v >= 0 for v in vals):
            raise ValueError(f"cost {name!r} must be finite and not negative, got {value!r}")
        return vals

    table = {k: per_stage(k, v) for k, v in costs.items() if k != "OVERLAP_F_B"}
    table.setdefault("F", [1.0] * num_stages)
    if "B" not in table:
        if "I" in table or "W" in table:
            i = table.get("I") or table["W"]
            w = table.get("W") or table["I"]
            table["B"] = [a + b for a, b in zip(i, w)]
        else:
            table["B"] = [2 * f for f in table["F"]]
    table.setdefault("I", [b / 2 for b in table["B"]])
    if "W" not in table:
        if any(i > b for b, i in zip(table["B"], table["I"])):
            raise ValueError(f"cost 'I' ({costs['I']!r}) exceeds 'B' ({costs['B']!r}), so W = B - I would be negative: "
                             f"give W, or a B of at least I")
        table["W"] = [b - i for b, i in zip(table["B"], table["I"])]
    for k in ("comm", "REDUCE_GRAD", "UNSHARD", "RESHARD"):
        table.setdefault(k, [0.0] * num_stages)
    if "OVERLAP_F_B" in costs:
        v = costs["OVERLAP_F_B"]
        if not callable(v):
            raise ValueError("cost 'OVERLAP_F_B' must be a function of (forward cost, backward cost)")
        table["OVERLAP_F_B"] = v  # type: ignore[assignment]
    return table


def simulate(schedule, costs: Mapping[str, object] | None = None, overlap: str = "lockstep") -> SimResult:
    """`overlap`: how the executor runs an OVERLAP_F_B pair's halves (Pipeline's `overlap_f_b`,
    default "lockstep"): "concurrent", at once, costs the longer half; "lockstep" and "sequential"
    cost the sum (lockstep hides communication inside a stage, which these costs do not model). A
    callable cost "OVERLAP_F_B"(forward, backward) prices pairs instead."""
    if overlap not in OVERLAP_MODES:
        raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {overlap!r}")
    topo = schedule.topology
    codes = schedule.codes
    num_ranks = len(codes)
    cost = cost_table(costs, topo.num_stages)
    by_kind = {F: cost["F"], I: cost["I"], W: cost["W"], B: cost["B"]}
    comm = cost["comm"]
    overlap_fn = cost.get("OVERLAP_F_B") or (max if overlap == "concurrent" else None)
    stage_rank, prev_stage, next_stage = topo.stage_rank, topo.prev_stage, topo.next_stage

    finish: dict[int, float] = {}  # leaf code (or grad-input marker kind 0xF) -> end time
    clock = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    pos = [0] * num_ranks
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(num_ranks)]
    waiting: dict[int, list[int]] = {}
    blocked_on: dict[int, int] = {}
    ready = [r for r in range(num_ranks) if codes[r]]
    while ready:
        r = ready.pop()
        row = codes[r]
        while pos[r] < len(row):
            c = row[pos[r]]
            kind = c & 0xF
            if kind not in (F, I, W, B, OVERLAP):
                name = _EXTRA_KINDS.get(kind)
                dur = cost[name][stage_of(c)] if name else 0.0
                if dur:
                    timeline[r].append((decode(c), clock[r], clock[r] + dur))
                    clock[r] += dur
                    busy[r] += dur
                pos[r] += 1
                continue
            leaves = leaf_codes(c) if kind == OVERLAP else (c,)
            start = clock[r]
            need = -1
            for lc in leaves:
                lk, s = lc & 0xF, stage_of(lc)
                deps = []
                if lk == F:
                    p = prev_stage[s]
                    if p >= 0:
                        deps.append(((lc & ~(STAGE_MASK << STAGE_SHIFT)) | (p << STAGE_SHIFT) | F, stage_rank[p] != r, s))
                elif lk == I or lk == B:
                    deps.append(((lc & ~0xF) | F, False, s))
                    nx = next_stage[s]
                    if nx >= 0:
                        deps.append(((lc & ~(STAGE_MASK << STAGE_SHIFT) & ~0xF) | (nx << STAGE_SHIFT) | 0xF, stage_rank[nx] != r, s))
                elif lk == W:
                    deps.append(((lc & ~0xF) | 0xF, False, s))
                for key, remote, s_ in deps:
                    t = finish.get(key)
                    if t is None:
                        need = key
                        break
                    if remote:
                        t += comm[s_]
                    if t > start:
                        start = t
                if need >= 0:
                    break
            if need >= 0:
                waiting.setdefault(need, []).append(r)
                blocked_on[r] = need
                break
            if kind == OVERLAP:
                parts = [by_kind[lc & 0xF][stage_of(lc)] for lc in leaves]
                fwd = sum(p for p, lc in zip(parts, leaves) if lc & 0xF == F)
                dur = overlap_fn(fwd, sum(parts) - fwd) if overlap_fn else sum(parts)
            else:
                dur = by_kind[kind][stage_of(c)]
            end = start + dur
            timeline[r].append((decode(c), start, end))
            clock[r] = end
            busy[r] += dur
            for lc in leaves:
                marks = (lc, (lc & ~0xF) | 0xF) if (lc & 0xF) in (I, B) else (lc,)
                for m in marks:
                    finish[m] = end
                    if m in waiting:
                        ready.extend(waiting.pop(m))
            pos[r] += 1
    stuck = [r for r in range(num_ranks) if pos[r] < len(codes[r])]
    if stuck:
        schedule.validate()  # raises the detailed error
        raise ScheduleError(f"simulation stuck on ranks {stuck}")  # pragma: no cover
    makespan = max(clock, default=0.0)
    total = makespan * num_ranks
    bubble = 1.0 - sum(busy) / total if total > 0 else 0.0
    return SimResult(makespan, bubble, busy, peak_activations(codes), timeline)


def peak_activations(codes: list[list[int]]) -> list[int]:
    """Per rank, the most forward activations alive at once: a forward's activations live until
    its stage's B (or W, the last part of a split backward); without a backward, until it ends."""
    training = any((c & 0xF) in (I, W, B, OVERLAP) for row in codes for c in row)
    peaks = []
    for row in codes:
        live = peak = 0
        for c in row:
            for lc in (leaf_codes(c) if c & 0xF == OVERLAP else (c,)):
                kind = lc & 0xF
                if kind == F:
                    live += 1
                    peak = max(peak, live)
                    if not training:
                        live -= 1
                elif kind == B or kind == W:
                    live -= 1
        peaks.append(peak)
    return peaks
