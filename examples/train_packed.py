"""Train on packed sequences: documents of random length concatenated into rows, no padding.

    python examples/train_packed.py --ranks 2 --schedule zbv       # starts torchrun itself

Each microbatch is one row of documents (Python's own source files' bytes, cut at random lengths)
packed up to a random total length, so every microbatch has its own length, new at every step:
`pipe.step_microbatches` takes them as they are. Position ids restart at each document and
attention stays inside its document (a causal mask per document, from the document ids), so a
packed row computes what its documents would compute one by one. The document ids and position
ids travel from stage to stage beside the hidden states. The loss is the summed next-token cross
entropy within documents over the step's target tokens (`loss_divisor`). The first step's
gradients are checked against one process running the same microbatches.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pipecore as pc  # noqa: E402
from gpt import at_least_fp32, relative_difference, stdlib_bytes  # noqa: E402
from launch import init_gloo, under_torchrun  # noqa: E402

IGNORE = -100


class Embed(nn.Module):
    def __init__(self, width: int, max_len: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, width), nn.Embedding(max_len, width)

    def forward(self, ids, doc, pos):
        return self.tok(ids) + self.pos(pos), doc, pos


class Block(nn.Module):
    """Pre-norm attention + MLP; attention only within a document, causal."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h, doc, pos):
        b, t, w = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        same_doc = doc[:, :, None] == doc[:, None, :]
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        mask = (same_doc & causal)[:, None]  # (b, 1, t, t)
        h = h + self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, w))
        return h + self.mlp(self.norm2(h)), doc, pos


class Head(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, 256)

    def forward(self, h, doc, pos):
        return self.out(self.norm(h))


def build(args) -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same model
    return nn.Sequential(Embed(args.width, args.max_len), *[Block(args.width, 4) for _ in range(args.layers)],
                         Head(args.width))


def packed_row(text: torch.Tensor, g: torch.Generator, max_len: int, max_doc: int):
    """One row of documents packed to a random length in [max_len/4, max_len]: (ids, document ids,
    position ids, targets: the next byte within the same document, -100 at each document's end)."""
    total = int(torch.randint(max_len // 4, max_len + 1, (1,), generator=g))
    ids, doc, pos, target = [], [], [], []
    while len(ids) < total:
        n = min(int(torch.randint(2, max_doc + 1, (1,), generator=g)), total - len(ids))
        start = int(torch.randint(0, len(text) - n, (1,), generator=g))
        piece = text[start:start + n].long().tolist()
        d = len(set(doc))
        ids += piece
        doc += [d] * n
        pos += list(range(n))
        target += piece[1:] + [IGNORE]
    return tuple(torch.tensor(v).unsqueeze(0) for v in (ids, doc, pos, target))


def loss_fn(logits, target):
    return F.cross_entropy(at_least_fp32(logits.flatten(0, 1)), target.flatten(), ignore_index=IGNORE, reduction="sum")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default="1f1b", choices=[s for s in pc.SCHEDULES if s != "forward_only"])
    ap.add_argument("--ranks", type=int, default=2, help="processes to start when not launched by torchrun")
    ap.add_argument("--microbatches", type=int, default=8, help="packed rows per step")
    ap.add_argument("--max-len", type=int, default=128, help="the longest packed row")
    ap.add_argument("--max-doc", type=int, default=48, help="the longest document")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    under_torchrun(args.ranks)
    rank, world = init_gloo()
    sched = pc.build_schedule(args.schedule, world, args.microbatches)
    topo = sched.topology
    model = build(args)
    reference = copy.deepcopy(model)
    parts = pc.partition(model, len(set(topo.model_stage)), "parameters", verbose=rank == 0)
    stages = [pc.PipelineStage(copy.deepcopy(parts[topo.model_stage[s]]), s, sched.num_stages)
              for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    text = stdlib_bytes(500_000)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)  # the same rows on every rank
        rows = [packed_row(text, g, args.max_len, args.max_doc) for _ in range(args.microbatches)]
        tokens = sum(int((t != IGNORE).sum()) for *_, t in rows)
        losses: list = []
        pipe.step_microbatches([r[:3] for r in rows] if pipe.has_first else None,
                               target_mbs=[r[3] for r in rows] if pipe.has_last else None,
                               losses=losses, loss_divisor=tokens)
        if step == 0:  # one process, the same packed rows: every gradient of this rank's stages
            for ids, doc, pos, target in rows:
                (loss_fn(_run(reference, ids, doc, pos), target) / tokens).backward()
            name_of = {id(p): n for n, p in model.named_parameters()}
            worst = 0.0
            for s in stages:
                part = parts[topo.model_stage[s.stage_index]]
                for (_, p), (_, q) in zip(s.module.named_parameters(), part.named_parameters()):
                    want = reference.get_parameter(name_of[id(q)]).grad
                    worst = max(worst, relative_difference(p.grad, want))
            worst_all = torch.tensor([worst])
            dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
            if rank == 0:
                lengths = [r[0].shape[1] for r in rows]
                print(f"step 0: packed rows of {min(lengths)}-{max(lengths)} tokens; gradients within "
                      f"{float(worst_all):.2e} of one process", flush=True)
        pc.clip_grad_norm_(pipe, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 5 == 4 or step == args.steps - 1:  # the losses are on the last stages' ranks (dualpipe: two)
            total = torch.tensor([sum(float(v) for v in losses if v is not None)], dtype=torch.float64)
            dist.all_reduce(total)
            if rank == 0:
                print(f"step {step + 1}: loss {float(total) / tokens:.4f} over {tokens} target tokens", flush=True)
    dist.destroy_process_group()


def _run(model: nn.Sequential, ids, doc, pos):
    value = (ids, doc, pos)
    for layer in model:
        value = layer(*value) if isinstance(value, tuple) else layer(value)
    return value


if __name__ == "__main__":
    main()
