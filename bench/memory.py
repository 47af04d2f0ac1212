"""Peak memory per rank: pipecore (freeing sent outputs, and with freeing off) against
torch.distributed.pipelining on the same schedule and stage modules.

Each variant runs in fresh processes. On CPU the measure is the peak resident set size during the
first steps above the resident set before them (torch allocates persistent receive buffers in its
first step, so it is included), with glibc told to serve large
blocks by mmap so that freed tensors leave the resident set at once.

    python bench/memory.py [--width 1024] [--rows 256] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import copy
import os

import _harness  # noqa: F401
from _harness import bar_plot, spawn, table
from vs_torch import TORCH_CLASS

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zbv"]


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current RSS
        f.write("5")


def _peak_rank(rank, world, variant, name, m, width, rows, steps):
    import torch
    from torch import nn

    import pipecore as pc

    V = 1 if name in ("gpipe", "1f1b") else 2
    sched = pc.build_schedule(name, world, m, V)
    torch.manual_seed(0)
    model = [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
             for _ in range(sched.num_stages)]
    mine = sched.rank_stages(rank)
    loss_fn = nn.MSELoss()
    first = sched.topology.stage_rank[0] == rank
    last = sched.topology.stage_rank[sched.num_stages - 1] == rank
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    if variant == "torch":
        from torch.distributed.pipelining import PipelineStage as TorchStage
        from torch.distributed.pipelining import schedules as ts

        stages = [TorchStage(copy.deepcopy(model[s]), s, sched.num_stages, torch.device("cpu")) for s in mine]
        runner = getattr(ts, TORCH_CLASS[name])(stages[0] if V == 1 else stages, m, loss_fn=loss_fn)

        def step():
            runner.step(*((x,) if first else ()), **({"target": y} if last else {}))
    else:
        stages = [pc.PipelineStage(copy.deepcopy(model[s]), s, sched.num_stages) for s in mine]
        pipe = pc.Pipeline(stages, sched, m, loss_fn=loss_fn)
        pipe._executor.set_free_outputs(variant == "pipecore")

        def step():
            pipe.step(*((x,) if first else ()), target=y if last else None)
    for s in model:
        for p in s.parameters():
            p.grad = torch.zeros_like(p)  # so gradients do not count as step memory
    # what a first step imports, imported before measuring (torch allocates its receive buffers
    # once, in the first step, so the first step is measured too)
    import torch.distributed.pipelining  # noqa: F401
    import torch.func  # noqa: F401
    import gc

    gc.collect()
    base = _status_mib("VmRSS")
    _reset_peak()
    for _ in range(steps):
        step()
    return _status_mib("VmHWM") - base


def main(argv=None):
    # Large blocks straight from mmap, returned on free: the resident set then follows live tensors
    # instead of what glibc's heap keeps cached.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="*", default=SCHEDULES, choices=SCHEDULES)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    act_mib = a.rows // a.microbatches * a.width * 4 / 2**20
    rows = []
    for name in a.schedules:
        res = {v: spawn(_peak_rank, a.ranks, v, name, a.microbatches, a.width, a.rows, a.steps)
               for v in ("torch", "pipecore-keep", "pipecore")}
        for r in range(a.ranks):
            t, k, p = res["torch"][r], res["pipecore-keep"][r], res["pipecore"][r]
            rows.append([name, r, t, k, p, f"{p / t:.2f}x"])
    title = (f"peak RSS during the first {a.steps} steps above the RSS before them; {a.ranks} ranks, {a.microbatches} microbatches, "
                f"stage = Linear-GELU-Linear({a.width}), one activation = {act_mib:.1f} MiB")
    print(table(["schedule", "rank", "torch MiB", "pipecore no-free MiB", "pipecore MiB", "pipecore/torch"], rows, title))
    if a.plot:
        bar_plot(a.plot, [f"{r[0]} r{r[1]}" for r in rows], {"torch": [r[2] for r in rows],
                 "pipecore, freeing off": [r[3] for r in rows], "pipecore": [r[4] for r in rows]}, "peak MiB", title)


if __name__ == "__main__":
    main()
