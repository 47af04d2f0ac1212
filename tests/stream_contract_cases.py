"""Cases run on every rank of a gloo pool: steps of the device path's protocol emulated by the host,
whose stream ledger (csrc/testing/stream_ledger.h) refuses any use or free of a message buffer that
a GPU's compute and communication streams would not order (csrc/stream_contract.h)."""

from __future__ import annotations

import torch
from torch import nn

import pipecore as pc
from models import make_batch, make_stages, model_stage_count, pipeline_step, rank_stages
from pipeline_cases import set_messages
from reliability_cases import _outcome

# rows per step; None: rank 0's second forward of that step raises (its receives are dropped unconsumed
# there, and the peers' aborted messages arrive as stand-ins)
ROWS = [12, 12, 16, None, 16, 12, 12]


def steps_under_the_checker(rank, world, name, V):
    """Steady steps, a batch shape seen before and a new one, a step failing on rank 0 midway, and
    steps after it, on the emulated device path. Returns each step's outcome (the error's kind and
    text) and what the ledger refused (after each step)."""
    m = 2 * world
    sched = pc.build_schedule(name, world, m, V)
    model = make_stages("multi", model_stage_count(sched))
    mine = rank_stages(sched, rank, model)
    pipe = pc.Pipeline(mine, sched, m, loss_fn=nn.CrossEntropyLoss(), timeout=60)
    set_messages(pipe, "device")
    fail = {"at": None, "calls": 0}

    def pre_hook(mod, args):
        fail["calls"] += 1
        if fail["calls"] == fail["at"]:
            raise RuntimeError("boom at the second forward")
    if rank == 0:
        mine[0].module.register_forward_pre_hook(pre_hook)
    outcomes, refused = [], []
    for step, rows in enumerate(ROWS):
        fail["at"], fail["calls"] = (2, 0) if rows is None else (None, 0)
        x, y = make_batch(rows or 16, seed=step)
        outcomes.append(_outcome(lambda: pipeline_step(pipe, x, y))[:2])
        refused.append(list(pipe.executor._stream_violations()))
        for s in mine:
            s.module.zero_grad(set_to_none=True)
    assert pipe.executor.device_comm
    torch.manual_seed(0)
    return outcomes, refused
