"""Zero-bubble schedules keep their bubble: step time of the program pipecore runs against the one it
ran before, side by side in one run (alternating blocks).

Before, `Schedule.lower()` merged every I directly followed by its W into one B, so the input
gradient left only after the weight gradient: zbv, dualpipe and dualpipev place I right before W
exactly where that gradient is on the critical path. Now I, SEND_B, W stay apart wherever another
rank waits for the gradient (and merge elsewhere, where nothing waits).

Compute per stage and microbatch:
  sleep   F, I and W of fixed durations that release the CPU (default; ranks can outnumber cores).
          The stage is an autograd Function whose backward sleeps for I and hands a W-long sleep to
          pipecore.defer_weight_grad, the way a fused layer keeps its weight gradient for W.
  matmul  real Linear layers (pipecore splits their autograd graph); use as many ranks as cores.

Next to the measurement, the simulator's prediction for both programs, priced with the F, I and W
times traced on these ranks during the run (median per kind; B as I + W; no latency), and what one
microbatch's backward of a stage with inputs took in each (I + W, or B; median): the split's own cost.

    python bench/zero_bubble.py [--schedules zbv dualpipev] [--ranks 4] [--microbatches 8] [--ms 4]
    python bench/zero_bubble.py --compute matmul --ranks 2 --width 512 --rows 512 [--depth 8]
"""

from __future__ import annotations

import argparse
import statistics

import _harness  # noqa: F401
from _harness import bar_plot, median_ms, spawn, table, timed_blocks

PROGRAMS = {"now": "I, SEND_B, W", "merged": "I+W merged (before)"}


def merged_program(sched):
    """The lowering before the fix: every adjacent I+W of the schedule merged into one B."""
    from pipecore import Schedule
    from pipecore.schedule.lowering import merge_adjacent_iw

    codes = [merge_adjacent_iw(row, keep_split=frozenset()) for row in sched.compute_only().codes]
    return Schedule.from_codes(codes, sched.topology, sched.name).lower(merge_iw=False)


def _rank(rank, world, name, m, compute, ms, width, rows, depth, blocks, steps):
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    import pipecore as pc

    class SleepStage(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            time.sleep(ms[0] / 1e3)
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            time.sleep(ms[1] / 1e3)
            pc.defer_weight_grad(lambda: time.sleep(ms[2] / 1e3))
            return g * 1.0, None

    class Sleeper(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return SleepStage.apply(x, self.w)

    def block():
        if compute == "sleep":
            return Sleeper()
        return nn.Sequential(*[layer for _ in range(depth)
                               for layer in (nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))])

    sched = pc.build_schedule(name, world, m)
    torch.manual_seed(0)
    modules = {s: block() for s in sched.rank_stages(rank)}
    pipes = {}
    for key in PROGRAMS:
        stages = [pc.PipelineStage(modules[s], s, sched.num_stages) for s in sched.rank_stages(rank)]
        pipes[key] = pc.Pipeline(stages, sched, m, loss_fn=lambda out: out.float().pow(2).mean(), timeout=120)
    from pipecore.executor.program import encode

    merged = pipes["merged"]
    merged.programs[True] = encode(merged_program(sched), rank, {s.stage_index: i for i, s in enumerate(merged.stages)})
    x = torch.randn(rows, width)

    def runner(pipe):
        def run():
            pipe.step(*((x,) if pipe.has_first else ()))
            for mod in modules.values():
                mod.zero_grad(set_to_none=True)
        return run

    runners = {k: runner(p) for k, p in pipes.items()}
    for run in runners.values():  # warm up: plans, connections, allocator
        run()
    times = timed_blocks(runners, blocks, steps, dist.barrier)
    # one traced step of each program: what F, I and W cost here, and a backward per microbatch
    durations = {"F": [], "I": [], "W": []}
    backward_ms = {}
    for key, pipe in pipes.items():
        pipe.executor.set_trace(True)
        pipe.trace_enabled = True
        runners[key]()
        per_microbatch = {}  # (stage, microbatch) -> its I + W, or its B (stages with inputs only)
        for e in pipe.trace():
            action = pc.Action.parse(e["name"][3:])  # "PP:1I0"
            ms_taken = (e["end_us"] - e["start_us"]) / 1e3
            if key == "now" and action.kind.name in durations:
                durations[action.kind.name].append(ms_taken)
            if action.kind.name in ("I", "W", "B") and sched.topology.prev_stage[action.stage] >= 0:
                slot = (action.stage, action.microbatch)
                per_microbatch[slot] = per_microbatch.get(slot, 0.0) + ms_taken
        backward_ms[key] = list(per_microbatch.values())
    return {k: median_ms(v) for k, v in times.items()}, durations, backward_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="+", default=["zbv", "dualpipev"])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--compute", choices=["sleep", "matmul"], default="sleep")
    ap.add_argument("--ms", type=float, nargs=3, default=[4.0, 4.0, 4.0], metavar=("F", "I", "W"),
                    help="sleep compute: milliseconds of F, I and W")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rows", type=int, default=256, help="rows of the whole batch")
    ap.add_argument("--depth", type=int, default=1, help="matmul compute: Linear-GELU-Linear blocks per stage")
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--plot", help="write a bar chart (.png)")
    args = ap.parse_args()

    import pipecore as pc

    rows, labels, series = [], [], {v: [] for v in PROGRAMS.values()}
    for name in args.schedules:
        sched = pc.build_schedule(name, args.ranks, args.microbatches)
        per_rank = spawn(_rank, args.ranks, name, args.microbatches, args.compute, args.ms, args.width, args.rows,
                         args.depth, args.blocks, args.steps)
        measured = {k: max(r[0][k] for r in per_rank) for k in PROGRAMS}  # the step ends on the slowest rank
        costs = {k: statistics.median(d for r in per_rank for d in r[1][k]) for k in ("F", "I", "W")}
        predicted = {"now": sched.lower().simulate(costs).makespan,
                     "merged": merged_program(sched).simulate(costs).makespan}
        backward = {k: statistics.median(d for r in per_rank for d in r[2][k]) for k in PROGRAMS}
        for key, label in PROGRAMS.items():
            rows.append([name, label, measured[key], measured[key] / measured["merged"], predicted[key],
                         predicted[key] / predicted["merged"], backward[key]])
            series[label].append(measured[key])
        labels.append(name)
    compute = (f"sleeping F/I/W {args.ms[0]:g}/{args.ms[1]:g}/{args.ms[2]:g} ms" if args.compute == "sleep"
               else f"{args.depth} x Linear-GELU-Linear({args.width}), {args.rows} rows")
    title = (f"zero-bubble programs, {args.ranks} gloo ranks, {args.microbatches} microbatches, {compute} "
             f"(median of {args.blocks} alternating blocks of {args.steps} steps)")
    print(table(["schedule", "program", "step ms", "x merged", "simulated ms", "simulated x merged",
                 "backward ms (I+W or B)"], rows, title))
    if args.plot:
        bar_plot(args.plot, labels, series, "step time (ms)", title)


if __name__ == "__main__":
    main()
