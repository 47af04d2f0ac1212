"""`python -m pipecore ...`: look at schedules (the benchmarks are `python bench/NAME.py` in a checkout).

  show NAME --ranks R --microbatches M [--stages-per-rank V] [--out FILE.png|.svg] [--lowered]
  simulate NAME --ranks R --microbatches M [--F 1 --B 2 --I 1 --W 1 --comm 0] [--overlap concurrent]
  simulate --compare --ranks R --microbatches M [costs] [--profile TRACE.json] [--memory 1.0]
  validate FILE.csv [--placement loop|v|dualpipe]
  doctor DIR   (the files a failed step left where PIPECORE_FLIGHT_DIR=DIR)
"""

from __future__ import annotations

import argparse
import sys

from pipecore.schedule import SCHEDULES, Schedule, ScheduleError, build_schedule, canonical_name
from pipecore.schedule.simulate import OVERLAP_MODES

def _schedule_args(p: argparse.ArgumentParser, optional_name: bool = False) -> None:
    p.add_argument("name", help=f"one of {', '.join(SCHEDULES)}", **({"nargs": "?"} if optional_name else {}))
    p.add_argument("--ranks", "-r", type=int, required=True)
    p.add_argument("--microbatches", "-m", type=int, required=True)
    p.add_argument("--stages-per-rank", "-v", type=int, default=None)


def _costs(p: argparse.ArgumentParser) -> None:
    for key, default, extra in (("F", 1.0, ""), ("B", None, " (default I + W, else 2 x F)"), ("I", None, ""),
                                ("W", None, ""), ("comm", 0.0, "")):
        p.add_argument(f"--{key}", type=float, default=default, help=f"cost of {key}{extra}")


def _cost_dict(a) -> dict:
    costs = {"F": a.F, "comm": a.comm}
    if a.B is not None:
        costs["B"] = a.B
    if a.I is not None:
        costs["I"] = a.I
    if a.W is not None:
        costs["W"] = a.W
    return costs


def _build(a) -> Schedule:
    """The named schedule; zb_auto built for the costs given."""
    options = {"costs": _cost_dict(a)} if canonical_name(a.name) == "zb_auto" else {}
    return build_schedule(a.name, a.ranks, a.microbatches, a.stages_per_rank, **options)


def _compare(a) -> None:
    from pipecore.tools.recommend import (compare, costs_from_trace, load_trace, memory_limit, per_rank_costs, stage_costs,
                                     traced_model_stages)

    costs = _cost_dict(a)
    if a.profile:
        events = load_trace(a.profile)
        model_stage = None
        if a.traced_schedule:
            ranks = {e.get("rank", e.get("pid")) for e in events} - {None}
            model_stage = traced_model_stages(a.traced_schedule, len(ranks))
        measured = costs_from_trace(events, model_stage=model_stage)
        costs = {"comm": a.comm, **measured}
        print(f"costs per stage measured in {a.profile} (ms, median over microbatches, "
              f"{len(next(iter(measured.values())))} stages):")
        for kind, values in measured.items():
            print(f"  {kind:<4} {' '.join(f'{v:.4g}' for v in values)}")
    names = [canonical_name(n) for n in a.schedules] if a.schedules else None
    memory = 1.0 if a.memory is None else a.memory
    rows = compare(a.ranks, a.microbatches, costs, memory, names)
    if not rows:
        raise ValueError(f"no schedule builds for {a.ranks} ranks and {a.microbatches} microbatches")
    head = f"{'schedule':<18}{'stages/rank':>12}{'makespan':>11}{'bubble':>9}{'memory x 1F1B':>15}  fits"
    print(head)
    print("-" * len(head))
    for c in rows:
        print(f"{c.name:<18}{c.stages_per_rank:>12}{c.makespan:>11.5g}{c.bubble_ratio:>9.4f}{c.memory:>15.3f}"
              f"  {'yes' if c.fits else 'no'}")
    best = rows[0]
    if not best.fits:
        print(f"recommended: none fits memory {memory:g} x 1F1B's; the least memory above is "
              f"{min(c.memory for c in rows):.3f}")
        return
    how = f'pc.build_schedule("{best.name}", {a.ranks}, {a.microbatches}, {best.stages_per_rank}'
    if best.name == "zb_auto":
        per_stage = stage_costs(range(a.ranks * best.stages_per_rank), per_rank_costs(costs, a.ranks))
        shown = {k: ([float(f"{x:.4g}") for x in v] if isinstance(v, list) else v) for k, v in per_stage.items()}
        limit = memory_limit(memory, a.ranks, best.stages_per_rank, a.microbatches)
        how += f", costs={shown}, memory_limit={limit}"
    print(f"recommended: {best.name} with {best.stages_per_rank} stage(s) per rank, makespan {best.makespan:.5g} "
          f"({how}))")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipecore", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    show = sub.add_parser("show", help="print the step x rank table and draw the timeline picture")
    _schedule_args(show)
    _costs(show)
    show.add_argument("--out", default=None, help="picture file (.png or .svg); default NAME_rR_mM.png")
    show.add_argument("--lowered", action="store_true", help="print the lowered schedule (with communication)")
    sim = sub.add_parser("simulate", help="makespan, bubble and peak activations for given costs; --compare: of "
                                          "every schedule, and the one to use")
    _schedule_args(sim, optional_name=True)
    _costs(sim)
    sim.add_argument("--compare", action="store_true",
                     help="compare every schedule (or --schedules) and recommend the fastest within --memory; here "
                          "--F/--B/--I/--W are the costs of one rank's share of the model (a stage of 1F1B: a "
                          "schedule with 2 stages per rank gets half each), --comm the cost of one message")
    sim.add_argument("--profile", default=None,
                     help="trace of a real step (to_chrome_trace JSON or Pipeline.trace() events): its measured "
                          "F, I, W (B) per stage, in ms, replace --F/--B/--I/--W; implies --compare")
    sim.add_argument("--traced-schedule", default=None,
                     help="with --profile: the schedule the trace ran, when its stages are not the model's in "
                          "order (dualpipe: stages R..2R-1 mirror 0..R-1)")
    sim.add_argument("--memory", type=float, default=None,
                     help="with --compare: activation memory allowed, as a fraction of 1F1B's (default 1.0)")
    sim.add_argument("--schedules", nargs="*", default=None,
                     help="with --compare: the schedules to compare (default: all)")
    sim.add_argument("--overlap", default=OVERLAP_MODES[0], choices=OVERLAP_MODES,
                     help="how OVERLAP_F_B pairs run (Pipeline's overlap_f_b): concurrent prices a pair as its "
                          "longer half, the others as both")
    val = sub.add_parser("validate", help="check a schedule CSV (torch's format)")
    val.add_argument("csv")
    val.add_argument("--placement", default=None, help="loop, v or dualpipe (default: inferred)")
    doc = sub.add_parser("doctor", help="why a step hung: every rank's flight record, from the files a failed step "
                                        "wrote to PIPECORE_FLIGHT_DIR")
    doc.add_argument("folder")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "show":
            s = _build(a)
            print((s.lower() if a.lowered else s).format())
            out = a.out or f"{s.name}_r{a.ranks}_m{a.microbatches}.png"
            from pipecore.tools.picture import draw_schedule

            draw_schedule(s, out, _cost_dict(a))
            print(f"wrote {out}")
        elif a.cmd == "simulate" and (a.compare or a.profile):
            misplaced = [flag for flag, given in (("a schedule name", a.name is not None),
                                                  ("--stages-per-rank", a.stages_per_rank is not None),
                                                  ("--overlap", a.overlap != OVERLAP_MODES[0])) if given]
            if misplaced:
                raise ValueError(f"{', '.join(misplaced)}: not with --compare/--profile, which compare every schedule "
                                 f"at the stage counts it takes (pick them with --schedules)")
            if a.traced_schedule and not a.profile:
                raise ValueError("--traced-schedule describes the trace given with --profile")
            _compare(a)
        elif a.cmd == "simulate":
            if a.name is None:
                raise ValueError("simulate needs a schedule name, or --compare to compare them all")
            if a.memory is not None or a.schedules is not None or a.traced_schedule is not None:
                raise ValueError("--memory, --schedules and --traced-schedule go with --compare or --profile")
            s = _build(a)
            r = s.simulate(_cost_dict(a), overlap=a.overlap)
            print(f"schedule          {s.name} ({s.num_ranks} ranks, {s.num_stages} stages, "
                  f"{s.num_microbatches} microbatches, {s.placement} placement)")
            print(f"makespan          {r.makespan:.6g}")
            print(f"bubble ratio      {r.bubble_ratio:.4f}")
            print(f"busy per rank     {' '.join(f'{b:.6g}' for b in r.busy)}")
            print(f"peak activations  {' '.join(map(str, r.peak_activations))}")
        elif a.cmd == "doctor":
            from pipecore.runtime.doctor import read_dumps

            print(read_dumps(a.folder))
        elif a.cmd == "validate":
            s = Schedule.from_csv(a.csv, placement=a.placement)
            s.validate()
            print(f"{a.csv}: valid ({s.num_ranks} ranks, {s.num_stages} stages, {s.num_microbatches} microbatches, "
                  f"{s.placement} placement{', lowered' if s.is_lowered else ''})")
    except (ScheduleError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
