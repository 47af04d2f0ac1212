"""Drop-in step time: a loop written against torch.distributed.pipelining, run as written and with its
imports switched to pipecore.compat, side by side in one run.

The loop is tests/torch_style_loop.py (TorchTitan's shape: a GPT cut into stage chunks, the schedule
class from get_schedule_class, step(return_outputs=False, loss_kwargs=...), AdamW). Both versions
train their own copy of the same model on the same gloo group, in alternating timed blocks of
optimizer steps; the table gives the median ms/step of each and pipecore/torch (below 1: pipecore
is faster).

    python bench/compat.py                             # 2 ranks, 8 microbatches, every shared schedule
    python bench/compat.py --ranks 4 --dim 128 --schedules 1F1B ZBVZeroBubble
    python bench/compat.py --plot out.png
"""

from __future__ import annotations

import argparse
import os
import sys

import _harness  # noqa: F401  (puts the repo on sys.path)
from _harness import bar_plot, median_ms, spawn, table, timed_blocks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def _bench_rank(rank, world, name, m, dim, seq, rows, blocks, steps):
    import torch.distributed as dist

    from compat_cases import load_loop

    runs, batch = {}, None
    for api in ("torch", "pipecore"):
        loop = load_loop(api)
        loop.DIM, loop.SEQ = dim, seq  # the model's size (module constants the loop reads)
        runs[api] = (loop, loop.Run(name, m, seed=0))
        batch = loop.batches(1, rows, seed=1)[0]  # (tokens, labels, pos_bias)
    assert type(runs["pipecore"][1].schedule).__module__ == "pipecore.compat.schedules"
    step = {api: (lambda run=run: run.train_step(*batch)) for api, (_, run) in runs.items()}
    for fn in step.values():  # first steps (shapes found) and a warm-up step each
        fn()
        fn()
    times = timed_blocks(step, blocks, steps, dist.barrier)
    return {api: median_ms(t) for api, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="*", default=SCHEDULES, choices=SCHEDULES)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64, help="model width")
    ap.add_argument("--seq", type=int, default=32, help="sequence length")
    ap.add_argument("--rows", type=int, default=16, help="batch rows (split into the microbatches)")
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per timed block")
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    rows = []
    for name in a.schedules:
        per_rank = spawn(_bench_rank, a.ranks, name, a.microbatches, a.dim, a.seq, a.rows, a.blocks, a.steps)
        t, p = (max(r[k] for r in per_rank) for k in ("torch", "pipecore"))
        rows.append([name, t, p, f"{p / t:.2f}x"])
    title = (f"{a.ranks} gloo ranks, {a.microbatches} microbatches, GPT dim {a.dim} seq {a.seq}, batch {a.rows}, "
             f"2 layers per stage; median of {a.blocks} alternating blocks of {a.steps} optimizer steps")
    print(table(["schedule", "torch ms", "pipecore ms", "pipecore/torch"], rows, title))
    if a.plot:
        bar_plot(a.plot, [r[0] for r in rows], {"torch.distributed.pipelining": [r[1] for r in rows],
                                                "pipecore.compat": [r[2] for r in rows]}, "ms / step (median)", title)


if __name__ == "__main__":
    main()
