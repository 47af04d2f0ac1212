"""Cases for the device path run on the CPU model of NCCL (csrc/testing/host_device_comm.cpp: the
host runs the device path's protocol over gloo and refuses what NCCL refuses). Each compares every
loss and gradient with single-process training."""

from __future__ import annotations

import copy

import torch
from torch import nn

import pipecore as pc
from exactness import EXACT_DTYPE, assert_matches
from models import pipeline_step, reference_forward
from pipeline_cases import set_messages

WIDTH = 16


class SideTensors(nn.Module):
    """A first stage whose outputs include tensors NCCL has no dtype for, as models send them along:
    an int16 mask and complex64 rotary frequencies (Llama's freqs_cis), neither needing a gradient."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        with torch.no_grad():
            mask = (x[..., :4] > 0).to(torch.int16)
            freqs = torch.polar(torch.ones_like(x[..., :4]).float(), x[..., :4].float())
        return torch.tanh(self.fc(x)), mask, freqs


class UsesSideTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, mask, freqs):
        side = (mask.to(h.dtype) * freqs.real.to(h.dtype)).sum(-1, keepdim=True)
        return self.fc(h) + side


def side_tensors_cross(rank, world, messages):
    """1F1B on 2 ranks: stage 0 sends float64 activations with an int16 and a complex64 tensor,
    every message as a large one (its tensors go from their own storage), on the device path."""
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = [SideTensors().to(EXACT_DTYPE), UsesSideTensors().to(EXACT_DTYPE)]
    ref = copy.deepcopy(model)
    m = 4
    sched = pc.build_schedule("1f1b", world, m, 1)
    stage = pc.PipelineStage(copy.deepcopy(model[rank]), rank, world)
    pipe = pc.Pipeline(stage, sched, m, loss_fn=nn.MSELoss(), timeout=60)
    set_messages(pipe, "device")
    if messages == "large":
        set_messages(pipe, "large")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8 * m, WIDTH, dtype=EXACT_DTYPE, generator=g)
    y = torch.randn(8 * m, WIDTH, dtype=EXACT_DTYPE, generator=g)
    for _ in range(2):  # the first step learns the shapes (read on the host), the second runs as planned
        for q in stage.module.parameters():
            q.grad = None
        losses: list = []
        pipeline_step(pipe, x, y, losses=losses)
    want = [nn.MSELoss()(o, t) for o, t in zip(torch.tensor_split(reference_forward(ref, x), m),
                                                torch.tensor_split(y, m))]
    nn.MSELoss()(reference_forward(ref, x), y).backward()
    for (name, p), q in zip(stage.module.named_parameters(), ref[rank].parameters()):
        assert_matches(p.grad, q.grad, f"stage {rank} {name}")
    if pipe.has_last:
        assert_matches(torch.stack(losses), torch.stack(want).detach(), "losses")
    return pipe.executor.message_counts
