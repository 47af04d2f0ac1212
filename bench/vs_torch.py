"""Step time: pipecore against torch.distributed.pipelining, side by side in one run.

The same stage modules, the same schedule and the same gloo group run through both, in
alternating timed blocks; the table gives the median ms/step of each and torch/pipecore, and
each one's first step (shapes found: torch infers them on meta tensors, pipecore learns them from
that step's own forwards, each receive posted at its action).

A third side is what a user who wrote the schedule by hand would get: a loop with no framework that
runs the lowered schedule's actions in the same order with torch.distributed's own `isend`/`irecv`
(a receive posted at its RECV action and waited for where its tensor is first used, sends waited for
at the step's end; I computes the weight gradients too and W nothing, which puts the zero-bubble
schedules' weight gradients on their critical path). It is a plain baseline, not a lower bound:
pipecore posts receives ahead and hands sends off. Its gradients are checked against pipecore's
before timing, so both sides compute the same step.

    python bench/vs_torch.py                      # overhead-dominated: 2 ranks, 32 microbatches, width 64
    python bench/vs_torch.py --width 1024 --rows 256   # larger stages
    python bench/vs_torch.py --plot out.png
"""

from __future__ import annotations

import argparse
import copy
import time

import _harness  # noqa: F401  (puts the repo on sys.path)
from _harness import bar_plot, median_ms, spawn, table, timed_blocks

from pipecore.executor.native import DEFAULT_RECV_WINDOW

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]
TORCH_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
               "interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


def _hand_written_step(rank, actions, stage_rank, modules, loss_fn, xs, ys):
    """One step of `actions` (this rank's lowered program) as plain PyTorch and torch.distributed."""
    import torch
    import torch.distributed as dist

    from pipecore import Kind

    num_stages, m = len(stage_rank), len(xs)
    last = num_stages - 1
    held = {}     # (stage, microbatch) -> (input, output or loss)
    inbox = {}    # (Kind.RECV_F or RECV_B, stage, microbatch) -> (buffer, Work)
    grads = {}    # (stage, microbatch) -> the input gradient computed by its backward
    sends = []

    def tag(grad, stage, k):  # one per message: gloo matches a pair's messages by tag
        return (int(grad) * num_stages + stage) * m + k

    def received(kind, stage, k):
        buf, work = inbox.pop((kind, stage, k))
        work.wait()
        return buf

    for action in actions:
        for leaf in action.leaves():
            kind, s, k = leaf.kind, leaf.stage, leaf.microbatch
            if kind in (Kind.RECV_F, Kind.RECV_B):
                buf = torch.empty_like(xs[k])  # every boundary carries one (rows, width) tensor here
                peer = stage_rank[s - 1] if kind is Kind.RECV_F else stage_rank[s + 1]
                inbox[(kind, s, k)] = (buf, dist.irecv(buf, peer, tag=tag(kind is Kind.RECV_B, s, k)))
            elif kind is Kind.F:
                if s == 0:
                    inp = xs[k]
                elif (Kind.RECV_F, s, k) in inbox:
                    inp = received(Kind.RECV_F, s, k).requires_grad_()
                else:  # the previous stage is on this rank
                    inp = held[(s - 1, k)][1].detach().requires_grad_()
                out = modules[s](inp)
                held[(s, k)] = (inp, loss_fn(out, ys[k]) / m if s == last else out)
            elif kind is Kind.SEND_F:
                sends.append(dist.isend(held[(s, k)][1].detach(), stage_rank[s + 1], tag=tag(False, s + 1, k)))
            elif kind in (Kind.B, Kind.I):
                inp, out = held.pop((s, k))
                if s == last:
                    grad = None
                elif (Kind.RECV_B, s, k) in inbox:
                    grad = received(Kind.RECV_B, s, k)
                else:
                    grad = grads.pop((s + 1, k))
                torch.autograd.backward(out, grad)
                if s > 0:
                    grads[(s, k)] = inp.grad
            elif kind is Kind.SEND_B:
                sends.append(dist.isend(grads.pop((s, k)), stage_rank[s - 1], tag=tag(True, s - 1, k)))
    for work in sends:
        work.wait()


def _bench_rank(rank, world, name, m, width, depth, rows, blocks, steps, recv_window):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import schedules as ts

    import pipecore as pc

    V = 1 if name in ("gpipe", "1f1b") else 2
    sched = pc.build_schedule(name, world, m, V)
    torch.manual_seed(0)
    model = [nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]) for _ in range(sched.num_stages)]
    mine = sched.rank_stages(rank)
    loss_fn = nn.MSELoss()
    dev = torch.device("cpu")
    # pipecore
    pstages = [pc.PipelineStage(copy.deepcopy(model[s]), s, sched.num_stages) for s in mine]
    pipe = pc.Pipeline(pstages, sched, m, loss_fn=loss_fn, recv_window=recv_window)
    # torch: same modules, same group
    tstages = [TorchStage(copy.deepcopy(model[s]), s, sched.num_stages, dev) for s in mine]
    cls = getattr(ts, TORCH_CLASS[name])
    tsched = cls(tstages[0] if V == 1 else tstages, m, loss_fn=loss_fn)
    x = torch.randn(rows, width)
    y = torch.randn(rows, width)
    first = sched.topology.stage_rank[0] == rank
    last = sched.topology.stage_rank[sched.num_stages - 1] == rank

    def run_torch():
        kwargs = {"target": y} if last else {}
        tsched.step(*((x,) if first else ()), **kwargs)

    def run_pipecore():
        pipe.step(*((x,) if first else ()), target=y if last else None)

    # the hand-written loop: its own copy of the modules, the lowered program pipecore runs
    hand_modules = {s: copy.deepcopy(model[s]) for s in mine}
    lowered = sched.lower().actions[rank]
    xs, ys = x.tensor_split(m), y.tensor_split(m)

    def run_hand_written():
        _hand_written_step(rank, lowered, sched.topology.stage_rank, hand_modules, loss_fn, xs, ys)

    first_ms = {}
    for label, fn in (("torch", run_torch), ("pipecore", run_pipecore)):  # first steps: shapes found
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        first_ms[label] = (time.perf_counter() - t0) * 1e3
    for mod in [st.module for st in pstages] + list(hand_modules.values()):  # both compute the same gradients
        mod.zero_grad(set_to_none=True)
    run_pipecore()  # (after pipecore's first step, which the table times)
    run_hand_written()
    for st, s in zip(pstages, mine):
        for a, b in zip(st.module.parameters(), hand_modules[s].parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    run_torch()  # warm up each once more (allocator)
    times = timed_blocks({"torch": run_torch, "pipecore": run_pipecore, "hand-written": run_hand_written},
                         blocks, steps, dist.barrier)
    return {**{k: median_ms(v) for k, v in times.items()}, **{f"{k} first": v for k, v in first_ms.items()}}


def run(schedules, world, m, width, depth, rows, blocks, steps, recv_window):
    out = []
    for name in schedules:
        per_rank = spawn(_bench_rank, world, name, m, width, depth, rows, blocks, steps, recv_window)
        t, p, h, t1, p1 = (max(r[k] for r in per_rank)
                           for k in ("torch", "pipecore", "hand-written", "torch first", "pipecore first"))
        out.append((name, t, p, h, t1, p1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="*", default=SCHEDULES, choices=SCHEDULES)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=1, help="Linear layers per stage")
    ap.add_argument("--rows", type=int, default=64, help="batch rows (split into the microbatches)")
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--recv-window", type=int, default=DEFAULT_RECV_WINDOW,
                    help="pipecore's receives posted ahead (0: each at its RECV action, as torch does)")
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    rows = run(a.schedules, a.ranks, a.microbatches, a.width, a.depth, a.rows, a.blocks, a.steps, a.recv_window)
    title = (f"{a.ranks} gloo ranks, {a.microbatches} microbatches, {a.depth} x Linear({a.width}) per stage, "
             f"batch {a.rows}; recv_window {a.recv_window}; median of {a.blocks} alternating blocks of {a.steps} steps")
    print(table(["schedule", "torch ms", "pipecore ms", "hand-written ms", "pipecore/torch", "pipecore/hand-written",
                 "torch 1st ms", "pipecore 1st ms", "1st pipecore/torch"],
                [[n, t, p, h, f"{p / t:.2f}x", f"{p / h:.2f}x", t1, p1, f"{p1 / t1:.2f}x"]
                 for n, t, p, h, t1, p1 in rows], title))
    if a.plot:
        bar_plot(a.plot, [r[0] for r in rows], {"torch.distributed.pipelining": [r[1] for r in rows],
                                                "pipecore": [r[2] for r in rows],
                                                "hand-written loop": [r[3] for r in rows]}, "ms / step (median)", title)


if __name__ == "__main__":
    main()
