"""Executor overhead per action: host time pipecore adds around the module's own compute.

One rank runs a schedule whose stages all live on it (so there is no wire), with tiny Linear
stages. The same forwards and backwards, in the schedule's order, are also run as plain PyTorch
(module call, loss, torch.autograd.backward) in the same process; the difference, divided by the
number of actions the executor ran, is its cost per action (dispatch, bookkeeping, freeing,
callbacks, split/merge).

Each of `--runs` runs is a fresh process timing `--repeats` alternating steps of each side; the
table gives the median run and the spread (lowest-highest) of the runs.

The flight record's own writes (csrc/flight_record.h, always on) cost less than those runs resolve:
a second table times them alone, in a native loop (bench/flight_record_cost.cpp, built with this
machine's C++ compiler at the extension's -O2), per compute action and per message, with and without
them in one run.

    python bench/overhead.py [--stages 4] [--microbatches 64] [--width 8] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import _harness  # noqa: F401
from _harness import bar_plot, spawn, table


def _measure(rank, world, name, V, m, width, repeats):
    import torch
    from torch import nn

    import pipecore as pc

    torch.manual_seed(0)
    sched = pc.build_schedule(name, 1, m, V)
    modules = [nn.Linear(width, width) for _ in range(sched.num_stages)]
    stages = [pc.PipelineStage(mod, s, sched.num_stages) for s, mod in enumerate(modules)]
    loss_fn = nn.MSELoss()
    pipe = pc.Pipeline(stages, sched, m, loss_fn=loss_fn)
    x, y = torch.randn(m, width), torch.randn(m, width)
    n_actions = len(pipe.programs[True].labels)

    def run_pipecore():
        pipe.step(x, target=y)

    xs, ys = torch.tensor_split(x, m), torch.tensor_split(y, m)
    last = sched.num_stages - 1
    # the schedule's compute actions in its order; W has nothing to do in the plain loop, whose
    # backward (at B or I) computes the weight gradients too
    order = [(leaf.kind is pc.Kind.F, leaf.stage, leaf.microbatch) for a in sched.actions[0] for leaf in a.leaves()
             if leaf.kind in (pc.Kind.F, pc.Kind.B, pc.Kind.I)]

    def run_plain():
        # what the schedule computes, in the schedule's order, as plain PyTorch: a forward with a
        # fresh leaf input per stage and microbatch, a backward with the next stage's input gradient
        held = {}  # (stage, microbatch) -> (input, output or loss)
        for forward, s, k in order:
            if forward:
                inp = (xs[k] if s == 0 else held[(s - 1, k)][1]).detach().requires_grad_(s > 0)
                out = modules[s](inp)
                held[(s, k)] = (inp, loss_fn(out, ys[k]) if s == last else out)
            else:
                inp, out = held[(s, k)]
                torch.autograd.backward(out, None if s == last else held.pop((s + 1, k))[0].grad)
        held.clear()

    times = {"pipecore": [], "plain": []}
    for fn in (run_pipecore, run_plain):
        fn()
    for _ in range(repeats):
        for key, fn in (("pipecore", run_pipecore), ("plain", run_plain)):
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return med["pipecore"], med["plain"], n_actions


def flight_record_cost(iterations: int = 2_000_000, reps: int = 7) -> tuple[float, float] | None:
    """Nanoseconds the flight record's writes add per compute action and per message (the native loop
    with them, less without them; best of `reps`); None where no C++ compiler builds it (said why)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        print("no C++ compiler found (c++, g++, clang++ or $CXX): the flight record's loop is not timed")
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "flight_record_cost")
        command = [compiler, "-O2", "-std=c++17", "-pthread", "-I", os.path.join(here, "..", "csrc"),
                   os.path.join(here, "flight_record_cost.cpp"), "-o", exe]
        built = subprocess.run(command, capture_output=True, text=True)
        if built.returncode != 0:
            print(f"the flight record's loop did not build with {compiler}:\n{built.stderr[-2000:]}")
            return None
        out = subprocess.run([exe, str(iterations), str(reps)], check=True, capture_output=True, text=True).stdout
    words = out.split()
    return float(words[1]), float(words[3])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=4, help="stages on the one rank")
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--runs", type=int, default=3, help="fresh processes; the table gives their median and spread")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--flight-iterations", type=int, default=2_000_000, help="the flight record's native loop")
    a = ap.parse_args(argv)
    names = ("interleaved_1f1b", "interleaved_zb", "looped_bfs")
    runs = {name: [] for name in names}
    for _ in range(a.runs):  # schedules in turn, so that a slow moment of the machine hits all of them
        for name in names:
            runs[name].append(spawn(_measure, 1, name, a.stages, a.microbatches, a.width, a.repeats)[0])
    rows = []
    for name in names:
        ours = statistics.median(r[0] for r in runs[name])
        plain = statistics.median(r[1] for r in runs[name])
        n = runs[name][0][2]
        per_action = sorted((o - p) / n * 1e6 for o, p, _ in runs[name])
        rows.append([name, n, ours * 1e3, plain * 1e3, statistics.median(per_action),
                     f"{per_action[0]:.2f} to {per_action[-1]:.2f}"])
    title = (f"1 rank, {a.stages} stages of Linear({a.width}), {a.microbatches} microbatches; each run the "
             f"median of {a.repeats} steps; median and spread of {a.runs} runs")
    print(table(["schedule", "actions/step", "pipecore ms", "plain torch ms", "overhead us/action", "spread"],
                rows, title))
    cost = flight_record_cost(a.flight_iterations)
    if cost is not None:
        print()
        print(table(["flight record", "ns per compute action", "ns per message"], [["its writes alone", *cost]],
                    f"native loop with and without the record's writes, best of 7 x {a.flight_iterations:,}; "
                    "a message: posted, waited for, completed (below 0: not measurable)"))
    if a.plot:
        bar_plot(a.plot, [r[0] for r in rows], {"plain PyTorch": [r[3] for r in rows], "pipecore": [r[2] for r in rows]},
                 "ms / step", title)


if __name__ == "__main__":
    main()
