"""Cases run on every rank of a gloo pool: the device path on the CPU model of NCCL, with a stage that makes
a device-wide synchronisation in every forward, input-gradient and weight-gradient computation, as
cudaFree does when the caching allocator is off (and on an out-of-memory retry, and in empty_cache):
the host is held until every stream of the device completed its work (csrc/testing/host_device_comm.cpp,
model_device_synchronize)."""

from __future__ import annotations

import copy
import gc

import torch

import pipecore as pc
from pipecore import _C
from nccl_connection_cases import run_steps
from shaped_message_cases import MaskedStage, sum_loss

# step 0 learns the plan, 1 stays within it, 2 outgrows every capacity (every message follows up), 3 fits
GROWING = [3, 2, 8, 8]
SYNC = "cudaFree in a stage (the caching allocator off)"


_DEVICE = [0]  # the device this rank's executor models (Executor._emulate_device_comm: its rank + 1)


def _sync(*_):
    _C._model_device_synchronize(SYNC, _DEVICE[0])


def _on_output(_module, _args, out):
    if out[0].requires_grad:
        out[0].register_hook(_sync)  # (an input-gradient computation)


def with_device_syncs(module):
    """`module`, making a device-wide synchronisation before its forward, in its input gradient and in each
    weight gradient."""
    module.register_forward_pre_hook(_sync)
    module.register_forward_hook(_on_output)
    for p in module.parameters():
        p.register_hook(_sync)
    return module


def steps_under_device_syncs(rank: int, world: int, name: str, timeout: float = 60) -> dict:
    """`name` on `world` ranks (2 microbatches each) on the emulated device path with shapes in the
    messages, every stage synchronising the device (with_device_syncs), the lengths of GROWING: the first
    failure, the largest gradient difference from one process, the follow-ups sent, each step's seconds and
    the stream contract's violations."""
    gc.collect()  # (a model left by an earlier case holds its work: a synchronisation would wait for it too)
    _DEVICE[0] = rank + 1
    sched = pc.build_schedule(name, world, 2 * world)
    torch.manual_seed(0)
    modules = [MaskedStage(s == 0) for s in range(sched.num_stages)]
    reference = copy.deepcopy(modules)
    stages = [pc.PipelineStage(with_device_syncs(modules[s]), s, sched.num_stages) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, sched.num_microbatches, loss_fn=sum_loss, timeout=timeout)
    pipe.executor._emulate_device_comm(True)
    pipe.executor.set_shapes_travel(True)
    return run_steps(pipe, stages, reference, [[n] * sched.num_microbatches for n in GROWING], {}, 8000)
