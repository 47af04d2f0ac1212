"""pipecore demo: train a small language model with a real multi-process pipeline on this
machine's CPUs (gloo), then check the result against single-process training.

    python examples/train_demo.py [--schedule interleaved_1f1b] [--ranks 2] [--microbatches 8] [--steps 40]
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pipecore as pc  # noqa: E402

VOCAB, SEQ, WIDTH = 32, 16, 64


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)  # token mixing stand-in: cheap, deterministic
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.mix(self.norm1(x)).cumsum(dim=1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.block = Block(WIDTH)

    def forward(self, ids):
        return self.block(self.tok(ids) + self.pos)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block(WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.out(self.norm(self.block(x)))


def build_model(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    if num_stages == 1:
        return [nn.Sequential(Embed(), Head())]
    return [Embed()] + [Block(WIDTH) for _ in range(num_stages - 2)] + [Head()]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(step: int, rows: int):
    """Sequences that count up modulo VOCAB from a random start: easy to learn, so the loss drops."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (rows, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def worker(rank: int, args, port: int, result_queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    schedule = pc.build_schedule(args.schedule, args.ranks, args.microbatches, args.stages_per_rank)
    topo = schedule.topology
    n_model = args.ranks if topo.style == "dualpipe" else schedule.num_stages
    model = build_model(n_model)
    stages = [pc.PipelineStage(copy.deepcopy(model[topo.model_stage[s]]), s, schedule.num_stages)
              for s in schedule.rank_stages(rank)]
    pipe = pc.Pipeline(stages, schedule, args.microbatches, loss_fn=lm_loss)
    params = [p for s in stages for p in s.module.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    if rank == 0:
        print(f"pipecore demo: {args.schedule}, {args.ranks} ranks x {len(stages)} stage(s), "
              f"{args.microbatches} microbatches of {args.batch // args.microbatches} sequences, "
              f"{sum(p.numel() for s in model for p in s.parameters()):,} parameters", flush=True)
    times = []
    for step in range(args.steps):
        x, y = batches(step, args.batch)
        losses: list = []
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None, losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if pipe.has_last and (step % 5 == 0 or step == args.steps - 1):
            vals = [float(v) for v in losses if v is not None]
            print(f"  step {step:3d}  loss {sum(vals) / len(vals):.4f}  ({times[-1] * 1e3:.1f} ms/step)", flush=True)
    # the same training in one process must end with the same weights
    if args.check:
        ref = build_model(n_model)
        ref_opt = torch.optim.AdamW([p for m in ref for p in m.parameters()], lr=3e-3)
        for step in range(args.steps):
            x, y = batches(step, args.batch)
            h = x
            for m in ref:
                h = m(h)
            lm_loss(h, y).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        worst = 0.0
        for s in stages:
            for p, q in zip(s.module.parameters(), ref[topo.model_stage[s.stage_index]].parameters()):
                worst = max(worst, ((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item())
        result_queue.put((rank, worst, sorted(times)[len(times) // 2]))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default="interleaved_1f1b", choices=pc.SCHEDULES)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--stages-per-rank", type=int, default=None)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the single-process comparison")
    args = ap.parse_args()
    if args.schedule == "forward_only":
        ap.error("forward_only does not train; pick a training schedule")
    pc.build_schedule(args.schedule, args.ranks, args.microbatches, args.stages_per_rank)  # clear error early
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    if args.check:
        got = sorted(results.get() for _ in procs)
        worst = max(w for _, w, _ in got)
        print(f"weights after {args.steps} steps vs single-process training: max relative difference {worst:.2e} "
              f"({'equal' if worst < 1e-4 else 'DIFFERENT'}); median step {got[0][2] * 1e3:.1f} ms")
        if worst >= 1e-4:
            sys.exit(1)


if __name__ == "__main__":
    main()
