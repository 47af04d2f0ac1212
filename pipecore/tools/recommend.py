"""Compare schedules under given costs and recommend one: costs typed in, or measured in a trace
of a real step (`Pipeline(trace=True)`, `pipecore.tools.profiling.to_chrome_trace`).

Costs are per model stage: a number is the cost of one rank's share of the model (a stage of
1F1B); a list holds one value per stage of a model cut into that many equal stages (the chain a
loop or V placement runs, in order; a trace's stages). A schedule with another number of stages
gets them resampled: each of its stages costs its share of the layers (two stages per measured
one split it in halves, one per two measured ones adds them); comm is per message. Memory is
compared as a fraction of 1F1B's activations: the busiest rank's peak activations times the
share of the model a stage holds, 1.0 being 1F1B's rank 0.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pipecore.schedule.builders import SCHEDULES, build_schedule, default_stages_per_rank
from pipecore.schedule.simulate import cost_table, peak_activations, simulate

_ACTION = re.compile(r"(?:^|:)(\d+)([FIWB])(\d+)$")
_KINDS = ("F", "I", "W", "B")


def costs_from_trace(events: Iterable[Mapping], unit: float = 1e-3,
                     model_stage: Sequence[int] | None = None) -> dict[str, list[float]]:
    """Median duration per kind (F, I, W, B) and model stage of a traced step, in ms (`unit` per us).

    `events`: a `Pipeline.trace()` / `gather_trace()` list (name, start_us, end_us) or the
    "traceEvents" of `to_chrome_trace` (name, ts, dur). Communication and OVERLAP_F_B pairs are
    left out. `model_stage[s]`: the model stage the traced schedule's stage s computes (its
    topology's; dualpipe's stages R..2R-1 mirror 0..R-1); by default stage s is model stage s.
    With split backwards in the trace the result has F, I and W (a stage that ran B, merged, gets
    its B split in the measured stages' I : W ratio), else F and B."""
    samples: dict[tuple[str, int], list[float]] = {}
    for e in events:
        if not isinstance(e, Mapping):
            raise ValueError(f"trace events are objects with a name and times, got {e!r}")
        name = str(e.get("name", ""))
        match = _ACTION.search(name)
        if not match or name.endswith("OVERLAP_F_B") or e.get("lane", 0) == 1 or e.get("tid") == 2:
            continue
        if "dur" in e:
            dur = float(e["dur"])
        elif "end_us" in e and "start_us" in e:
            dur = float(e["end_us"]) - float(e["start_us"])
        else:
            continue
        stage = int(match.group(1))
        if model_stage is not None:
            if stage >= len(model_stage):
                raise ValueError(f"the trace has stage {stage}; the traced schedule has {len(model_stage)} stages")
            stage = model_stage[stage]
        samples.setdefault((match.group(2), stage), []).append(dur * unit)
    if not samples:
        raise ValueError("the trace has no F/I/W/B action with a duration (dur, or start_us and end_us): "
                         "record a training step with Pipeline(trace=True) and export it with to_chrome_trace")
    if not any(kind in ("I", "W", "B") for kind, _ in samples):
        raise ValueError("the trace has forwards only: trace a training step (pipe.step), not eval")
    stages = max(s for _, s in samples) + 1
    median = {key: statistics.median(v) for key, v in samples.items()}
    split = [s for s in range(stages) if ("I", s) in median and ("W", s) in median]
    if split:
        # a stage whose I and W ran merged (no other rank waits for its I, so the program runs B):
        # its B split as the measured stages split theirs
        share = statistics.mean(median[("I", s)] / max(median[("I", s)] + median[("W", s)], 1e-30) for s in split)
        for s in range(stages):
            if ("B", s) in median and s not in split:
                median.setdefault(("I", s), median[("B", s)] * share)
                median.setdefault(("W", s), median[("B", s)] * (1 - share))
    costs = {}
    for kind in (("F", "I", "W") if split else ("F", "B")):
        missing = [s for s in range(stages) if (kind, s) not in median]
        if missing:
            raise ValueError(f"the trace has no {kind} for stages {missing}: trace a whole training step of every "
                             f"rank (gather_trace)")
        costs[kind] = [median[(kind, s)] for s in range(stages)]
    return costs


def traced_model_stages(name: str, num_ranks: int) -> list[int]:
    """The model stage of each stage of schedule `name` (at its default stages per rank) on
    `num_ranks` ranks, for `costs_from_trace`."""
    for m in (2 * num_ranks, 4 * num_ranks, 8 * num_ranks):
        try:
            return list(build_schedule(name, num_ranks, m).topology.model_stage)
        except ValueError:
            continue
    raise ValueError(f"{name} does not build on {num_ranks} ranks")


def load_trace(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: expected a Chrome trace (traceEvents) or a list of Pipeline.trace() events")
    return [e for e in events if not isinstance(e, Mapping) or e.get("ph", "X") == "X"]


def resample(values: Sequence[float], n: int) -> list[float]:
    """`values` (per piece of a model cut in len(values) equal pieces) for the same model cut in
    n equal pieces: each new piece costs the overlap-weighted sum of the old ones."""
    k = len(values)
    if k == n:
        return list(values)
    out = []
    for j in range(n):
        lo, hi = j / n, (j + 1) / n
        total = 0.0
        for i, v in enumerate(values):
            overlap = min(hi, (i + 1) / k) - max(lo, i / k)
            if overlap > 0:
                total += v * overlap * k
        out.append(total)
    return out


def stage_costs(model_stage: Sequence[int], costs: Mapping[str, object]) -> dict[str, object]:
    """`costs` (numbers, or lists per model stage of any length) for the stages of a schedule
    whose stage s computes model stage `model_stage[s]` (its topology's)."""
    count = max(model_stage) + 1 if model_stage else 0
    out = {}
    for key, value in costs.items():
        if isinstance(value, Sequence) and not isinstance(value, str):
            per_model = resample([float(v) for v in value], count)
            out[key] = [per_model[ms] for ms in model_stage]
        else:
            out[key] = value
    return out


def per_rank_costs(costs: Mapping[str, object] | None, num_ranks: int) -> dict[str, object]:
    """A number is the cost of one rank's share of the model (a stage of 1F1B): one per rank.
    comm is per message and stays a number."""
    return {k: (v if k == "comm" or not isinstance(v, (int, float)) else [v] * num_ranks)
            for k, v in (costs or {}).items()}


def memory_limit(memory: float, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> int:
    """zb_auto's memory_limit (activations of a stage) for `memory` x 1F1B's (inf: all of them)."""
    everything = num_microbatches * stages_per_rank
    return max(stages_per_rank, min(everything, int(min(memory * num_ranks, everything) * stages_per_rank + 1e-9)))


@dataclass(frozen=True)
class Candidate:
    name: str
    stages_per_rank: int
    makespan: float
    bubble_ratio: float
    memory: float  # peak activations of the busiest rank, as a fraction of 1F1B's
    fits: bool  # memory within the limit compared at


def _stage_counts(name: str) -> tuple[int, ...]:
    """Stages per rank a schedule is compared at: its default; ZB-H1 and zb_auto at 1 and 2."""
    return (1, 2) if name in ("interleaved_zb", "zb_auto") else (default_stages_per_rank(name),)


def compare(num_ranks: int, num_microbatches: int, costs: Mapping[str, object] | None = None,
            memory: float = 1.0, names: Sequence[str] | None = None) -> list[Candidate]:
    """Every schedule of `names` (default: all but forward_only) that builds for these ranks and
    microbatches, zb_auto built for `costs` within `memory` (a fraction of 1F1B's activations);
    those within `memory` first, fastest first."""
    if not (isinstance(memory, (int, float)) and memory > 0):  # inf: no limit
        raise ValueError(f"memory is a fraction of 1F1B's activation memory (1.0: 1F1B's), got {memory!r}")
    R, m = num_ranks, num_microbatches
    for label, value in (("num_ranks", R), ("num_microbatches", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if not isinstance((costs or {}).get("comm", 0), (int, float)):
        raise ValueError("comm is the cost of one message: one number")
    costs = per_rank_costs(costs, R)
    cost_table(stage_costs(range(R), costs), R)  # bad costs: said here, not as schedules left out
    rows = []
    for name in names or [n for n in SCHEDULES if n != "forward_only"]:
        for V in _stage_counts(name):
            try:
                if name == "zb_auto":
                    mine = stage_costs(range(R * V), costs)  # loop or V: stage s is model stage s
                    sched = build_schedule(name, R, m, V, costs=mine, memory_limit=memory_limit(memory, R, V, m))
                else:
                    sched = build_schedule(name, R, m, V)
                    mine = stage_costs(sched.topology.model_stage, costs)
            except ValueError:
                continue
            result = simulate(sched, mine)
            # a stage holds 1 / (model stages) of the model's activations; 1F1B's rank 0 holds R / R
            peak = max(peak_activations(sched.codes)) / (max(sched.topology.model_stage) + 1)
            rows.append(Candidate(name, V, result.makespan, result.bubble_ratio, peak, peak <= memory + 1e-9))
    rows.sort(key=lambda c: (not c.fits, c.makespan, c.memory))
    return rows
