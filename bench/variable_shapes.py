"""Microbatches of their own lengths (`Pipeline.step_microbatches`) against microbatches padded to
the longest length, and against Megatron-core's scheme for variable lengths, side by side in one run.

2 gloo ranks; each stage a causal self-attention + MLP block (width 128) on 2 rows per microbatch;
8 microbatches whose lengths are drawn uniformly between 25% and 100% of `--max-len`. Kinds of
step, in alternating blocks:

  padded     every microbatch padded to --max-len (one shape)
  variable   new lengths at every step (messages carry their shapes: csrc/comm.h)
  repeating  one draw of lengths, the same at every step
  shuffled   that draw's lengths in a new order at every step: every microbatch's shape changes,
             the step's compute stays the repeating step's
  megatron   (1f1b only) the variable steps' lengths, through an emulation of Megatron-core's
             1F1B with variable_seq_lengths: before each transfer the sender sends the tensor's
             shape and the receiver waits for it before it posts the data's receive

The table gives each kind's median step, padded/variable (what not computing padding saves), the
same ratio as the simulator predicts it for the timed steps' lengths with no executor cost
(`Schedule.simulate` with a forward cost per microbatch, from the block's multiply-adds),
shuffled/repeating (what shapes that change at every step cost over shapes that repeat, for the
same compute; the target is at most 1.1x), megatron/variable, and point-to-point sends per
transfer on the steady path (pipecore's variable steps against its padded ones: the same means no
extra message; messages that outgrew their capacity and went again are counted apart, and occur
only while the longest length grows).

    python bench/variable_shapes.py [--schedules 1f1b zbv] [--max-len 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _harness  # noqa: F401  (puts the repo on sys.path)
from _harness import spawn, table

SCHEDULES = ["1f1b", "interleaved_1f1b", "zbv"]
KINDS = ("padded", "variable", "repeating", "shuffled")


def _megatron_1f1b(rank, world, module, xs, ys, divisor, counts):
    """One step of Megatron-core's 1F1B (warmup, steady 1F1B, cooldown; its send_forward_recv_backward
    and send_backward_recv_forward pairings), each transfer preceded by a shape exchange as
    variable_seq_lengths does (p2p_communication._communicate_shapes): the receiver learns the shape,
    then posts the data's receive."""
    import torch
    import torch.distributed as dist

    first, last = rank == 0, rank == world - 1

    def communicate(send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        ops, shapes = [], {}
        for peer, t in ((rank + 1, send_next), (rank - 1, send_prev)):
            if t is not None:
                ops.append(dist.P2POp(dist.isend, torch.tensor(t.shape, dtype=torch.long), peer))
        for peer, want in ((rank - 1, recv_prev), (rank + 1, recv_next)):
            if want:
                shapes[peer] = torch.empty(3, dtype=torch.long)
                ops.append(dist.P2POp(dist.irecv, shapes[peer], peer))
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        ops, got = [], {}
        for peer, t in ((rank + 1, send_next), (rank - 1, send_prev)):
            if t is not None:
                ops.append(dist.P2POp(dist.isend, t.detach().contiguous(), peer))
                counts[0] += 1
                counts[1] += 2  # the shape, then the data
        for peer, shape in shapes.items():
            got[peer] = torch.empty(shape.tolist())
            ops.append(dist.P2POp(dist.irecv, got[peer], peer))
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        return got.get(rank - 1), got.get(rank + 1)

    def forward(x, mb):
        if first:
            return module(xs[mb])
        return module(x)

    def backward(x, y, g, mb):
        if last:
            (((y - ys[mb]) ** 2).sum() / divisor).backward()
        else:
            y.backward(g)
        return None if first else x.grad

    m = len(xs)
    warm = min(world - rank - 1, m)
    stash = []
    nxt = 0
    for _ in range(warm):
        x = None if first else communicate(recv_prev=True)[0].requires_grad_()
        y = forward(x, nxt)
        communicate(send_next=None if last else y)
        stash.append((x, y, nxt))
        nxt += 1
    x = None
    if m - warm > 0 and not first:
        x = communicate(recv_prev=True)[0].requires_grad_()
    for i in range(m - warm):
        y = forward(x, nxt)
        stash.append((x, y, nxt))
        nxt += 1
        g = None if last else communicate(send_next=y, recv_next=True)[1]
        bx, by, bmb = stash.pop(0)
        gx = backward(bx, by, g, bmb)
        if i == m - warm - 1:
            x = None
            if not first:
                communicate(send_prev=gx)
        else:
            x = None if first else communicate(send_prev=gx, recv_prev=True)[0]
            if x is not None:
                x.requires_grad_()
    for _ in range(warm):
        g = None if last else communicate(recv_next=True)[1]
        bx, by, bmb = stash.pop(0)
        gx = backward(bx, by, g, bmb)
        if not first:
            communicate(send_prev=gx)


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
    # the variable steps' lengths, the same sequence for pipecore and the Megatron emulation
    draws = [draw() for _ in range(blocks * steps + 1)]
    kinds = KINDS + (("megatron",) if name == "1f1b" and world == 2 else ())
    used = {k: 0 for k in kinds}
    counts = {k: [0, 0, 0] for k in kinds}  # transfers, point-to-point sends, grown (sent again)

    def step(kind):
        if kind == "padded":
            lengths = [max_len] * m
        elif kind == "repeating":
            lengths = fixed
        elif kind == "shuffled":
            lengths = [fixed[i] for i in torch.randperm(m, generator=rng).tolist()]
        else:
            lengths = draws[used[kind] % len(draws)]
            used[kind] += 1
        xs = [torch.randn(2, n, width) for n in lengths]
        ys = [torch.zeros_like(x) for x in xs]
        tokens = float(sum(x.numel() for x in xs))
        if kind == "megatron":
            _megatron_1f1b(rank, world, modules[rank], xs, ys, tokens, counts[kind])
            for p in modules[rank].parameters():
                p.grad = None
            return
        pipe.step_microbatches([(x,) for x in xs] if pipe.has_first else None,
                               target_mbs=ys if pipe.has_last else None, loss_divisor=tokens)
        messages, parts, grown = pipe.executor.message_counts
        for k, v in enumerate((messages, parts, grown)):
            counts[kind][k] += v

    for kind in kinds:  # warm-up: the first step learns the plan
        step(kind)
    counts = {k: [0, 0, 0] for k in kinds}
    times = {k: [] for k in kinds}
    for _ in range(blocks):
        for kind in kinds:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(kind)
            dist.barrier()
            times[kind].append((time.perf_counter() - t0) / steps)
    return ({k: statistics.median(v) * 1e3 for k, v in times.items()} | {"fill": sum(fixed) / (m * max_len)} |
            {f"{k} counts": c for k, c in counts.items()} | {"timed draws": draws[1:used["variable"]]})


def simulated_gain(name, m, max_len, width, draws):
    """padded/variable as the simulator predicts it for the timed variable steps' lengths, with no
    executor cost: a microbatch's forward priced by its block's multiply-adds per row (the linears'
    12 width^2 and attention's 2 length width per token), its backward twice that."""
    import pipecore as pc

    sched = pc.build_schedule(name, 2, m)

    def cost(length):
        return length * (12 * width + 2 * length)

    padded = sched.simulate({"F": cost(max_len)}).makespan
    variable = [sched.simulate({"F": lambda stage, k, lengths=lengths: cost(lengths[k])}).makespan
                for lengths in draws]
    return padded / statistics.median(variable)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="*", default=SCHEDULES, choices=SCHEDULES)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="steps per timed block")
    a = ap.parse_args(argv)
    rows = []
    for name in a.schedules:
        per_rank = spawn(_rank, 2, name, a.microbatches, a.max_len, a.width, a.blocks, a.steps)
        r = max(per_rank, key=lambda p: p["variable"])

        def per_transfer(kind):
            transfers = sum(p[f"{kind} counts"][0] for p in per_rank)
            return sum(p[f"{kind} counts"][1] for p in per_rank) / max(transfers, 1)

        grown = sum(p["variable counts"][2] for p in per_rank)
        simulated = simulated_gain(name, a.microbatches, a.max_len, a.width, per_rank[0]["timed draws"])
        megatron = r.get("megatron")
        rows.append([name, r["padded"], r["variable"], r["repeating"], megatron if megatron else "-",
                     r["shuffled"], f"{r['padded'] / r['variable']:.2f}x", f"{simulated:.2f}x",
                     f"{r['shuffled'] / r['repeating']:.2f}x",
                     f"{megatron / r['variable']:.2f}x" if megatron else "-",
                     f"{per_transfer('padded'):.2f} / {per_transfer('variable'):.2f}"
                     + (f" / {per_transfer('megatron'):.2f}" if megatron else ""), grown])
    title = (f"2 gloo ranks, attention+MLP stages (width {a.width}), {a.microbatches} microbatches of 2 rows, lengths "
             f"uniform in [{a.max_len // 4}, {a.max_len}]; median ms per step of {a.blocks} alternating blocks of "
             f"{a.steps} steps, slowest rank; sends per transfer: padded / variable (/ megatron)")
    print(table(["schedule", "padded ms", "variable ms", "repeating ms", "megatron ms", "shuffled ms",
                 "padded/variable", "simulated", "shuffled/repeating", "megatron/variable", "sends per transfer",
                 "grown"], rows,
                title))


if __name__ == "__main__":
    main()
