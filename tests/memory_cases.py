"""Memory and out-of-memory cases run on every rank of a gloo pool (see memory_probe for the
allocator that counts and refuses). Each compares gradients with single-process training."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import pipecore as pc
from memory_probe import probe
from models import NEVER, make_batch, make_stages, reference_forward, pipeline_step
from exactness import EXACT_DTYPE, assert_matches
from reliability_cases import _outcome, _pipe
from pipeline_cases import set_messages

WIDTH = 128
ROWS_PER_MB = 512
UNIT = ROWS_PER_MB * WIDTH * EXACT_DTYPE.itemsize  # bytes of one microbatch's activation: 512 KiB
LAST_STAGE_RECV_WINDOW = 1  # receives the last stage posts ahead of their action


def _linear_stages(n, width=WIDTH, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(width, width) for _ in range(n)]


def _check_grads(stages, ref_stages, topo, what):
    for s in stages:
        for (n, p), (_, q) in zip(s.module.named_parameters(), ref_stages[topo.model_stage[s.stage_index]].named_parameters()):
            assert_matches(p.grad, q.grad, f"{what}: stage {s.stage_index} {n}")


def first_stage_memory(rank, world, m, budget_units):
    """GPipe, stage 0 = one Linear over the batch (it saves only the batch itself): what stage 0 holds
    during a step beyond its parameters is the activations it sent and has not freed yet."""
    p = probe()
    sched = pc.build_schedule("gpipe", world, m, 1)
    model = _linear_stages(world)
    ref = copy.deepcopy(model)
    stage = pc.PipelineStage(copy.deepcopy(model[rank]), rank, world)
    pipe = pc.Pipeline(stage, sched, m, loss_fn=nn.MSELoss(), recv_window=0, send_budget=budget_units * UNIT)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(m * ROWS_PER_MB, WIDTH, generator=g), torch.randn(m * ROWS_PER_MB, WIDTH, generator=g)
    pipeline_step(pipe, x, y)  # plans shapes
    for q in stage.module.parameters():
        q.grad = torch.zeros_like(q)  # accumulate in place: gradients are not step memory
    base = p.live_bytes()
    p.reset_peak()
    pipeline_step(pipe, x, y)
    held = p.peak_bytes() - base
    sent_peak = pipe.executor.peak_send_bytes
    for q in stage.module.parameters():
        q.grad = None
    pipeline_step(pipe, x, y)
    nn.MSELoss()(reference_forward(ref, x), y).backward()
    _check_grads(pipe.stages, ref, sched.topology, "gpipe")
    return held, sent_peak


def last_stage_memory(rank, world, m, return_outputs):
    """1F1B, last stage = one Linear and a weighted squared error given through loss_kwargs."""
    p = probe()
    sched = pc.build_schedule("1f1b", world, m, 1)
    model = _linear_stages(world)
    ref = copy.deepcopy(model)

    def loss_fn(out, target, weight):
        return ((out - target) ** 2 * weight).mean()

    stage = pc.PipelineStage(copy.deepcopy(model[rank]), rank, world)
    pipe = pc.Pipeline(stage, sched, m, loss_fn=loss_fn, recv_window=LAST_STAGE_RECV_WINDOW)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(m * ROWS_PER_MB, WIDTH, generator=g), torch.randn(m * ROWS_PER_MB, WIDTH, generator=g)
    weight = torch.rand(WIDTH, generator=g)

    def step(losses=None):
        return pipeline_step(pipe, x, y, losses=losses,
                         return_outputs=return_outputs, loss_kwargs={"weight": weight})

    step()
    for q in stage.module.parameters():
        q.grad = torch.zeros_like(q)
    held = None
    for _ in range(2):  # the smaller of two steps: a peer running late can leave one more message here
        losses: list = []
        base = p.live_bytes()
        p.reset_peak()
        out = step(losses)
        held = p.peak_bytes() - base if held is None else min(held, p.peak_bytes() - base)
    for q in stage.module.parameters():
        q.grad = None
    step()
    with torch.no_grad():
        want = reference_forward(ref, x)
        want_losses = [loss_fn(o, t, weight) for o, t in zip(want.tensor_split(m), y.tensor_split(m))]
    loss_fn(reference_forward(ref, x), y, weight).backward()
    _check_grads(pipe.stages, ref, sched.topology, "1f1b")
    if pipe.has_last:
        assert_matches(torch.stack(losses), torch.stack(want_losses), "losses")
        if return_outputs:
            assert_matches(out, want, "outputs")
        else:
            assert out is None
    return held, pipe.executor.peak_send_bytes


def out_of_memory_anywhere(rank, world, name, bad_rank, messages, min_bytes):
    """The bad rank's k-th allocation of at least `min_bytes` in a step fails with an out-of-memory
    error, for every k the step has: receive buffers, packed messages, activations, gradients, in
    the executor and in the model. Every rank must end that step within seconds and agree that the
    group works: the next step runs and matches single-process training."""
    p = probe()
    group = dist.new_group(backend="gloo")
    pipe, model = _pipe(rank, world, name, group=group, timeout=NEVER)  # what arrives was sent
    set_messages(pipe, messages)
    x, y = make_batch(8)
    pipeline_step(pipe, x, y)  # plans shapes
    p.watch(min_bytes if rank == bad_rank else -1, -1)
    pipeline_step(pipe, x, y)
    count = torch.tensor([p.watched_count()])
    dist.all_reduce(count, group=group)
    results = []
    ref = copy.deepcopy(model)
    nn.CrossEntropyLoss()(reference_forward(ref, x), y).backward()
    topo = pipe.schedule.topology
    for k in range(int(count)):
        p.watch(min_bytes if rank == bad_rank else -1, k)
        first = _outcome(lambda: pipeline_step(pipe, x, y))
        p.watch(-1, -1)
        for s in pipe.stages:
            s.module.zero_grad(set_to_none=True)
        second = _outcome(lambda: pipeline_step(pipe, x, y))
        if second[0] == "ok":
            _check_grads(pipe.stages, ref, topo, f"after failure {k}")
        results.append((k, first, second))
    dist.destroy_process_group(group)
    return results


def capped_rank_releases_its_peers(rank, world, m):
    """GPipe; rank 0 (stage 0 = Linear, GELU: it saves one activation per microbatch) has a memory
    cap it reaches in its forwards, like a full GPU. Releasing its peers must fit in what the failed
    step freed: all its aborted messages share one buffer."""
    p = probe()
    sched = pc.build_schedule("gpipe", world, m, 1)
    torch.manual_seed(0)
    model = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(world)]
    ref = copy.deepcopy(model)
    stage = pc.PipelineStage(copy.deepcopy(model[rank]), rank, world)
    pipe = pc.Pipeline(stage, sched, m, loss_fn=nn.MSELoss(), recv_window=0, send_budget=0, timeout=20)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(m * ROWS_PER_MB, WIDTH, generator=g), torch.randn(m * ROWS_PER_MB, WIDTH, generator=g)
    pipeline_step(pipe, x, y)
    for q in stage.module.parameters():
        q.grad = torch.zeros_like(q)
    if rank == 0:  # the step needs about m + 2 units here; the cap allows 4.5
        p.set_cap(p.live_bytes() + 9 * UNIT // 2)
    refused = p.refused_count()
    capped = _outcome(lambda: pipeline_step(pipe, x, y))
    refused = p.refused_count() - refused
    p.set_cap(-1)
    for q in stage.module.parameters():
        q.grad = None
    after = _outcome(lambda: pipeline_step(pipe, x, y))
    nn.MSELoss()(reference_forward(ref, x), y).backward()
    if after[0] == "ok":
        _check_grads(pipe.stages, ref, sched.topology, "after the capped step")
    return capped, refused, after


def stray_message_puts_the_channel_out_of_step(rank, world, messages="default"):
    """Rank 0 sends a message of its own to rank 1 on the pipeline's group before the step: rank 1
    reads it as the first activation. Not rank 1's error: the channel is out of step, the group
    must be rebuilt. `messages`: see set_messages."""
    group = dist.new_group(backend="gloo")
    pipe, _ = _pipe(rank, world, "1f1b", group=group, timeout=5)
    set_messages(pipe, messages)
    x, y = make_batch(8)
    pipeline_step(pipe, x, y)
    stray_sent = None
    if rank == 0:  # 2 rows x 16 values + 16 bytes: the first activation's receive buffer, whole (a larger
        # message would make gloo abort the process), not a message of pipecore's. Not waited for before
        # the step (as on NCCL, where a send does not hold the host): the CPU model of NCCL posts a
        # receive once the pipeline's own note of its send arrived, in the step.
        stray = torch.zeros(2 * 16 * x.element_size() + 16, dtype=torch.uint8)
        stray_sent = dist.isend(stray, dist.get_global_rank(group, 1), group=group)
    first = _outcome(lambda: pipeline_step(pipe, x, y))
    if stray_sent is not None:
        stray_sent.wait()  # (rank 1 took it as its first activation)
    after = _outcome(lambda: pipeline_step(pipe, x, y))
    dist.destroy_process_group(group)
    return first, after


def pipelines_created_unevenly(rank, world):
    """Rank 0 makes a Pipeline more than the others before the shared one: the shared one's store
    keys (its second gloo channel, its error messages) must still match across ranks."""
    group = dist.new_group(backend="gloo")
    if rank == 0:
        _pipe(rank, world, "1f1b", group=group, timeout=10)  # never stepped
    pipe, model = _pipe(rank, world, "1f1b", group=group, timeout=10)
    fail = {"on": False}
    if rank == 1:
        def hook(mod, args):
            if fail["on"]:
                raise RuntimeError("boom on rank 1")
        pipe.stages[0].module.register_forward_pre_hook(hook)
    x, y = make_batch(8)
    first = _outcome(lambda: pipeline_step(pipe, x, y))
    fail["on"] = True
    second = _outcome(lambda: pipeline_step(pipe, x, y))
    dist.destroy_process_group(group)
    return first, second


def combined_backend_string(rank, world):
    """A group made as "cpu:gloo,cuda:gloo" (as "cpu:gloo,cuda:nccl" on GPU machines): CPU stages'
    messages go through gloo, so the pipeline uses gloo's comm thread and second channel."""
    group = dist.new_group(backend="cpu:gloo,cuda:gloo")
    pipe, model = _pipe(rank, world, "1f1b", group=group)
    x, y = make_batch(8)
    pipeline_step(pipe, x, y)
    ref = copy.deepcopy(model)
    nn.CrossEntropyLoss()(reference_forward(ref, x), y).backward()
    _check_grads(pipe.stages, ref, pipe.schedule.topology, "combined backend")
    stats = (dist.get_backend(group), pipe.executor.threaded_posts, pipe.executor.reverse_posts)
    dist.destroy_process_group(group)
    return stats


def bad_step_options(rank, world):
    pipe, _ = _pipe(rank, world, "1f1b")
    x, y = make_batch(8)
    out = {"return_outputs": _outcome(lambda: pipe.step(*((x,) if pipe.has_first else ()),
                                                          target=y if pipe.has_last else None, return_outputs="no")),
           "loss_kwargs": _outcome(lambda: pipe.step(*((x,) if pipe.has_first else ()),
                                                       target=y if pipe.has_last else None, loss_kwargs=[1]))}
    out["then"] = _outcome(lambda: pipeline_step(pipe, x, y))
    return out

