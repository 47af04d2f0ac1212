"""Multi-rank helpers for tests/test_auto_schedules.py (importable by dist_pool's workers)."""

import torch.nn as nn

import pipecore as pc
from models import pipeline_step
from pipeline_cases import make_batch, make_stages


def traced_zbv_step(rank, world, path):
    """One traced zbv step (I and W split) on `world` ranks; rank 0 writes the Chrome trace."""
    from pipecore.tools.profiling import gather_trace, to_chrome_trace

    sched = pc.build_schedule("zbv", world, 8)
    model = make_stages("mlp", sched.num_stages)
    mine = [pc.PipelineStage(model[s], s, sched.num_stages) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(mine, sched, 8, loss_fn=nn.CrossEntropyLoss(), trace=True, timeout=60)
    x, y = make_batch(16)
    pipeline_step(pipe, x, y)
    events = gather_trace(pipe)
    if rank == 0:
        to_chrome_trace(events, path)
    return len(events)
