"""Where a step's host time goes: `Pipeline.profile()` over traced steps, per step and per action.

Each configuration runs `--steps` traced steps after two warm-up steps; every rank reports the
median of each part over those steps, and the table shows the slowest rank (the one with the
longest step) per configuration. The parts add up to the step:

    before the run   Python before the executor runs: input checks, microbatch split, plans, .grad set aside
    model forward    the stages' forwards and loss_fn, inside the forward callbacks
    forward Python   the rest of the forward callbacks: inputs decoded, messages made, loss weights
    autograd         the autograd engine for B, I and W (the stages' backward kernels included)
    C++ loop         the executor's own dispatch, bookkeeping, unframing, freeing
    posting          framing and posting sends and receives
    waiting          for messages, postings, the send budget and the step's last sends
    after the run    Python after it: gradient finalisation, outputs merged

A steady step runs no collective (the ranks agree again only when a batch changes shape), so the
fixed per-step work is the two Python rows. "per action" divides by the program's actions (sends
and receives included); `untraced ms` is the median step of the same Pipeline with tracing off,
timed in alternation with the traced steps, so the cost of tracing itself is visible.

    python bench/step_profile.py                        # overhead, wire (1f1b, interleaved_1f1b), gpt
    python bench/step_profile.py --configs overhead
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import _harness  # noqa: F401  (puts the repo on sys.path)
from _harness import ROOT, spawn, table

PARTS = [("before the run", "before_run"), ("model forward", "model"), ("forward Python", "forward_python"),
         ("autograd", "backward"), ("C++ loop", "loop"), ("posting", "post"), ("waiting", "wait"),
         ("after the run", "after_run")]
CONFIGS = {
    # name: (ranks, schedule, stages per rank, microbatches, what)
    "overhead": (1, "interleaved_1f1b", 4, 64, "1 rank, 4 stages of Linear(8), batch 64"),
    "wire-1f1b": (2, "1f1b", 1, 32, "2 gloo ranks, Linear(64) stages, batch 64"),
    "wire-interleaved": (2, "interleaved_1f1b", 2, 32, "2 gloo ranks, Linear(64) stages, batch 64"),
    "gpt-1f1b": (2, "1f1b", 1, 8, "example GPT (width 128, 6 layers, seq 64), 2 gloo ranks, 32 rows"),
    "gpt-zbv": (2, "zbv", 2, 8, "example GPT (width 128, 6 layers, seq 64), 2 gloo ranks, 32 rows"),
}


def _linear_pipeline(rank, name, V, m, width, rows):
    import torch
    from torch import nn

    import pipecore as pc

    world = torch.distributed.get_world_size()
    sched = pc.build_schedule(name, world, m, V)
    torch.manual_seed(0)
    modules = [nn.Linear(width, width) for _ in range(sched.num_stages)]
    stages = [pc.PipelineStage(modules[s], s, sched.num_stages) for s in sched.rank_stages(rank)]
    pipes = [pc.Pipeline(stages, sched, m, loss_fn=nn.MSELoss(), trace=trace) for trace in (True, False)]
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    first, last = sched.topology.stage_rank[0] == rank, sched.topology.stage_rank[-1] == rank
    return pipes, lambda pipe: pipe.step(*((x,) if first else ()), target=y if last else None)


def _gpt_pipeline(rank, name, V, m):
    import pipecore as pc

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPTConfig, build_gpt, get_batch, lm_loss, pipeline_stages, stdlib_bytes

    world = __import__("torch").distributed.get_world_size()
    sched = pc.build_schedule(name, world, m, V)
    cfg = GPTConfig(vocab=256, seq_len=64, width=128, layers=6, heads=4)
    stages = pipeline_stages(build_gpt(cfg, seed=0), sched, rank)
    pipes = [pc.Pipeline(stages, sched, m, loss_fn=lm_loss, trace=trace) for trace in (True, False)]
    x, y = get_batch(stdlib_bytes(100_000), 0, 32, cfg.seq_len)
    first, last = sched.topology.stage_rank[0] == rank, sched.topology.stage_rank[-1] == rank
    return pipes, lambda pipe: pipe.step(*((x,) if first else ()), target=y if last else None)


def _profile_rank(rank, world, config, steps):
    import torch.distributed as dist

    _, name, V, m, _ = CONFIGS[config]
    if config.startswith("gpt"):
        (traced, plain), step = _gpt_pipeline(rank, name, V, m)
    elif config == "overhead":
        (traced, plain), step = _linear_pipeline(rank, name, V, m, 8, m)
    else:
        (traced, plain), step = _linear_pipeline(rank, name, V, m, 64, 64)
    for pipe in (traced, plain, traced, plain):  # first steps learn shapes; then warm
        step(pipe)
    profiles, untraced = [], []
    for _ in range(steps):
        dist.barrier()
        step(traced)
        p = traced.profile()
        p["forward_python"] = p["forward"] - p["model"]
        profiles.append(p)
        dist.barrier()
        t0 = time.perf_counter()
        step(plain)
        untraced.append((time.perf_counter() - t0) * 1e6)
    med = {k: statistics.median(p[k] for p in profiles) for k in profiles[0]}
    med["untraced"] = statistics.median(untraced)
    return med


def profile(config: str, steps: int) -> dict:
    per_rank = spawn(_profile_rank, CONFIGS[config][0], config, steps)
    return max(per_rank, key=lambda p: p["step"])


def render(config: str, p: dict, steps: int) -> str:
    ranks, name, _, m, what = CONFIGS[config]
    n = p["actions"]
    rows = [[label, p[key] / 1e3, p[key] / n, f"{100 * p[key] / p['step']:.0f}%"] for label, key in PARTS]
    rows.append(["step (traced)", p["step"] / 1e3, p["step"] / n, "100%"])
    rows.append(["step (untraced)", p["untraced"] / 1e3, p["untraced"] / n, ""])
    title = (f"{config}: {name}, {m} microbatches, {what}; {int(n)} actions per step on the slowest rank; "
             f"median of {steps} steps")
    return table(["part", "ms / step", "us / action", "share"], rows, title)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args(argv)
    for config in a.configs:
        print(render(config, profile(config, a.steps), a.steps))
        print()


if __name__ == "__main__":
    main()
