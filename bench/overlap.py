"""Communication/computation overlap: measured step time against the simulator's ideal.

Stages run a synthetic compute (a fixed sleep that releases the GIL, forward and backward) on
activations of a chosen size. The simulator's F and B costs are that compute (sleep and output
allocation) as it really ran during the timed steps (a sleep overruns on a busy machine);
everything else in the step counts against pipecore. The one-way time of a message of that size
is measured on the same gloo ranks; the simulator then gives
  ideal      compute + the latency of each transfer on the critical path (communication hidden),
  serialized every transfer also blocks its sender (no overlap at all),
and the table shows where the measured step falls: `hidden` is the share of the avoidable
communication time that pipecore hides (100%: the ideal).

    python bench/overlap.py [--schedules 1f1b] [--forward-ms 4] [--mib 4] [--microbatches 8]
    python bench/overlap.py --schedules --pair-schedules dualpipev [--comm-ms 2]   (only the pairs)

OVERLAP_F_B pairs (`--pair-schedules dualpipev dualpipe`, a second table): dualpipe's schedules pair
the forward of one microbatch with the backward of another so that the communication of one hides
behind the compute of the other. Here each forward and each backward is a compute part (a sleep of
--forward-ms / --backward-ms, releasing the GIL like a kernel) followed by a communication part: a
sleep of --comm-ms inside `with pipecore.overlap_handoff():`, where a model waits for its MoE
all-to-all. A sleep stands for the collective on purpose. In a model the all-to-all runs among the
expert-parallel replicas of one stage, which run the same actions at once; here the only ranks are
the pipeline's, each running other stages' and microbatches' forwards and backwards at other times
(and, in a pair, two at once), so a collective among them (a gloo all-reduce on a group of its own)
would be entered in different orders on different ranks: it would pair the wrong calls or deadlock
against the pipeline's transfers. Like a collective that the network or an accelerator carries, a
sleep keeps no CPU busy. Activations are small (4 KiB), so pipeline transfers cost little
(`msg ms`: their one-way time, measured alone, which the simulator adds to each one it waits for).
On the same gloo ranks, in one run, one Pipeline per `overlap_f_b` mode steps in turn (the modes
alternate step by step; median of --steps after a warm step, the slowest rank's), and the bench
fails unless every pair of "concurrent" and "lockstep" ran overlapped (`Pipeline.overlapped_pairs`,
`Pipeline.overlap_fallbacks`). Each row's ideal is the simulator's step time for that mode, priced
with its F and B (compute + communication) as they ran in that mode:
  sequential  a pair costs F + B            (`simulate(overlap="sequential")`),
  concurrent  a pair costs max(F, B)        (`simulate(overlap="concurrent")`),
  lockstep    a pair costs max(F, F + B - the forward's communication): the forward holds the turn
              first, its communication hides behind the backward's compute, and the backward's
              communication, last, shows (`simulate` with that OVERLAP_F_B cost).
`speedup` is the sequential row's measured step time over this row's (same run); `simulated
speedup` the same ratio of simulated step times, at this mode's costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import _harness  # noqa: F401
from _harness import bar_plot, spawn, table


def _one_way_s(rank, peer, numel, repeats=10):
    import torch
    import torch.distributed as dist

    t = torch.zeros(numel)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank < peer:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)
        times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def _rank(rank, world, name, m, fwd_ms, bwd_ms, mib, steps):
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipecore as pc

    observed = {"F": [], "B": []}  # the stage's compute as it ran

    class Sleep(torch.autograd.Function):
        """A fixed-duration compute that touches no data (the CPUs stay free for the transfers)."""

        @staticmethod
        def forward(ctx, x, w):
            t0 = time.perf_counter()
            time.sleep(fwd_ms / 1e3)
            out = torch.empty_like(x)
            observed["F"].append(time.perf_counter() - t0)
            return out

        @staticmethod
        def backward(ctx, g):
            t0 = time.perf_counter()
            time.sleep(bwd_ms / 1e3)
            grads = torch.empty_like(g), torch.zeros(1)
            observed["B"].append(time.perf_counter() - t0)
            return grads

    class Synthetic(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return Sleep.apply(x, self.w)

    V = 1 if name in ("gpipe", "1f1b") else 2
    sched = pc.build_schedule(name, world, m, V)
    width = 1024
    rows_per_mb = max(1, int(mib * 2**20 / 4 / width))
    numel = rows_per_mb * width
    one_way = _one_way_s(rank, 1 - rank if world == 2 else (rank + 1) % world, numel) if world > 1 else 0.0
    stages = [pc.PipelineStage(Synthetic(), s, sched.num_stages) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, m, loss_fn=lambda out, y: out[:1, :1].sum())
    x = torch.randn(rows_per_mb * m, width)
    first, last = pipe.has_first, pipe.has_last

    def step():
        pipe.step(*((x,) if first else ()), target=x[:, 0] if last else None)

    step()  # warm: shapes, buffers, the autograd engine's threads
    for kind in observed:
        observed[kind].clear()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), one_way, statistics.median(observed["F"]), statistics.median(observed["B"])


PAIR_MODES = ("sequential", "concurrent", "lockstep")
PAIR_WIDTH = 1024  # floats per microbatch: 4 KiB activations, the pipeline's transfers cost little


def _pairs_per_rank(sched, rank):
    """This rank's OVERLAP_F_B containers per step."""
    import pipecore as pc

    return sum(a.kind is pc.Kind.OVERLAP_F_B for a in sched.lower().actions[rank])


def _pair_rank(rank, world, name, m, fwd_ms, bwd_ms, comm_ms, steps):
    """One Pipeline per overlap mode on this rank, stepped in turn; per mode: the median step time and
    the parts of F and B as they ran (compute, communication; medians). Also the one-way time of an
    activation, and what went wrong with the pairs (_overlap_problems)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipecore as pc

    def compute_then_communicate(compute_s, log, kind):
        """A compute part that releases the GIL, then a communication part inside a handoff block
        (a sleep standing for a collective: see the module's docstring)."""
        t0 = time.perf_counter()
        time.sleep(compute_s)
        log[kind].append(time.perf_counter() - t0)
        with pc.overlap_handoff():  # lockstep: the other half computes meanwhile
            t0 = time.perf_counter()
            time.sleep(comm_ms / 1e3)
            log[kind + " comm"].append(time.perf_counter() - t0)

    class ComputeThenCommunicate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, log):
            ctx.log = log
            compute_then_communicate(fwd_ms / 1e3, log, "F")
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, g):
            compute_then_communicate(bwd_ms / 1e3, ctx.log, "B")
            pc.defer_weight_grad(lambda: None)  # no weight gradient to compute: W has nothing to do
            return torch.empty_like(g), None, None

    class Stage(nn.Module):
        def __init__(self, log):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))
            self.log = log

        def forward(self, x):
            return ComputeThenCommunicate.apply(x, self.w, self.log)

    sched = pc.build_schedule(name, world, m)
    one_way = _one_way_s(rank, 1 - rank if world == 2 else (rank + 1) % world, PAIR_WIDTH) if world > 1 else 0.0
    logs = {mode: {"F": [], "F comm": [], "B": [], "B comm": []} for mode in PAIR_MODES}
    pipes = {}
    for mode in PAIR_MODES:
        stages = [pc.PipelineStage(Stage(logs[mode]), s, sched.num_stages) for s in sched.rank_stages(rank)]
        pipes[mode] = pc.Pipeline(stages, sched, m, loss_fn=lambda out, y: out[:1, :1].sum(), timeout=120,
                                  overlap_f_b=mode)
    x = torch.randn(m, PAIR_WIDTH)

    def step(pipe):
        pipe.step(*((x,) if pipe.has_first else ()), target=x[:, 0] if pipe.has_last else None)

    for pipe in pipes.values():
        step(pipe)  # warm: shapes (this step's pairs run in program order), buffers, threads
    for log in logs.values():
        for parts in log.values():
            parts.clear()
    overlapped = {mode: pipe.overlapped_pairs for mode, pipe in pipes.items()}
    times = {mode: [] for mode in PAIR_MODES}
    for _ in range(steps):
        for mode, pipe in pipes.items():  # alternating, so that the modes share the machine's drift
            dist.barrier()
            t0 = time.perf_counter()
            step(pipe)
            times[mode].append(time.perf_counter() - t0)
    problems = _overlap_problems(pipes, overlapped, _pairs_per_rank(sched, rank) * steps, f"rank {rank}, {name}")
    return {mode: (statistics.median(times[mode]), {k: statistics.median(v) for k, v in logs[mode].items()})
            for mode in PAIR_MODES}, one_way, problems


def _overlap_problems(pipes, before, pairs, where):
    """What went wrong with the pairs since `before` (each mode's overlapped_pairs then): every one of
    `pairs` overlapped in concurrent and lockstep, none in sequential, no fallbacks. Returned, so that
    the main process reports every rank's problems in one message."""
    problems = [] if pairs else [f"{where}: no OVERLAP_F_B pairs"]
    for mode, pipe in pipes.items():
        ran = pipe.overlapped_pairs - before[mode]
        expected = 0 if mode == "sequential" else pairs
        if ran != expected:
            problems.append(f"{where} {mode}: {ran} pairs overlapped, expected {expected}")
        if pipe.overlap_fallbacks:
            problems.append(f"{where} {mode}: pairs ran in sequence: {pipe.overlap_fallbacks}")
    return problems


def _pair_ideals(sched, parts, one_way):
    """The simulator's step time for each mode, at that mode's parts as they ran (see the docstring)."""
    ideals, sequential = {}, {}
    for mode, p in parts.items():
        f, b = p["F"] + p["F comm"], p["B"] + p["B comm"]
        costs = {"F": f, "B": b, "I": b, "W": 0.0, "comm": one_way}  # the backward's work all runs at I
        sequential[mode] = sched.simulate(costs, overlap="sequential").makespan
        if mode == "lockstep":
            costs["OVERLAP_F_B"] = lambda fwd, bwd, hidden=p["F comm"]: max(fwd, fwd + bwd - hidden)
        ideals[mode] = sched.simulate(costs, overlap=mode).makespan
    return ideals, sequential


def pair_table(a):
    """The OVERLAP_F_B case: each schedule's modes side by side, against the simulator's ideals."""
    import pipecore as pc

    rows = []
    for name in a.pair_schedules:
        res = spawn(_pair_rank, a.ranks, name, a.microbatches, a.forward_ms, a.backward_ms, a.comm_ms, a.steps)
        problems = [p for r in res for p in r[2]]
        if problems:
            raise SystemExit("OVERLAP_F_B pairs did not run as their modes say:\n  " + "\n  ".join(problems))
        measured = {mode: max(r[0][mode][0] for r in res) for mode in PAIR_MODES}  # the slowest rank's
        parts = {mode: {k: max(r[0][mode][1][k] for r in res) for k in res[0][0][mode][1]} for mode in PAIR_MODES}
        one_way = statistics.median(r[1] for r in res)
        ideals, sequential = _pair_ideals(pc.build_schedule(name, a.ranks, a.microbatches), parts, one_way)
        for mode in PAIR_MODES:
            p = parts[mode]
            rows.append([name, mode, f"{(p['F'] + p['F comm']) * 1e3:.2f}/{(p['B'] + p['B comm']) * 1e3:.2f}",
                         one_way * 1e3, ideals[mode] * 1e3, measured[mode] * 1e3,
                         f"{measured[mode] / ideals[mode]:.3f}",
                         f"{measured['sequential'] / measured[mode]:.3f}", f"{sequential[mode] / ideals[mode]:.3f}"])
    title = (f"OVERLAP_F_B pairs, {a.ranks} gloo ranks, {a.microbatches} microbatches, compute of {a.forward_ms}/"
             f"{a.backward_ms} ms then communication of {a.comm_ms} ms (sleeps; F/B as they ran, both parts)")
    return rows, title


def _pairs_plot_path(path, alone):
    """The pairs chart's file: `path` itself when it is the only chart, else beside it."""
    if alone:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}_pairs{ext}"


def main(argv=None):
    import pipecore as pc

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b", "interleaved_1f1b", "zbv"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--forward-ms", type=float, default=4.0)
    ap.add_argument("--backward-ms", type=float, default=8.0)
    ap.add_argument("--mib", type=float, default=4.0, help="activation size per microbatch")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--pair-schedules", nargs="*", default=["dualpipev", "dualpipe"],
                    help="schedules with OVERLAP_F_B pairs: their modes side by side (a second table)")
    ap.add_argument("--comm-ms", type=float, default=2.0, help="pairs: the communication part of F and of B")
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    rows = []
    for name in a.schedules:
        res = spawn(_rank, a.ranks, name, a.microbatches, a.forward_ms, a.backward_ms, a.mib, a.steps)
        measured = max(r[0] for r in res)
        comm = statistics.median(r[1] for r in res)
        V = 1 if name in ("gpipe", "1f1b") else 2
        s = pc.build_schedule(name, a.ranks, a.microbatches, V)
        f = max(r[2] for r in res)  # as the sleeps ran, not their nominal length
        b = max(r[3] for r in res)
        ideal = s.simulate({"F": f, "B": b, "comm": comm}).makespan
        serial = s.simulate({"F": f + comm, "B": b + comm, "comm": comm}).makespan
        hidden = (serial - measured) / (serial - ideal) if serial > ideal else 1.0
        rows.append([name, f"{f * 1e3:.2f}/{b * 1e3:.2f}", comm * 1e3, ideal * 1e3, serial * 1e3, measured * 1e3, f"{measured / ideal:.3f}",
                     f"{100 * min(1.0, max(0.0, hidden)):.0f}%"])
    title = (f"{a.ranks} gloo ranks, {a.microbatches} microbatches, sleeps of {a.forward_ms}/{a.backward_ms} ms "
                f"(GIL released; F/B as they ran), {a.mib} MiB per message")
    if rows:
        print(table(["schedule", "F/B ms", "msg ms", "ideal ms", "serialized ms", "measured ms", "measured/ideal",
                     "hidden"], rows, title))
    if rows and a.plot:
        bar_plot(a.plot, [r[0] for r in rows], {"ideal (simulated)": [r[3] for r in rows],
                 "serialized (simulated)": [r[4] for r in rows], "measured": [r[5] for r in rows]}, "ms / step", title)
    if not a.pair_schedules:
        return
    pair_rows, pair_title = pair_table(a)
    if rows:
        print()
    print(table(["schedule", "mode", "F/B ms", "msg ms", "ideal ms", "measured ms", "measured/ideal", "speedup",
                 "simulated speedup"], pair_rows, pair_title))
    if a.plot:
        bar_plot(_pairs_plot_path(a.plot, alone=not rows), [f"{r[0]} {r[1]}" for r in pair_rows],
                 {"ideal (simulated)": [r[4] for r in pair_rows], "measured": [r[5] for r in pair_rows]},
                 "ms / step", pair_title)


if __name__ == "__main__":
    main()
