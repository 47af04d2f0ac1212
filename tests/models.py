"""Small models for pipeline tests: lists of stage modules plus a single-process reference."""

from __future__ import annotations

import time

import torch
from torch import nn

from pipecore.stage.boundary import as_call

# A Pipeline timeout no test waits out (longer than any pool's deadline): in a test of how a
# failure spreads, an error that arrives came from the failure protocol, not from a timeout, so
# the test checks what arrived (event order) instead of bounding how long it took.
NEVER = 3600.0


class MLPBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class TransformerishBlock(nn.Module):
    """LayerNorm, GELU MLP and a residual."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TwoStreamBlock(nn.Module):
    """Several tensors per boundary: (hidden, skip, integer ids, a flag)."""

    def __init__(self, width, first=False):
        super().__init__()
        self.first = first
        self.mix = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(self, x, skip=None, ids=None, scale=1.0):
        if self.first:
            ids = (x.abs().sum(-1) * 10).long() % 7  # integer tensor that travels along, needs no grad
            skip = x
        h = torch.relu(self.mix(x)) * scale + torch.sigmoid(self.gate(skip))
        h = h + ids.unsqueeze(-1).to(h.dtype) * 0.01
        return h, skip * 0.5 + h, ids, scale


class Head(nn.Module):
    def __init__(self, width, classes=5):
        super().__init__()
        self.out = nn.Linear(width, classes)

    def forward(self, x, *rest):
        return self.out(x)


def make_stages(kind: str, num_stages: int, width: int = 16, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    if kind == "mlp":
        stages = [MLPBlock(width) for _ in range(num_stages)]
        stages[-1] = nn.Sequential(MLPBlock(width), Head(width))
    elif kind == "transformer":
        stages = [TransformerishBlock(width) for _ in range(num_stages)]
        stages[-1] = nn.Sequential(TransformerishBlock(width), Head(width))
    elif kind == "multi":
        stages = [TwoStreamBlock(width, first=(i == 0)) for i in range(num_stages)]
        stages[-1] = _MultiHead(TwoStreamBlock(width, first=(num_stages == 1)), Head(width))
    else:
        raise ValueError(kind)
    return stages


class _MultiHead(nn.Module):
    def __init__(self, block, head):
        super().__init__()
        self.block, self.head = block, head

    def forward(self, *args, **kwargs):
        return self.head(*self.block(*args, **kwargs))


def reference_forward(stages: list[nn.Module], x):
    value = x
    for i, stage in enumerate(stages):
        args, kwargs = ((value,), {}) if i == 0 else as_call(value)
        value = stage(*args, **kwargs)
    return value


def stack_terms(rows: int, stages: int, width: int = 16) -> int:
    """The longest sum behind a gradient of make_stages' models, for exactness.rounding_bound: a weight
    gradient sums over the batch's rows, and its factors went through every stage's sums, forward and
    backward (a LayerNorm's two over the width, Linear layers over at most twice the width)."""
    return rows + 2 * stages * 6 * width


def make_batch(rows: int, width: int = 16, classes: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g), torch.randint(0, classes, (rows,), generator=g)


def model_stage_count(sched) -> int:
    """How many model stages `sched` runs (dualpipe's mirrored copies counted once)."""
    return len(set(sched.topology.model_stage))


def rank_stages(sched, rank: int, model: list[nn.Module]) -> list:
    """This rank's pc.PipelineStages under `sched`: copies of `model`'s stages (a mirror copies its
    model stage)."""
    import copy

    import pipecore as pc

    topo = sched.topology
    return [pc.PipelineStage(copy.deepcopy(model[topo.model_stage[s]]), s, sched.num_stages)
            for s in sched.rank_stages(rank)]


def pipeline_step(pipe, x, y, **kwargs):
    """`pipe.step` with the batch's inputs where this rank holds a first stage and its targets where
    it holds a last stage, as every rank of a test calls it."""
    return pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None, **kwargs)


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, backward_s):
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None


class Sleepy(nn.Module):
    """A layer whose forward and backward take known times."""

    def __init__(self, forward_ms, backward_ms=0.0):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.forward_s, self.backward_s = forward_ms / 1e3, backward_ms / 1e3

    def forward(self, x):
        time.sleep(self.forward_s)
        return _SleepFn.apply(x * self.scale, self.backward_s)
