"""Schedule build + lowering time: pipecore against torch.distributed.pipelining's constructors.

Prints one table row per (schedule, ranks, stages per rank, microbatches): the median time of
pipecore's build_schedule + lower(), torch's builder + lowering passes (the work its schedule
constructors do), and the ratio, measured in one run. Usage:

    python bench/build.py                       # headline sizes
    python bench/build.py --ranks 64 --microbatches 1024 --schedules interleaved_1f1b
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pipecore as pc  # noqa: E402
from pipecore.schedule.builders import default_stages_per_rank, takes_stages_per_rank  # noqa: E402
from torch_schedules import TORCH_CLASSES, torch_build, torch_lower  # noqa: E402


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(schedules, ranks_list, micro_list, stages_per_rank, repeats, torch_budget_s, with_torch=True):
    rows = []
    for name in schedules:
        for R in ranks_list:
            for m in micro_list:
                # --stages-per-rank where the schedule takes it, else its default
                V = stages_per_rank if takes_stages_per_rank(name, stages_per_rank) else default_stages_per_rank(name)
                try:
                    pc.build_schedule(name, R, m, V)
                except ValueError as exc:
                    print(f"skip {name} R={R} m={m}: {exc}", file=sys.stderr)
                    continue
                ours = _median_ms(lambda: pc.build_schedule(name, R, m, V).lower(), repeats)
                ours_all = _median_ms(lambda: pc.build_schedule(name, R, m, V).lower().actions,
                                      max(1, repeats // 2))
                theirs = None
                # torch lowers only its multi-stage (runtime) schedules; GPipe/1F1B run without lowering
                if with_torch and name in TORCH_CLASSES and name not in ("gpipe", "1f1b"):
                    t0 = time.perf_counter()
                    torch_lower(torch_build(name, R, m, V), name, R, m, V)
                    first = time.perf_counter() - t0
                    if first * 3 <= torch_budget_s:
                        theirs = statistics.median([first * 1e3] + [
                            _median_ms(lambda: torch_lower(torch_build(name, R, m, V), name, R, m, V), 1)
                            for _ in range(2)])
                    else:
                        theirs = first * 1e3
                rows.append((name, R, V, m, ours, ours_all, theirs))
    return rows


def print_table(rows) -> None:
    head = (f"{'schedule':<17}{'ranks':>6}{'V':>3}{'mb':>6}{'pipecore ms':>13}"
            f"{'+Action objs':>14}{'torch ms':>11}{'torch/ours':>12}")
    print(head)
    print("-" * len(head))
    for name, R, V, m, ours, ours_all, theirs in rows:
        t = f"{theirs:11.1f}" if theirs is not None else f"{'-':>11}"
        ratio = f"{theirs / ours:11.1f}x" if theirs is not None else f"{'-':>12}"
        print(f"{name:<17}{R:>6}{V:>3}{m:>6}{ours:13.1f}{ours_all:14.1f}{t}{ratio}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="*", default=list(pc.SCHEDULES))
    ap.add_argument("--ranks", nargs="*", type=int, default=[32])
    ap.add_argument("--microbatches", nargs="*", type=int, default=[256])
    ap.add_argument("--stages-per-rank", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--torch-budget", type=float, default=30.0, help="seconds allowed per torch measurement")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    print(f"# schedule build + lower, median of {args.repeats} (pipecore) / up to 3 (torch) runs; "
          f"'+Action objs' also materialises every Action object")
    rows = run(args.schedules, args.ranks, args.microbatches, args.stages_per_rank, args.repeats,
               args.torch_budget, not args.no_torch)
    print_table(rows)
    if args.plot:
        from _harness import bar_plot

        with_torch = [r for r in rows if r[6] is not None]
        bar_plot(args.plot, [f"{r[0]} pp{r[1]} m{r[3]}" for r in with_torch],
                 {"torch": [r[6] for r in with_torch], "pipecore": [r[4] for r in with_torch]},
                 "build + lower ms", "schedule build + lowering")


if __name__ == "__main__":
    main()
