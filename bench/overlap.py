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

    python bench/overlap.py [--schedule 1f1b] [--forward-ms 4] [--mib 4] [--microbatches 8]
"""

from __future__ import annotations

import argparse
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
    print(table(["schedule", "F/B ms", "msg ms", "ideal ms", "serialized ms", "measured ms", "measured/ideal", "hidden"],
                rows, title))
    if a.plot:
        bar_plot(a.plot, [r[0] for r in rows], {"ideal (simulated)": [r[3] for r in rows],
                 "serialized (simulated)": [r[4] for r in rows], "measured": [r[5] for r in rows]}, "ms / step", title)


if __name__ == "__main__":
    main()
