"""`python -m pipecore ...`: look at schedules and run the benchmarks.

  show NAME --ranks R --microbatches M [--stages-per-rank V] [--out FILE.png|.svg] [--lowered]
  simulate NAME --ranks R --microbatches M [--F 1 --B 2 --I 1 --W 1 --comm 0] [--overlap concurrent]
  validate FILE.csv [--placement loop|v|dualpipe]
  bench {vs_torch,overhead,overlap,memory,build,zero_bubble,gpt,data_parallel,compat} [benchmark options...]
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from .schedule import SCHEDULES, Schedule, ScheduleError, build_schedule
from .schedule.simulate import OVERLAP_MODES

BENCHES = ("vs_torch", "overhead", "overlap", "memory", "build", "zero_bubble", "gpt", "data_parallel", "compat")


def _schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help=f"one of {', '.join(SCHEDULES)}")
    p.add_argument("--ranks", "-r", type=int, required=True)
    p.add_argument("--microbatches", "-m", type=int, required=True)
    p.add_argument("--stages-per-rank", "-v", type=int, default=None)


def _costs(p: argparse.ArgumentParser) -> None:
    for key, default in (("F", 1.0), ("B", 2.0), ("I", None), ("W", None), ("comm", 0.0)):
        p.add_argument(f"--{key}", type=float, default=default, help=f"cost of {key}")


def _cost_dict(a) -> dict:
    costs = {"F": a.F, "B": a.B, "comm": a.comm}
    if a.I is not None:
        costs["I"] = a.I
    if a.W is not None:
        costs["W"] = a.W
    return costs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipecore", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    show = sub.add_parser("show", help="print the step x rank table and draw the timeline picture")
    _schedule_args(show)
    _costs(show)
    show.add_argument("--out", default=None, help="picture file (.png or .svg); default NAME_rR_mM.png")
    show.add_argument("--lowered", action="store_true", help="print the lowered schedule (with communication)")
    sim = sub.add_parser("simulate", help="makespan, bubble and peak activations for given costs")
    _schedule_args(sim)
    _costs(sim)
    sim.add_argument("--overlap", default=OVERLAP_MODES[0], choices=OVERLAP_MODES,
                     help="how OVERLAP_F_B pairs run (Pipeline's overlap_f_b): concurrent prices a pair as its "
                          "longer half, the others as both")
    val = sub.add_parser("validate", help="check a schedule CSV (torch's format)")
    val.add_argument("csv")
    val.add_argument("--placement", default=None, help="loop, v or dualpipe (default: inferred)")
    bench = sub.add_parser("bench", help="run a benchmark from bench/", add_help=False)
    bench.add_argument("which", choices=BENCHES)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "show":
            s = build_schedule(a.name, a.ranks, a.microbatches, a.stages_per_rank)
            print((s.lower() if a.lowered else s).format())
            out = a.out or f"{s.name}_r{a.ranks}_m{a.microbatches}.png"
            from .schedule.picture import draw_schedule

            draw_schedule(s, out, _cost_dict(a))
            print(f"wrote {out}")
        elif a.cmd == "simulate":
            s = build_schedule(a.name, a.ranks, a.microbatches, a.stages_per_rank)
            r = s.simulate(_cost_dict(a), overlap=a.overlap)
            print(f"schedule          {s.name} ({s.num_ranks} ranks, {s.num_stages} stages, "
                  f"{s.num_microbatches} microbatches, {s.placement} placement)")
            print(f"makespan          {r.makespan:.6g}")
            print(f"bubble ratio      {r.bubble_ratio:.4f}")
            print(f"busy per rank     {' '.join(f'{b:.6g}' for b in r.busy)}")
            print(f"peak activations  {' '.join(map(str, r.peak_activations))}")
        elif a.cmd == "validate":
            s = Schedule.from_csv(a.csv, placement=a.placement)
            s.validate()
            print(f"{a.csv}: valid ({s.num_ranks} ranks, {s.num_stages} stages, {s.num_microbatches} microbatches, "
                  f"{s.placement} placement{', lowered' if s.is_lowered else ''})")
        elif a.cmd == "bench":
            path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", f"{a.which}.py")
            if not os.path.exists(path):
                print(f"bench/{a.which}.py not found: the benchmarks live in the source checkout", file=sys.stderr)
                return 2
            sys.argv = [path] + a.rest
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
    except (ScheduleError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
