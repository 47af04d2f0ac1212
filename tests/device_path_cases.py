"""Cases run on every rank of a gloo pool: module state after steps that do not count (a batch that
changed shape, a failed step), on the host-waiting path and on the device path's protocol run by
the host (csrc/testing/host_device_comm.cpp), where ranks compute on stand-in messages before they learn
their status."""

from __future__ import annotations

import copy

import torch
from torch import nn

import pipecore as pc
from models import pipeline_step
from pipeline_cases import set_messages
from planning_cases import DropoutStage, _compare, _per_microbatch_reference, _stages
from reliability_cases import _outcome

ROWS = [16, 16, 12, 12, None, 17]  # None: rank 0's third forward fails (a step at 12 rows, a known shape)


def module_state_after_steps_that_do_not_count(rank, world, name, messages):
    """Every step that counts equals single-process training of the same stages: dropout drawn from
    each rank's own RNG stream, batch-norm statistics moved once per microbatch. A step at a new
    batch shape first runs as "shapes changed" (on the device path the later ranks compute on
    stand-ins then), and a failed step leaves the RNG streams and buffers as they were."""
    m = 4
    sched = pc.build_schedule(name, world, m)
    model = _stages(DropoutStage, world)
    ref = copy.deepcopy(model)
    mine = [pc.PipelineStage(copy.deepcopy(model[rank]), rank, world)]
    pipe = pc.Pipeline(mine, sched, m, loss_fn=nn.CrossEntropyLoss(), timeout=60)
    set_messages(pipe, messages)
    fail = {"at": None, "calls": 0}

    def pre_hook(mod, args):
        fail["calls"] += 1
        if fail["calls"] == fail["at"]:
            raise RuntimeError("boom at the third forward")
    if rank == 0:
        mine[0].module.register_forward_pre_hook(pre_hook)
    rng = [torch.manual_seed(1000 + r).get_state() for r in range(world)]  # rank r's stream
    torch.manual_seed(1000 + rank)
    mod, ref_mod = mine[0].module, ref[rank]
    tracked = 0
    outcomes = []
    for step, rows in enumerate(ROWS):
        fail["at"], fail["calls"] = (3, 0) if rows is None else (None, 0)
        x, y = _batch(rows or 12, step)
        losses: list = []
        before = torch.get_rng_state()
        outcome = _outcome(lambda: pipeline_step(pipe, x, y, losses=losses))
        outcomes.append(outcome[0])
        if messages == "device" and rows is None:  # the failure met the device path, not a step learning shapes
            assert pipe.executor.threaded_posts == 0 and pipe.executor.reverse_posts == 0, "not the device path"
        after = torch.get_rng_state()
        what = f"rank {rank} step {step} ({rows} rows)"
        if rows is None:  # failed: nothing moved
            assert torch.equal(after, before), f"{what}: the failed step moved the RNG stream"
            ref_after = copy.deepcopy(ref_mod)
        else:
            ref_losses = _per_microbatch_reference(ref, x, y, m, rng_states=rng)
            _compare(pipe, ref, losses, ref_losses, what)
            assert torch.equal(after, rng[rank]), f"{what}: another amount of random numbers"
            tracked += m
            ref_after = ref_mod
        for buf in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(mod.norm, buf), getattr(ref_after.norm, buf), rtol=0, atol=0,
                                       msg=lambda msg: f"{what} {buf}: {msg}")
        assert int(mod.norm.num_batches_tracked) == tracked, (what, int(mod.norm.num_batches_tracked))
        torch.set_rng_state(after)
        for p in list(mod.parameters()):
            p.grad = None
        for r in ref:
            r.zero_grad(set_to_none=True)
    return outcomes


def _batch(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 16, generator=g), torch.randint(0, 5, (rows,), generator=g)


def device_path_without_cuda_part(rank, world):
    """What use_device_path says on this build for gloo, a CPU device and NCCL on CUDA."""
    import torch.distributed as dist

    from pipecore.errors import InputError
    from pipecore.executor.native import C
    from pipecore.runtime.message_path import use_device_path

    executor = C.Executor(dist.group.WORLD, 1, 2, 10.0)
    use_device_path(executor, True, torch.device("cuda"), rank)  # gloo: the host path, nothing asked
    use_device_path(executor, False, torch.device("cpu"), rank)
    try:
        use_device_path(executor, False, torch.device("cuda"), rank)
    except InputError as exc:
        return str(exc), executor.device_comm
    return None, executor.device_comm


def path_chosen_before_the_first_step(rank, world):
    """A refused set_device_comm keeps the path as it was; after a step the path is not replaced."""
    import torch.distributed as dist

    from pipecore.executor.native import C

    executor = C.Executor(dist.group.WORLD, 1, 2, 10.0)
    executor.set_shapes_travel(True)
    refused = (executor.set_device_comm("cuda"), executor.device_comm, executor.shapes_travel)
    executor.run_aborted(1)  # a step (of an empty program)
    try:
        executor._emulate_device_comm()
    except RuntimeError as exc:
        return refused, str(exc), executor.device_comm
    return refused, None, executor.device_comm
