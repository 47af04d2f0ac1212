"""Traces of real steps: gather them from every rank, export Chrome/Perfetto JSON, draw them."""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch.distributed as dist

from pipecore.schedule.output import writable
from pipecore.tools.picture import draw, kind_of, lanes_from_simulation, lanes_from_trace


def gather_trace(pipe) -> list[dict]:
    """Every rank's events of the last step (all ranks call it; all get the full list)."""
    mine = pipe.trace()
    if pipe.world == 1:
        return mine
    boxes: list = [None] * pipe.world
    dist.all_gather_object(boxes, mine, group=pipe.group)
    return [e for box in boxes for e in box]


_ROWS = ("actions", "OVERLAP_F_B pairs", "overlapped backward halves")


def to_chrome_trace(events: Sequence[dict], path: str | None = None) -> dict:
    """Chrome/Perfetto trace JSON ("X" events), one row (pid) per rank; written to `path` if given."""
    t0 = min((e["start_us"] for e in events), default=0.0)
    out = []
    for rank in sorted({e["rank"] for e in events}):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for tid, row in enumerate(_ROWS):
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": row}})
    for e in events:
        name = e["name"]
        # rows: actions, OVERLAP_F_B containers, the backward halves that ran beside their forward
        tid = 1 if name.endswith("OVERLAP_F_B") else 2 if e.get("lane", 0) == 1 else 0
        out.append({"ph": "X", "name": name, "cat": kind_of(name), "pid": e["rank"], "tid": tid,
                    "ts": e["start_us"] - t0, "dur": max(e["end_us"] - e["start_us"], 0.001),
                    "args": {"step": e.get("step")}})
    trace = {"traceEvents": out, "displayTimeUnit": "ms"}
    if path is not None:
        with open(writable(path), "w") as f:
            json.dump(trace, f)
    return trace


def draw_trace(events: Sequence[dict], path: str, schedule=None, costs=None) -> str:
    """Timeline picture of a measured step; with `schedule`, its simulation above it."""
    panels = []
    if schedule is not None:
        result = schedule.simulate(costs)
        panels.append((f"{schedule.name}: simulated (makespan {result.makespan:.3g})", lanes_from_simulation(result)))
    lanes = lanes_from_trace(events)
    span = max((e for lane in lanes for _, _, e in lane), default=0.0)
    panels.append((f"measured step ({span:.2f} ms)", lanes))
    return draw(panels, path, unit="ms (measured) / cost units (simulated)" if schedule else "ms")
