"""Microbatches of their own lengths (`Pipeline.step_microbatches`) against microbatches padded to
the longest length, side by side in one run.

2 gloo ranks; each stage a causal self-attention + MLP block (width 128) on 2 rows per microbatch;
8 microbatches whose lengths are drawn uniformly between 25% and 100% of `--max-len`. Three kinds
of step, in alternating blocks:

  padded     every microbatch padded to --max-len (one shape: the steady path)
  variable   new lengths at every step (each step learns its shapes: pipecore/runtime/discovery.py)
  repeating  one draw of lengths, the same at every step (shapes learnt once)

The table gives each kind's median step, padded/variable (how much computing no padding saves)
and variable/repeating (what new shapes at every step cost over shapes that repeat).

    python bench/variable_shapes.py [--schedules 1f1b zbv] [--max-len 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _harness  # noqa: F401  (puts the repo on sys.path)
from _harness import spawn, table

SCHEDULES = ["1f1b", "interleaved_1f1b", "zbv"]
KINDS = ("padded", "variable", "repeating")


def _rank(rank, world, name, m, max_len, width, blocks, steps):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import pipecore as pc

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 4, width // 4).permute(2, 0, 3, 1, 4)
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
            return x + self.mlp(x)

    sched = pc.build_schedule(name, world, m)
    torch.manual_seed(0)
    modules = [Block() for _ in range(sched.num_stages)]
    stages = [pc.PipelineStage(modules[s], s, sched.num_stages) for s in sched.rank_stages(rank)]
    loss_fn = lambda out, y: ((out - y) ** 2).sum()  # noqa: E731  (summed: loss_divisor makes it a mean)
    pipe = pc.Pipeline(stages, sched, m, loss_fn=loss_fn)
    rng = torch.Generator().manual_seed(1)

    def draw():
        return torch.randint(max_len // 4, max_len + 1, (m,), generator=rng).tolist()

    fixed = draw()

    def step(kind):
        lengths = [max_len] * m if kind == "padded" else fixed if kind == "repeating" else draw()
        xs = [torch.randn(2, n, width) for n in lengths]
        pipe.step_microbatches([(x,) for x in xs] if pipe.has_first else None,
                               target_mbs=[torch.zeros_like(x) for x in xs] if pipe.has_last else None,
                               loss_divisor=float(sum(x.numel() for x in xs)))

    for kind in KINDS:  # warm-up: each kind's first step learns its shapes
        step(kind)
    times = {k: [] for k in KINDS}
    for _ in range(blocks):
        for kind in KINDS:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(kind)
            dist.barrier()
            times[kind].append((time.perf_counter() - t0) / steps)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()} | {"fill": sum(fixed) / (m * max_len)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="*", default=SCHEDULES, choices=SCHEDULES)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="steps per timed block")
    a = ap.parse_args(argv)
    rows = []
    for name in a.schedules:
        per_rank = spawn(_rank, 2, name, a.microbatches, a.max_len, a.width, a.blocks, a.steps)
        r = max(per_rank, key=lambda p: p["variable"])
        rows.append([name, r["padded"], r["variable"], r["repeating"], f"{r['padded'] / r['variable']:.2f}x",
                     f"{r['variable'] / r['repeating']:.2f}x"])
    title = (f"2 gloo ranks, attention+MLP stages (width {a.width}), {a.microbatches} microbatches of 2 rows, lengths "
             f"uniform in [{a.max_len // 4}, {a.max_len}]; median ms per step of {a.blocks} alternating blocks of "
             f"{a.steps} steps, slowest rank")
    print(table(["schedule", "padded ms", "variable ms", "repeating ms", "padded/variable", "variable/repeating"],
                rows, title))


if __name__ == "__main__":
    main()
