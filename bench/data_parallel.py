"""Data x pipeline parallel (dp=2 x pp=2 on 4 gloo ranks): the gradient reduction inside the step
against the same reduction after it.

Every rank builds the same MLP (seed 0): `--layers` Linear(width, width) layers split evenly over
the schedule's model stages. The mesh is pc.init_mesh(dp=2, pp=2); replica d takes its half of
each global batch. Three things run on every rank, alternating in timed blocks (A B C A B C ..., a
barrier over all ranks around each block; `--steps` steps per block):

  (a) overlapped   pc.Pipeline(..., group=pp, dp_group=dp, bucket_bytes): the buckets are
                   all-reduced inside the step, from the stage's last backward on (early buckets:
                   sent from the AccumulateGrad hooks) and at REDUCE_GRAD; step() waits at its end.
  (b) after step   the same model in a pc.Pipeline without dp_group (pipeline group only); after
                   step() the same buckets (the same bucket_bytes, reverse parameter order, stages
                   in REDUCE_GRAD order) are flattened, all-reduced over the dp group
                   (torch.distributed, async, then waited), divided by dp and copied back: what a
                   user writes by hand.
  (c) reduction    (b)'s bucket reduction alone (flatten, all-reduce, divide, copy back), no compute,
                   all ranks at once as in (b).

Before timing, (a) and (b) run one step from the same weights on the same batch and every
gradient is compared (largest |a - b| over the largest |b|, per tensor, worst over all ranks).
Step times: per block, block time / steps on the slowest rank; the median (and, under the table,
the mean) over blocks. hidden = ((b) - (a)) / (c) from these medians: the share of the reduction
that (a) takes off the step (100%: all of it), clamped to 0..100% (the raw value and the reason
under the table when outside). The noise: (b) - (a) per block pair (adjacent in time, so sharing
the machine's background load), median (min..max over the pairs); a note under the table says
when the pairs disagree in sign. "early/buckets" is reducer.early_buckets per step (buckets sent
from the backward's hooks before REDUCE_GRAD; median over the timed steps) over all buckets, summed
over the 4 ranks. "DP tail" is from (a)'s traces: per rank, the time from its last action's end
to its last bucket's completion, i.e. the reduction the step still waits for after its compute
(median over the timed steps, slowest rank; in parentheses as a share of (c)).

A second table gives the CPU time (time.process_time: every thread of the process, gloo's too) of
each, summed over the ranks. (a) and (b) do the same reduction work, so their CPU times are about
equal; (c)'s is what the reduction costs. Where the ranks already keep every CPU busy, overlapping
cannot hide that cost: (a) takes at least its CPU time over the CPUs, and "hideable at most" is
((b) - that floor) / (c), the most any overlap could hide on this machine.

The picture (--timeline) shows one traced overlapped step per schedule: per rank a lane of actions
and, under it, a lane of its DP:reduce buckets (sent -> completed).

    python bench/data_parallel.py                          # 1f1b, interleaved_1f1b, zbv
    python bench/data_parallel.py --quick                  # smoke run (tests)
    python bench/data_parallel.py --bucket-mb 25 --timeline build/dp.png
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import textwrap
import time
import traceback

import _harness  # noqa: F401  (puts the repo on sys.path)
from _harness import ROOT, bar_plot, spawn, table
from pipecore.schedule.output import writable

DP, PP = 2, 2
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zbv"]
DEFAULT_SCHEDULES = ["1f1b", "interleaved_1f1b", "zbv"]
FULL = dict(width=1024, layers=8, microbatches=4, rows=8, bucket_mb=4.0, steps=2, blocks=16, warmup=2)
QUICK = dict(width=128, layers=4, microbatches=4, rows=2, bucket_mb=0.02, steps=1, blocks=1, warmup=0)
RUNNERS = ("overlapped", "after step", "reduction")


def _say(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def _rank(rank, world, schedules, cfg):
    try:
        return _bench_rank(rank, world, schedules, cfg)
    except Exception:  # noqa: BLE001  (returned, so that the parent reports it)
        return {"fatal": traceback.format_exc()}


def _bench_rank(rank, world, schedules, cfg):
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipecore as pc
    from pipecore.training.data_parallel import _buckets

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import relative_difference

    mesh = pc.init_mesh(dp=DP, pp=PP)
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    replica, position = divmod(rank, PP)
    width, m, rows = cfg["width"], cfg["microbatches"], cfg["rows"]
    bucket_bytes = max(1, int(cfg["bucket_mb"] * 2**20))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(DP * m * rows, width, generator=g).chunk(DP)[replica]
    y = torch.randn(DP * m * rows, width, generator=g).chunk(DP)[replica]
    loss_fn = nn.MSELoss()
    out = {}
    for name in schedules:
        V = 1 if name in ("gpipe", "1f1b") else 2
        sched = pc.build_schedule(name, PP, m, V)
        n_model = len(set(sched.topology.model_stage))
        if cfg["layers"] % n_model:
            raise ValueError(f"--layers {cfg['layers']} must split evenly into {name}'s {n_model} model stages")
        per = cfg["layers"] // n_model
        torch.manual_seed(0)
        model = [nn.Sequential(*[mod for _ in range(per) for mod in (nn.Linear(width, width), nn.Tanh())])
                 for _ in range(n_model)]
        mine = sched.rank_stages(position)

        def stages():
            return [pc.PipelineStage(copy.deepcopy(model[sched.topology.model_stage[s]]), s, sched.num_stages)
                    for s in mine]

        # a timeout: a failure on one rank ends the others' waits with an error instead of a hang
        pipe_a = pc.Pipeline(stages(), sched, m, loss_fn, group=pp_group, dp_group=dp_group,
                             bucket_bytes=bucket_bytes, trace=True, timeout=120)
        pipe_b = pc.Pipeline(stages(), sched, m, loss_fn, group=pp_group, trace=True, timeout=120)
        first, last = pipe_a.has_first, pipe_a.has_last
        params_a = [p for s in pipe_a.stages for p in s.module.parameters()]
        params_b = [p for s in pipe_b.stages for p in s.module.parameters()]

        # (b)'s buckets: pipecore's bucketing of each stage, stages in REDUCE_GRAD order
        order = pipe_b.programs[True].local_stages_in_order_of("REDUCE_GRAD", len(pipe_b.stages))
        buckets = [bucket for local in order
                   for bucket in _buckets([p for p in pipe_b.stages[local].module.parameters() if p.requires_grad],
                                          bucket_bytes)]
        layout = [[(tuple(q.shape), str(q.dtype)) for q in bucket] for bucket in buckets]
        if layout != [shapes for _, shapes in pipe_a.gradients.dp.layout]:
            raise RuntimeError(f"rank {rank}: (b)'s buckets {layout} differ from pipecore's {pipe_a.gradients.dp.layout}")

        def zero(params):
            for p in params:
                p.grad = None

        def step_a():
            zero(params_a)
            pipe_a.step(*((x,) if first else ()), target=y if last else None)

        def reduce_after():
            flats = [torch.cat([p.grad.reshape(-1) for p in bucket]) for bucket in buckets]
            works = [dist.all_reduce(flat, group=dp_group, async_op=True) for flat in flats]
            for bucket, flat, work in zip(buckets, flats, works):
                work.wait()
                flat.div_(DP)
                offset = 0
                for p in bucket:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                    offset += p.numel()

        def step_b():
            zero(params_b)
            pipe_b.step(*((x,) if first else ()), target=y if last else None)
            reduce_after()

        # -- same weights, same batch: (a) and (b) give the same gradients -----------------------
        step_a()
        step_b()
        grad_diff = max(relative_difference(pa.grad, pb.grad) for pa, pb in zip(params_a, params_b))
        _say(rank, f"  {name}: gradients checked; warming up")

        tails: list[float] = []
        early: list[int] = []

        def timed_a():
            step_a()
            early.append(pipe_a.gradients.dp.reducer.early_buckets)
            tails.append(_dp_tail_ms(pipe_a.trace()))

        runners = {"overlapped": timed_a, "after step": step_b, "reduction": reduce_after}
        for _ in range(cfg["warmup"]):
            step_a()
            step_b()
        times = {k: [] for k in runners}
        cpu = {k: [] for k in runners}  # this process's CPU time (all its threads: gloo's too) per step
        for b in range(cfg["blocks"]):
            for label, run in runners.items():
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(cfg["steps"]):
                    run()
                c1 = time.process_time()
                dist.barrier()
                times[label].append((time.perf_counter() - t0) / cfg["steps"])
                cpu[label].append((c1 - c0) / cfg["steps"])
            _say(rank, f"  {name}: block {b + 1}/{cfg['blocks']} done")
        # one more overlapped step for the picture, all ranks starting together
        dist.barrier()
        step_a()
        trace = [dict(e, rank=rank) for e in pipe_a.trace()]
        out[name] = {"times": times, "cpu": cpu, "grad diff": grad_diff, "early": statistics.median(early),
                     "buckets": pipe_a.gradients.dp.reducer.num_buckets, "tail": statistics.median(tails),
                     "bucket sizes": [sum(p.numel() * p.element_size() for p in bk) for bk in buckets],
                     "params": sum(p.numel() for p in params_a), "trace": trace}
        del pipe_a, pipe_b
        dist.barrier()
    return out


def _dp_tail_ms(events) -> float:
    """Time from this rank's last action's end to its last bucket's completion (ms, >= 0)."""
    actions = [e["end_us"] for e in events if not e["name"].startswith("DP:")]
    reduces = [e["end_us"] for e in events if e["name"].startswith("DP:reduce")]
    if not actions or not reduces:
        return 0.0
    return max(0.0, max(reduces) - max(actions)) / 1e3


def draw_timeline(path: str, panels: list[tuple[str, list[dict]]], world: int) -> str:
    """One panel per (title, events of every rank): per rank a lane of actions and under it a lane
    of its DP:reduce buckets (sent -> completed), staggered so that queued buckets stay apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from pipecore.tools.picture import COLOURS, kind_of

    dp_colours = ("#C44E52", "#E58A8C")
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 0.55 * 2 * world * len(panels) + 1.0 * len(panels) + 0.6),
                             squeeze=False)
    used = set()
    for ax, (title, events) in zip(axes[:, 0], panels):
        t0 = min((e["start_us"] for e in events), default=0.0)
        span = max(((e["end_us"] - t0) / 1e3 for e in events), default=1.0) or 1.0
        for r in range(world):
            mine = [e for e in events if e["rank"] == r]
            buckets = sorted((e for e in mine if e["name"].startswith("DP:reduce")), key=lambda e: e["start_us"])
            for e in mine:
                if e["name"].startswith("DP:"):
                    continue
                label = e["name"].removeprefix("PP:")
                start, end = (e["start_us"] - t0) / 1e3, (e["end_us"] - t0) / 1e3
                kind = kind_of(label)
                comm = kind.startswith(("SEND", "RECV"))
                width = max(end - start, span * 0.0015)
                height, y = (0.22, 2 * r + 0.28) if comm else (0.8, 2 * r - 0.4)
                ax.broken_barh([(start, width)], (y, height), facecolors=COLOURS.get(kind, "#CCCCCC"),
                               edgecolor="white", linewidth=0.3)
                used.add(kind)
                if not comm and width > span * 0.015:
                    ax.text(start + width / 2, 2 * r, label, ha="center", va="center", fontsize=6, color="white",
                            clip_on=True)
            rows = max(1, min(len(buckets), 4))
            for i, e in enumerate(buckets):
                start, end = (e["start_us"] - t0) / 1e3, (e["end_us"] - t0) / 1e3
                width = max(end - start, span * 0.0015)
                height = 0.84 / rows
                y = 2 * r + 1 - 0.42 + height * (i % rows)
                ax.broken_barh([(start, width)], (y, height * 0.92), facecolors=dp_colours[i % 2], edgecolor="white",
                               linewidth=0.3)
                label = e["name"].removeprefix("DP:reduce ").split(" ")[0]  # "<stage>/<bucket>"
                if width > span * 0.02:
                    ax.text(start + width / 2, y + height * 0.46, label, ha="center", va="center",
                            fontsize=min(6, 24 / rows), color="white", clip_on=True)
        ax.set_yticks(range(2 * world), [f"rank {r // 2}" if r % 2 == 0 else "  DP buckets" for r in range(2 * world)],
                      fontsize=7)
        ax.set_ylim(2 * world - 0.5, -0.6)
        ax.set_xlim(0, span * 1.01)
        ax.set_xlabel("ms")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=COLOURS[k], label=k) for k in COLOURS if k in used]
    handles.append(Patch(color=dp_colours[0], label="DP:reduce bucket (sent -> completed)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(writable(path), dpi=130)
    plt.close(fig)
    return path


def _ms(v: float) -> str:
    return f"{v * 1e3:.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one block of one step, 1f1b only (smoke run)")
    ap.add_argument("--schedules", nargs="*", default=None, choices=SCHEDULES)
    ap.add_argument("--width", type=int, default=None, help=f"Linear width ({FULL['width']})")
    ap.add_argument("--layers", type=int, default=None, help=f"Linear layers in the whole model ({FULL['layers']})")
    ap.add_argument("--microbatches", type=int, default=None, help=f"per replica ({FULL['microbatches']})")
    ap.add_argument("--rows", type=int, default=None, help=f"rows per microbatch ({FULL['rows']})")
    ap.add_argument("--bucket-mb", type=float, default=None, help=f"bucket_bytes in MiB ({FULL['bucket_mb']})")
    ap.add_argument("--steps", type=int, default=None, help=f"steps per timed block ({FULL['steps']})")
    ap.add_argument("--blocks", type=int, default=None, help=f"timed blocks of each, alternating ({FULL['blocks']})")
    ap.add_argument("--warmup", type=int, default=None, help=f"untimed steps of (a) and (b) ({FULL['warmup']})")
    ap.add_argument("--timeline", default=None, help="picture of one traced overlapped step per schedule (.png)")
    ap.add_argument("--plot", default=None, help="bar plot of the step times")
    a = ap.parse_args(argv)
    base = QUICK if a.quick else FULL
    cfg = {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in base.items()}
    schedules = a.schedules or (["1f1b"] if a.quick else DEFAULT_SCHEDULES)
    t_start = time.perf_counter()
    results = spawn(_rank, DP * PP, schedules, cfg)
    for r, res in enumerate(results):
        if "fatal" in res:
            raise SystemExit(f"rank {r} failed:\n{res['fatal']}")
    rows, cpu_rows, notes, panels = [], [], [], []
    ncpu = os.cpu_count() or 1
    plot = {k: [] for k in ("(a) overlapped", "(b) after step", "(c) reduction")}
    for name in schedules:
        per = [res[name] for res in results]
        blocks = len(per[0]["times"]["overlapped"])
        # per block: the slowest rank (the barriers make them nearly equal)
        t = {k: [max(p["times"][k][b] for p in per) for b in range(blocks)] for k in RUNNERS}
        a_s, b_s, c_s = (statistics.median(t[k]) for k in RUNNERS)
        # (b) - (a) per block pair: adjacent blocks share the machine's background load
        diffs = [tb - ta for ta, tb in zip(t["overlapped"], t["after step"])]
        hidden = (b_s - a_s) / c_s if c_s > 0 else float("nan")
        shown = f"{100 * min(1.0, max(0.0, hidden)):.0f}%"
        noisy = min(diffs) < 0 < max(diffs)
        if not 0 <= hidden <= 1:
            shown += f" ({100 * hidden:.0f}%)*"
            if noisy:
                why = "(b) - (a) is within the noise (the block pairs disagree in sign)"
            elif hidden < 0:
                why = "(a) was slower than (b) in every block pair: here the overlap cost more than it hid"
            else:
                why = "(b) - (a) exceeds the reduction alone: (b)'s extra step costs more than its all-reduces"
            notes.append(f"{name}: hidden {100 * hidden:.0f}% clamped to {shown.split()[0]}: {why}")
        elif noisy:
            notes.append(f"{name}: the block pairs disagree in sign ((b) - (a) from {_ms(min(diffs))} to "
                         f"{_ms(max(diffs))} ms): hidden {shown} is within the noise of this run")
        early = sum(p["early"] for p in per)
        total = sum(p["buckets"] for p in per)
        tail = max(p["tail"] for p in per)
        rows.append([name, _ms(a_s), _ms(b_s), f"{b_s / a_s:.3f}", _ms(c_s),
                     f"{_ms(statistics.median(diffs))} ({_ms(min(diffs))}..{_ms(max(diffs))})", shown,
                     f"{early:g}/{total}", f"{tail:.1f} ({100 * tail / 1e3 / c_s:.0f}%)"])
        for key, k in zip(plot, RUNNERS):
            plot[key].append(statistics.median(t[k]) * 1e3)
        # CPU time of the 4 processes (all threads) per step, and the share of the machine they kept busy
        cpu = {k: [sum(p["cpu"][k][b] for p in per) for b in range(blocks)] for k in RUNNERS}
        busy = {k: [c / (w * ncpu) for c, w in zip(cpu[k], t[k])] for k in RUNNERS}
        # a step cannot take less wall time than its CPU time spread over every CPU: (a) done perfectly
        floor = statistics.median(cpu["overlapped"]) / ncpu
        hideable = min(1.0, max(0.0, (b_s - floor) / c_s)) if c_s > 0 else float("nan")
        cpu_rows.append([name] + [_ms(statistics.median(cpu[k])) for k in RUNNERS]
                        + [f"{100 * statistics.median(busy[k]):.0f}%" for k in RUNNERS]
                        + [_ms(floor), f"{100 * hideable:.0f}%"])
        sizes = per[0]["bucket sizes"]
        notes.append(f"{name}: (a) vs (b) after one step from the same weights and batch: gradients within "
                     f"{max(p['grad diff'] for p in per):.1e} (largest |a - b| / largest |b|, per tensor, all "
                     f"ranks); means over blocks (a) {_ms(statistics.fmean(t['overlapped']))} (b) "
                     f"{_ms(statistics.fmean(t['after step']))} (c) {_ms(statistics.fmean(t['reduction']))} ms; "
                     f"rank 0's buckets {[round(s / 2**20, 2) for s in sizes]} MiB")
        trace = [e for p in per for e in p["trace"]]
        span = (max(e["end_us"] for e in trace) - min(e["start_us"] for e in trace)) / 1e3
        panels.append((f"{name}: one overlapped step ({span:.1f} ms), dp=2 x pp=2; under each rank its "
                       f"DP:reduce buckets (sent -> all-reduce completed)", trace))
    params = results[0][schedules[0]]["params"]
    title = (f"dp={DP} x pp={PP} on {DP * PP} gloo ranks ({os.cpu_count()} CPUs): MLP of {cfg['layers']} "
             f"Linear({cfg['width']}) + Tanh, {params * 4 / 2**20:.1f} MiB of fp32 parameters per rank, "
             f"{cfg['microbatches']} microbatches x {cfg['rows']} rows per replica, bucket_bytes "
             f"{cfg['bucket_mb']:g} MiB; ms per step, median of {cfg['blocks']} alternating blocks of "
             f"{cfg['steps']} steps (slowest rank)")
    print(table(["schedule", "(a) overlapped ms", "(b) after step ms", "(b)/(a)", "(c) reduction ms",
                 "(b)-(a) per pair ms (min..max)", "hidden", "early/buckets", "DP tail ms (of c)"], rows, title))
    for line in notes:
        print(line)
    print()
    print(table(["schedule", "(a) CPU ms", "(b) CPU ms", "(c) CPU ms", "(a) busy", "(b) busy", "(c) busy",
                 "(a) CPU/CPUs ms", "hideable at most"], cpu_rows,
                f"CPU time per step, all threads of the {DP * PP} ranks summed (median over blocks); busy: that CPU "
                f"time over wall time x {ncpu} CPUs (100%: every CPU busy with the ranks; the rest idle or other "
                f"processes'); (a) CPU/CPUs: the shortest (a) could be with every CPU busy all the step; hideable "
                f"at most: ((b) - that) / (c)"))
    print(f"wall time {time.perf_counter() - t_start:.0f} s")
    if a.timeline:
        print(f"wrote {draw_timeline(a.timeline, panels, DP * PP)}")
    if a.plot:
        bar_plot(a.plot, schedules, plot, "ms / step (median)", textwrap.fill(title, 100))


if __name__ == "__main__":
    main()
