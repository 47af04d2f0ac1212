"""Peak memory per rank: pipecore (sent messages freed once sent, and with that off: kept to the
end of the step) against torch.distributed.pipelining on the same schedule and stage modules.

`--stage linear` makes every stage one Linear: a first stage then saves only the batch itself for
its backward, so what it holds during a step is the activations it sent and has not freed (GPipe:
all of them until its first backward, in torch). `--no-outputs` runs both with
`step(..., return_outputs=False)`: the last stage drops each output once its loss is computed.

Each variant runs in fresh processes. On CPU the measure is the peak resident set size during the
first steps above the resident set before them (torch allocates persistent receive buffers in its
first step, so it is included), with glibc told to serve large
blocks by mmap so that freed tensors leave the resident set at once. With --device cuda (NCCL, one
GPU per rank) it is the caching allocator's peak of allocated bytes above what was allocated before.

    python bench/memory.py [--width 1024] [--rows 256] [--microbatches 8] [--device cuda]
    python bench/memory.py --stage linear --schedules gpipe --microbatches 16 --rows 16384
    python bench/memory.py --schedules 1f1b --no-outputs
"""

from __future__ import annotations

import argparse
import contextlib
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


def _peak_rank(rank, world, variant, name, m, width, rows, steps, device="cpu", stage="mlp", outputs=True):
    import torch
    from torch import nn

    import pipecore as pc

    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    V = 1 if name in ("gpipe", "1f1b") else 2
    sched = pc.build_schedule(name, world, m, V)
    torch.manual_seed(0)
    if stage == "linear":
        model = [nn.Linear(width, width).to(dev) for _ in range(sched.num_stages)]
    else:
        model = [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)).to(dev)
                 for _ in range(sched.num_stages)]
    mine = sched.rank_stages(rank)
    loss_fn = nn.MSELoss()
    first = sched.topology.stage_rank[0] == rank
    last = sched.topology.stage_rank[sched.num_stages - 1] == rank
    x, y = torch.randn(rows, width, device=dev), torch.randn(rows, width, device=dev)
    if variant == "torch":
        from torch.distributed.pipelining import PipelineStage as TorchStage
        from torch.distributed.pipelining import schedules as ts

        stages = [TorchStage(copy.deepcopy(model[s]), s, sched.num_stages, dev) for s in mine]
        runner = getattr(ts, TORCH_CLASS[name])(stages[0] if V == 1 else stages, m, loss_fn=loss_fn)

        def step():
            runner.step(*((x,) if first else ()), **({"target": y} if last else {}), return_outputs=outputs)
    else:
        stages = [pc.PipelineStage(copy.deepcopy(model[s]), s, sched.num_stages) for s in mine]
        pipe = pc.Pipeline(stages, sched, m, loss_fn=loss_fn)
        pipe.executor.set_free_outputs(variant == "pipecore")

        def step():
            pipe.step(*((x,) if first else ()), target=y if last else None, return_outputs=outputs)
    for s in model:
        for p in s.parameters():
            p.grad = torch.zeros_like(p)  # so gradients do not count as step memory
    # what a first step imports, imported before measuring (torch allocates its receive buffers
    # once, in the first step, so the first step is measured too)
    import torch.distributed.pipelining  # noqa: F401
    import torch.func  # noqa: F401
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20 - base
    base = _status_mib("VmRSS")
    _reset_peak()
    for _ in range(steps):
        step()
    return _status_mib("VmHWM") - base


# glibc's settings (read at a process's start) for large blocks straight from mmap, returned on free
RESIDENT_FOLLOWS_TENSORS = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def resident_follows_tensors() -> None:
    """Large blocks straight from mmap, returned on free: the resident set then follows live tensors
    instead of what glibc's heap keeps cached (inherited by the ranks spawned afterwards)."""
    for k, v in RESIDENT_FOLLOWS_TENSORS.items():
        os.environ.setdefault(k, v)


@contextlib.contextmanager
def resident_follows_tensors_in_spawned():
    """Within: processes spawned get `resident_follows_tensors`' setting (glibc reads it at start);
    this process's environment is restored after."""
    saved = {k: os.environ.get(k) for k in RESIDENT_FOLLOWS_TENSORS}
    resident_follows_tensors()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv=None):
    resident_follows_tensors()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="*", default=SCHEDULES, choices=SCHEDULES)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: NCCL, one GPU per rank, allocator statistics")
    ap.add_argument("--stage", choices=["mlp", "linear"], default="mlp",
                    help="every stage Linear-GELU-Linear (mlp) or one Linear")
    ap.add_argument("--no-outputs", action="store_true", help="step(..., return_outputs=False) in both")
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            ap.error("--device cuda needs a CUDA build of torch and a GPU; this machine has neither")
    backend = "nccl" if a.device == "cuda" else "gloo"
    act_mib = a.rows // a.microbatches * a.width * 4 / 2**20
    rows = []
    for name in a.schedules:
        res = {v: spawn(_peak_rank, a.ranks, v, name, a.microbatches, a.width, a.rows, a.steps, a.device,
                        a.stage, not a.no_outputs, backend=backend)
               for v in ("torch", "pipecore-keep", "pipecore")}
        for r in range(a.ranks):
            t, k, p = res["torch"][r], res["pipecore-keep"][r], res["pipecore"][r]
            rows.append([name, r, t, k, p, f"{p / t:.2f}x"])
    measure = ("peak allocated CUDA memory" if a.device == "cuda" else "peak RSS")
    stage = f"Linear({a.width})" if a.stage == "linear" else f"Linear-GELU-Linear({a.width})"
    title = (f"{measure} during the first {a.steps} steps above what was there before them; {a.ranks} ranks, "
             f"{a.microbatches} microbatches, stage = {stage}, one activation = {act_mib:.1f} MiB"
             f"{', return_outputs=False' if a.no_outputs else ''}")
    print(table(["schedule", "rank", "torch MiB", "pipecore, sends kept MiB", "pipecore MiB", "pipecore/torch"], rows,
                title))
    if a.plot:
        bar_plot(a.plot, [f"{r[0]} r{r[1]}" for r in rows], {"torch": [r[2] for r in rows],
                 "pipecore, sends kept": [r[3] for r in rows], "pipecore": [r[4] for r in rows]}, "peak MiB", title)


if __name__ == "__main__":
    main()
