"""Messages that carry their shapes (csrc/comm.h, shaped messages): a pipeline of small stages whose
messages hold two tensors of different ranks, stepped with lengths that change per microbatch and
per step, on every rank of a pool, next to one process running the same microbatches."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import pipecore as pc
from exactness import difference
from pipecore.executor.native import OPCODES

WIDTH = 8

# step 0 learns the plan (shapes exact); 1 stays within what step 0 had; 2 outgrows it (microbatch 0
# and the last); 3 and 4 stay within the grown capacity, 4 with a microbatch of length 0
LENGTHS = [[5, 3, 4, 2], [1, 5, 2, 3], [9, 2, 3, 12], [12, 9, 1, 4], [0, 7, 12, 2]]


def steps_for(lengths, world):
    """`lengths` for `world` ranks' microbatches (2 per rank)."""
    m = 2 * world
    return [(row * m)[:m] for row in lengths]


class MaskedStage(nn.Module):
    """(h, keep) -> (h', keep): keep is a float mask (no gradient) of one rank less than h."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = first
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, keep=None):
        if self.first:
            keep = (h[..., 0] > -10).to(h.dtype)
        return torch.tanh(self.lin(h)) * keep.unsqueeze(-1), keep


def sum_loss(out, y):
    return ((out[0] - y) ** 2).sum()


def batch(step: int, mb: int, n: int):
    g = torch.Generator().manual_seed(100 * step + mb)
    return torch.randn(2, n, WIDTH, generator=g), torch.randn(2, n, WIDTH, generator=g)


def actions_in_program(pipe, *kinds: str) -> int:
    """How many of this rank's training actions are of these kinds (a run's sends, its forwards)."""
    flat = pipe.programs[True].instructions
    codes = {OPCODES[k] for k in kinds}
    return sum(1 for i in range(0, len(flat), 5) if flat[i] in codes)


def sends_in_program(pipe) -> int:
    return actions_in_program(pipe, "SEND_F", "SEND_B")


def _pipeline(rank: int, world: int, name: str, **options):
    """This rank's stages of a pipeline of MaskedStages, the whole model as one process has it, and
    the Pipeline (2 microbatches per rank)."""
    sched = pc.build_schedule(name, world, 2 * world)
    n_stages = sched.num_stages
    torch.manual_seed(0)
    modules = [MaskedStage(s == 0) for s in range(n_stages)]
    reference = copy.deepcopy(modules)
    stages = [pc.PipelineStage(modules[s], s, n_stages) for s in sched.rank_stages(rank)]
    return stages, reference, pc.Pipeline(stages, sched, sched.num_microbatches, loss_fn=sum_loss, timeout=60,
                                          **options)


def _difference(stages, reference, data, model_stage=None) -> float:
    """The largest relative difference between this rank's gradients and one process's on `data`;
    both zeroed after. `model_stage`: the model stage of each stage index (dualpipe's mirrors: two stages
    run one), if not the stage itself."""
    tokens = float(sum(y.numel() for _, y in data))
    for x, y in data:
        h = (x,)
        for mod in reference:
            h = mod(*h)
        (sum_loss(h, y) / tokens).backward()
    worst = 0.0
    for s in stages:
        model = s.stage_index if model_stage is None else model_stage[s.stage_index]
        for q, r in zip(s.module.parameters(), reference[model].parameters()):
            worst = max(worst, difference(q.grad, r.grad))
        s.module.zero_grad(set_to_none=True)
    for mod in reference:
        mod.zero_grad(set_to_none=True)
    return worst


def step_lengths(rank: int, world: int, name: str, lengths: list[list[int]], large: int | None = None,
                 fail: tuple[int, int] | None = None, delay_us: int = 0, overlap: str | None = None,
                 device: bool = False, seed: int = 0) -> dict:
    """One step per entry of `lengths` (each microbatch's length). `large`: the test build's large-message
    threshold (0: every message sent as its parts); `fail`: (step, rank) whose first forward raises;
    `overlap`: the Pipeline's overlap_f_b mode (the halves of a pair read their messages at once);
    `delay_us`: random delays up to that before each send and receive, drawn from `seed` and the rank;
    `device`: the device path's protocol, emulated (messages at their capacity's size, headers read
    by the host, messages that outgrow their capacity followed on the follow-up channels).
    Returns per step the executor's message counts, the plans learnt and the forwards this rank ran
    (more than its program's F actions: a step ran twice), the largest relative gradient
    difference from one process over the steps that did not fail, and the stream contract's
    violations (device)."""
    stages, reference, pipe = _pipeline(rank, world, name, **({"overlap_f_b": overlap} if overlap else {}))
    if device:
        pipe.executor._emulate_device_comm()
        pipe.executor.set_shapes_travel(True)
    if large is not None:
        pipe.executor.set_large_messages(large)
    if delay_us:
        pipe.executor.set_delays(delay_us, 1000 * seed + rank)
    forwards = [0]

    def count_forward(module, args):
        forwards[0] += 1
    for s in stages:
        s.module.register_forward_pre_hook(count_forward)
    out: dict = {"counts": [], "plans": [], "grad": 0.0, "failed": [], "sends": sends_in_program(pipe),
                 "forwards": [], "once": actions_in_program(pipe, "F")}
    for step, lens in enumerate(lengths):
        forwards[0] = 0
        data = [batch(step, mb, n) for mb, n in enumerate(lens)]
        failing = fail is not None and fail == (step, rank)
        if failing:
            first = stages[0].module

            def broken(*args, **kwargs):
                raise RuntimeError("a forward that fails")
            first.forward = broken
        try:
            pipe.step_microbatches([(x,) for x, _ in data] if pipe.has_first else None,
                                   target_mbs=[y for _, y in data] if pipe.has_last else None,
                                   loss_divisor=float(sum(y.numel() for _, y in data)))
        except (RuntimeError, pc.PeerFailedError) as exc:
            out["failed"].append(f"{step}: {type(exc).__name__}")
            out.setdefault("errors", []).append(str(exc)[:600])
            for s in stages:
                s.module.zero_grad(set_to_none=True)
            if failing:
                del first.forward
            out["counts"].append(pipe.executor.message_counts)
            continue
        out["counts"].append(pipe.executor.message_counts)
        out["plans"].append(len(pipe.plans))
        out["forwards"].append(forwards[0])
        out.setdefault("grads", []).append(_difference(stages, reference, data))
        out["grad"] = max(out["grad"], out["grads"][-1])
    out["overlapped"] = pipe.overlapped_pairs
    out["violations"] = pipe.executor._stream_violations() if device else []
    return out


def out_of_memory_while_growing(rank: int, world: int, name: str, bad_rank: int, large: int | None,
                                min_bytes: int, device: bool = False) -> dict:
    """Each try, a step whose microbatches are longer than any before (every message outgrows its
    capacity) where the bad rank's k-th allocation of at least `min_bytes` fails, for every k such a
    step has (receive buffers, headers, follow-ups, activations); then a clean step of the same
    lengths, checked against one process. `device`: on the emulated device path with shaped messages
    (grown messages follow on the follow-up channels). Returns the (kind, text) of each try and of each
    clean step, and the largest relative gradient difference of the clean steps."""
    from memory_probe import probe
    from reliability_cases import _outcome

    p = probe()
    stages, reference, pipe = _pipeline(rank, world, name)
    m = pipe.num_microbatches
    if device:  # (step_lengths)
        pipe.executor._emulate_device_comm()
        pipe.executor.set_shapes_travel(True)
    if large is not None:
        pipe.executor.set_large_messages(large)

    def step(data):
        pipe.step_microbatches([(x,) for x, _ in data] if pipe.has_first else None,
                               target_mbs=[y for _, y in data] if pipe.has_last else None,
                               loss_divisor=float(sum(y.numel() for _, y in data)))

    def lengths(step_id: int, n: int):  # made before the probe watches: only the step's allocations count
        return [batch(step_id, mb, n + mb) for mb in range(m)]

    def clear():
        for s in stages:
            s.module.zero_grad(set_to_none=True)

    step(lengths(0, 2))  # learns the plan at short lengths
    clear()
    data = lengths(1, 8)
    p.watch(min_bytes if rank == bad_rank else -1, -1)
    step(data)  # counts the bad rank's allocations in a growing step
    count = torch.tensor([p.watched_count()])
    p.watch(-1, -1)
    clear()
    dist.all_reduce(count)
    out = {"tries": [], "grad": 0.0, "count": int(count)}
    n = 8
    for k in range(int(count)):
        n += 4
        data = lengths(10 + k, n)
        p.watch(min_bytes if rank == bad_rank else -1, k)
        first = _outcome(lambda: step(data))
        p.watch(-1, -1)
        clear()
        data = lengths(100 + k, n)
        second = _outcome(lambda: step(data))
        out["tries"].append((k, first[:2], second[:2]))
        if second[0] == "ok":
            out["grad"] = max(out["grad"], _difference(stages, reference, data))
    return out


def per_shape_plans(rank: int, world: int) -> dict:
    """variable_shapes=False on gloo: messages without shapes, a plan per batch shape (as on NCCL by
    default); and a variable_shapes that is not a bool, refused."""
    try:
        _pipeline(rank, world, "1f1b", variable_shapes="yes")
        refused = ""
    except TypeError as exc:
        refused = str(exc)
    stages, reference, pipe = _pipeline(rank, world, "1f1b", variable_shapes=False)
    out = {"refused": refused, "travel": pipe.executor.shapes_travel, "plans": [], "grad": 0.0}
    for step, n in enumerate([3, 5, 3]):
        data = [batch(step, mb, n) for mb in range(pipe.num_microbatches)]
        pipe.step_microbatches([(x,) for x, _ in data] if pipe.has_first else None,
                               target_mbs=[y for _, y in data] if pipe.has_last else None,
                               loss_divisor=float(sum(y.numel() for _, y in data)))
        out["plans"].append(len(pipe.plans))
        out["grad"] = max(out["grad"], _difference(stages, reference, data))
    return out
