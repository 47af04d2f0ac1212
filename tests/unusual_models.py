"""Stage modules unlike the usual Linear stacks, and a case that trains them against one process.

Each model is four stages: dict outputs with a float mask that needs no gradient, keyword
inputs, fp64 and non-contiguous (transposed view) boundaries, int and None passthrough, a stage
without parameters, an identity stage, activation checkpointing (reentrant and not), a weight used
twice in one stage, embeddings on integer inputs, attention and an LSTM.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pipecore as pc
from models import reference_forward
from exactness import EXACT_DTYPE, FLOAT64_BOUND, assert_within, default_dtype, difference, rounding_bound

WIDTH, SEQ, CLASSES, VOCAB = 16, 4, 5, 11


class MaskedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return {"h": self.fc(x), "mask": (x.sum(-1) > 0).float()}  # the mask needs no gradient


class Fp64Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, mask):
        return (self.fc(h) * mask[..., None]).double().transpose(1, 2), 7, None


class NoParameters(nn.Module):
    def forward(self, y, k, nothing):
        assert nothing is None and k == 7
        return nn.functional.gelu(y.transpose(1, 2).float() * k)


class Identity(nn.Module):
    def forward(self, x):
        return x


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.a, self.b, self.reentrant = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), reentrant

    def forward(self, x):
        return checkpoint(lambda t: self.b(torch.tanh(self.a(t))), x, use_reentrant=self.reentrant) + x


class SharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.a(torch.tanh(self.a(x)))


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids):
        return self.e(ids)


class AttentionLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=True)

    def forward(self, x):
        return self.lstm(self.attn(x, x, x, need_weights=False)[0] + x)[0]


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES)

    def forward(self, z):
        return self.fc(self.norm(z).mean(1))


KINDS = {  # name -> (four stage modules, integer token inputs?, dtype)
    # fp32 stages with a float64 boundary between them (both casts exact): the dtypes are the point
    "boundaries": (lambda: [MaskedInput(), Fp64Transposed(), NoParameters(), Head()], False, torch.float32),
    "identity": (lambda: [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), Identity(), nn.Linear(WIDTH, WIDTH),
                          Head()], False, EXACT_DTYPE),
    "checkpoint": (lambda: [Embed(), Checkpointed(False), Checkpointed(True), Head()], True, EXACT_DTYPE),
    "shared_attention": (lambda: [Embed(), SharedWeight(), AttentionLSTM(), Head()], True, EXACT_DTYPE),
}


def train_unusual(rank, world, name, kind, rows):
    """One step of `kind` under `name` (4 stages) against one process: every gradient, every loss."""
    build, tokens, dtype = KINDS[kind]
    # fp32: a weight gradient sums over every row and position, its factors went through the four
    # stages' sums over the width, forward and backward (exactness.rounding_bound)
    bound = None if dtype == EXACT_DTYPE else rounding_bound(dtype, rows * SEQ + 2 * 4 * WIDTH)
    m = 2 * world
    sched = pc.build_schedule(name, world, m, 4 // world)
    topo = sched.topology
    torch.manual_seed(0)
    with default_dtype(dtype):
        model = build()
        g = torch.Generator().manual_seed(3)
        x = torch.randint(0, VOCAB, (rows, SEQ), generator=g) if tokens else torch.randn(rows, SEQ, WIDTH, generator=g)
        y = torch.randint(0, CLASSES, (rows,), generator=g)
    ref = copy.deepcopy(model)
    mine = [pc.PipelineStage(copy.deepcopy(model[s]), s, sched.num_stages) for s in sched.rank_stages(rank)]
    loss_fn = nn.CrossEntropyLoss()
    pipe = pc.Pipeline(mine, sched, m, loss_fn=loss_fn, timeout=60)
    losses: list = []
    out = pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None, losses=losses)
    with torch.no_grad():
        ref_chunks = [reference_forward(ref, xc) for xc in torch.tensor_split(x, m)]
    loss_fn(reference_forward(ref, x), y).backward()
    for s in mine:
        for (n, p), q in zip(s.module.named_parameters(), ref[s.stage_index].parameters()):
            if q.grad is None:
                assert p.grad is None or p.grad.abs().max() == 0, f"stage {s.stage_index} {n}: expected no gradient"
                continue
            assert p.grad is not None, f"stage {s.stage_index} {n}: gradient missing"
            err = difference(p.grad, q.grad)
            assert_within(err, f"stage {s.stage_index} {n}", bound or FLOAT64_BOUND)
    if pipe.has_last:  # relative to the largest value: a received copy may have another memory layout
        want_out = torch.cat(ref_chunks)
        want_losses = torch.stack([loss_fn(o, t) for o, t in zip(ref_chunks, torch.tensor_split(y, m))])
        for got, want, what in [(out, want_out, "outputs"), (torch.stack(losses), want_losses, "losses")]:
            err = difference(got, want)
            assert_within(err, what, bound or FLOAT64_BOUND)
    return True
