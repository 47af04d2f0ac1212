"""A step whose batch changed to a shape seen before, against a steady step, side by side in one run.

2 gloo ranks, Linear(64) stages, 32 microbatches. Both batch shapes (`--rows` and `--other-rows`
rows) are learnt in warm-up steps. Then blocks alternate: a block of steady steps (the same shape
every step) and a block of changing steps (the two shapes in turn, so every step's shape differs
from the step before). The table gives each one's median step, their ratio, and where the changing
step's extra time would go (`Pipeline.profile()` of traced steps: "before the run" holds telling the
peers, a "shapes changed" run and the agreement where shapes are planned; on gloo messages carry
their shapes, csrc/comm.h, and a step whose batch changed shape runs none of them).

    python bench/shape_change.py [--schedules 1f1b zbv]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _harness  # noqa: F401  (puts the repo on sys.path)
from _harness import spawn, table

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]


def _rank(rank, world, name, m, rows, other_rows, blocks, steps):
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipecore as pc

    V = 1 if name in ("gpipe", "1f1b") else 2
    sched = pc.build_schedule(name, world, m, V)
    torch.manual_seed(0)
    modules = [nn.Linear(64, 64) for _ in range(sched.num_stages)]
    stages = [pc.PipelineStage(modules[s], s, sched.num_stages) for s in sched.rank_stages(rank)]
    first, last = sched.topology.stage_rank[0] == rank, sched.topology.stage_rank[-1] == rank
    batches = [(torch.randn(r, 64), torch.randn(r, 64)) for r in (rows, other_rows)]
    pipes = {trace: pc.Pipeline(stages, sched, m, loss_fn=nn.MSELoss(), trace=trace) for trace in (False, True)}

    def step(pipe, i):
        x, y = batches[i % 2]
        pipe.step(*((x,) if first else ()), target=y if last else None)

    for pipe in pipes.values():  # both shapes learnt
        for i in range(4):
            step(pipe, i)
    times = {"steady": [], "changing": []}
    for _ in range(blocks):
        for kind in times:
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(steps):
                step(pipes[False], 0 if kind == "steady" else i + 1)  # changing: starts on the other shape
            dist.barrier()
            times[kind].append((time.perf_counter() - t0) / steps)
            step(pipes[False], 0)  # both kinds start from the first shape
    profiles = {"steady": [], "changing": []}
    for kind in profiles:
        for i in range(steps):
            step(pipes[True], 0 if kind == "steady" else i + 1)
            profiles[kind].append(pipes[True].profile())
        step(pipes[True], 0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for kind, ps in profiles.items():
        for part in ("before_run", "run", "after_run"):
            med[f"{kind} {part}"] = statistics.median(p[part] for p in ps) / 1e3
    return med


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="*", default=SCHEDULES, choices=SCHEDULES)
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--other-rows", type=int, default=48)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="steps per timed block")
    a = ap.parse_args(argv)
    rows = []
    for name in a.schedules:
        per_rank = spawn(_rank, 2, name, a.microbatches, a.rows, a.other_rows, a.blocks, a.steps)
        r = max(per_rank, key=lambda p: p["changing"])
        rows.append([name, r["steady"], r["changing"], f"{r['changing'] / r['steady']:.2f}x",
                     r["steady before_run"], r["changing before_run"], r["steady run"], r["changing run"]])
    title = (f"2 gloo ranks, Linear(64) stages, {a.microbatches} microbatches, batches of {a.rows} and "
             f"{a.other_rows} rows (both seen before); median of {a.blocks} alternating blocks of {a.steps} steps; "
             "before-run and run ms: traced steps (Pipeline.profile), slowest rank")
    print(table(["schedule", "steady ms", "changing ms", "changing/steady", "steady before-run", "changing before-run",
                 "steady run", "changing run"], rows, title))


if __name__ == "__main__":
    main()
