"""Cost-model simulator.

Each rank runs its actions in order; an action starts when its rank is free and its inputs are
there (pipecore/schedule/readiness.py): the producer's end, plus `comm` when the producer is on
another rank. Communication actions of a lowered schedule take no rank time (their latency is the
`comm` cost).
"""

from __future__ import annotations

import math

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipecore.schedule.action import COMPUTE_KINDS, KIND_MASK, Action, Kind, decode, leaf_codes
from pipecore.schedule.errors import ScheduleError
from pipecore.schedule.readiness import replay

F, I, W, B = int(Kind.F), int(Kind.I), int(Kind.W), int(Kind.B)
OVERLAP = int(Kind.OVERLAP_F_B)
_EXTRA_KINDS = {int(Kind.REDUCE_GRAD): "REDUCE_GRAD", int(Kind.UNSHARD): "UNSHARD", int(Kind.RESHARD): "RESHARD"}
# how the executor runs an OVERLAP_F_B pair's halves (Pipeline's `overlap_f_b`), its default first
OVERLAP_MODES = ("lockstep", "concurrent", "sequential")
_COST_KEYS = ("F", "B", "I", "W", "comm", "OVERLAP_F_B", "REDUCE_GRAD", "UNSHARD", "RESHARD")
_PER_MICROBATCH = ("F", "B", "I", "W")  # costs the simulator takes as functions of (stage, microbatch)


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


def cost_table(costs: Mapping[str, object] | None, num_stages: int,
               per_microbatch: bool = False) -> dict[str, list]:
    """Each cost as one number per stage. With `per_microbatch` (the simulator), F, B, I and W may
    also be functions of (stage, microbatch), for microbatches of their own lengths; then all four
    come back as such functions."""
    costs = dict(costs or {})
    unknown = set(costs) - set(_COST_KEYS)
    if unknown:
        raise ValueError(f"unknown cost keys {sorted(unknown)}; use {_COST_KEYS}")

    def per_stage(name, value):
        if per_microbatch and name in _PER_MICROBATCH and callable(value):
            return value
        if isinstance(value, (int, float)):
            vals = [float(value)] * num_stages
        elif isinstance(value, Sequence) and len(value) == num_stages:
            vals = [float(v) for v in value]
        else:
            functions = " or a function of (stage, microbatch)" if per_microbatch and name in _PER_MICROBATCH else ""
            raise ValueError(f"cost {name!r} must be a number or one number per stage ({num_stages}){functions}, "
                             f"got {value!r}")
        if not all(math.isfinite(v) and v >= 0 for v in vals):
            raise ValueError(f"cost {name!r} must be finite and not negative, got {value!r}")
        return vals

    table = {k: per_stage(k, v) for k, v in costs.items() if k != "OVERLAP_F_B"}
    if any(callable(table.get(k)) for k in _PER_MICROBATCH):
        _per_microbatch_table(table)
    else:
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
                raise ValueError(f"cost 'I' ({costs['I']!r}) exceeds 'B' ({costs['B']!r}), so W = B - I would be "
                                 f"negative: give W, or a B of at least I")
            table["W"] = [b - i for b, i in zip(table["B"], table["I"])]
    for k in ("comm", "REDUCE_GRAD", "UNSHARD", "RESHARD"):
        table.setdefault(k, [0.0] * num_stages)
    if "OVERLAP_F_B" in costs:
        v = costs["OVERLAP_F_B"]
        if not callable(v):
            raise ValueError("cost 'OVERLAP_F_B' must be a function of (forward cost, backward cost)")
        table["OVERLAP_F_B"] = v  # type: ignore[assignment]
    return table


def _per_microbatch_table(table: dict) -> None:
    """F, B, I and W as checked functions of (stage, microbatch), derived as cost_table derives
    numbers: B = I + W (or 2 F), I = B / 2, W = B - I."""
    def checked(name, fn):
        def cost(stage, microbatch):
            v = fn(stage, microbatch)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"cost {name!r} of stage {stage}, microbatch {microbatch} must be a finite number, "
                                 f"not negative, got {v!r}")
            return float(v)
        return cost

    def function(v):
        return v if callable(v) else (lambda stage, microbatch: v[stage])

    given = {k: checked(k, function(table[k])) for k in _PER_MICROBATCH if k in table}
    f = given.get("F", lambda stage, microbatch: 1.0)
    i, w = given.get("I"), given.get("W")
    b = given.get("B") or (checked("B", lambda s, k: (i or w)(s, k) + (w or i)(s, k)) if i or w
                           else (lambda s, k: 2 * f(s, k)))
    i = i or (lambda s, k: b(s, k) / 2)
    w = w or checked("W (B - I)", lambda s, k: b(s, k) - i(s, k))
    table.update(F=f, B=b, I=i, W=w)


def simulate(schedule, costs: Mapping[str, object] | None = None, overlap: str = "lockstep") -> SimResult:
    """`overlap`: how the executor runs an OVERLAP_F_B pair's halves (Pipeline's `overlap_f_b`,
    default "lockstep"): "concurrent", at once, costs the longer half; "lockstep" and "sequential"
    cost the sum (lockstep hides communication inside a stage, which these costs do not model). A
    callable cost "OVERLAP_F_B"(forward, backward) prices pairs instead. F, B, I and W may be
    functions of (stage, microbatch): microbatches of their own lengths (`step_microbatches`)."""
    if overlap not in OVERLAP_MODES:
        raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {overlap!r}")
    topo = schedule.topology
    codes = schedule.codes
    num_ranks = len(codes)
    cost = cost_table(costs, topo.num_stages, per_microbatch=True)
    by_kind = {F: cost["F"], I: cost["I"], W: cost["W"], B: cost["B"]}
    by_kind.update({kind: cost[name] for kind, name in _EXTRA_KINDS.items()})
    pair = cost.get("OVERLAP_F_B") or (max if overlap == "concurrent" else None)
    busy = [0.0] * num_ranks
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(num_ranks)]

    def record(r: int, c: int, start: float, end: float) -> None:
        # sends and receives take no rank time (their latency is `comm`): not in the timeline
        if end > start or c & KIND_MASK in COMPUTE_KINDS:
            timeline[r].append((decode(c), start, end))
            busy[r] += end - start

    run = replay(codes, topo, cost=by_kind, pair=pair, comm=cost["comm"], on_action=record)
    if run.stuck(codes):
        schedule.validate()  # raises the detailed error
        raise ScheduleError(f"simulation stuck on ranks {run.stuck(codes)}")  # pragma: no cover
    makespan = max(run.clock, default=0.0)
    total = makespan * num_ranks
    bubble = 1.0 - sum(busy) / total if total > 0 else 0.0
    return SimResult(makespan, bubble, busy, peak_activations(codes), timeline)


def peak_activations(codes: list[list[int]]) -> list[int]:
    """Per rank, the most forward activations alive at once: a forward's activations live until
    its stage's B (or W, the last part of a split backward); without a backward, until it ends."""
    training = any((c & KIND_MASK) in (I, W, B, OVERLAP) for row in codes for c in row)
    peaks = []
    for row in codes:
        live = peak = 0
        for c in row:
            for lc in (leaf_codes(c) if c & KIND_MASK == OVERLAP else (c,)):
                kind = lc & KIND_MASK
                if kind == F:
                    live += 1
                    peak = max(peak, live)
                    if not training:
                        live -= 1
                elif kind == B or kind == W:
                    live -= 1
        peaks.append(peak)
    return peaks
