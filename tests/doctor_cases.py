"""Steps that hang, on 2 gloo ranks, for tests/test_doctor.py: each case returns what every rank's step
raised (its type and message), how long it took to raise, and the text of its cause ("" if none)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import pipecore as pc
from pipecore.executor.program import encode
from pipecore.schedule.action import Kind
from pipecore.schedule.schedule import Schedule

TIMEOUT = 3.0


class Troubled(nn.Module):
    """A linear stage whose `trouble` happens in its forward of microbatch 2 (its third call)."""

    def __init__(self, trouble=None):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.trouble, self.calls = trouble, 0

    def forward(self, x):
        self.calls += 1
        if self.trouble is not None and self.calls == 3:
            self.trouble()
        return self.lin(x)


def _pipeline(rank: int, world: int, trouble=None) -> pc.Pipeline:
    sched = pc.build_schedule("1f1b", world, 4)
    stages = [pc.PipelineStage(Troubled(trouble if s == world - 1 else None), s, world)
              for s in sched.rank_stages(rank)]
    return pc.Pipeline(stages, sched, 4, loss_fn=lambda y, t: y.sum(), timeout=TIMEOUT)


def _step(pipe, rows: int = 8) -> tuple[str, str, float, str]:
    started = time.monotonic()
    try:
        pipe.step(torch.randn(rows, 4), target=torch.zeros(rows))
        return "passed", "", time.monotonic() - started, ""
    except Exception as exc:  # noqa: BLE001 - the case reports it
        cause = exc.__cause__
        return type(exc).__name__, str(exc), time.monotonic() - started, "" if cause is None else \
            f"{type(cause).__name__}: {cause}"


def slow_forward(rank: int, world: int) -> tuple:
    """The last stage's forward of microbatch 2 sleeps for twice the timeout."""
    return _step(_pipeline(rank, world, lambda: time.sleep(2 * TIMEOUT)))


def dead_rank(rank: int, world: int) -> tuple:
    """The last rank's process ends inside its forward of microbatch 2."""
    return _step(_pipeline(rank, world, lambda: os._exit(3)))


def missing_step(rank: int, world: int) -> tuple:
    """Step 0 on every rank; then the last rank does not call step 1 (it returns a little later)."""
    pipe = _pipeline(rank, world)
    assert _step(pipe)[0] == "passed"
    if rank == world - 1:
        time.sleep(2 * TIMEOUT)
        return "no step", "", 0.0, ""
    return _step(pipe)


def lone_collective(rank: int, world: int) -> tuple:
    """The last stage's forward of microbatch 2 enters an all-reduce of a group of every rank, which the
    other ranks enter only after their step failed (to let it go). Not the Pipeline's group (the world):
    on gloo, a wait that timed out closes its group's connections, as a send of the failed step may."""
    side = dist.new_group()
    out = _step(_pipeline(rank, world, lambda: dist.all_reduce(torch.ones(1), group=side)))
    if rank != world - 1:
        dist.all_reduce(torch.zeros(1), group=side)
    return out


def wait_for_cycle(rank: int, world: int) -> tuple:
    """2 ranks under 1F1B; after step 0, rank 0 is given another program than rank 1's (a test's hook: the
    agreement compares the schedules, not the programs loaded): microbatch 0's backward moved before any of its
    sends, so in step 1 rank 0 waits for microbatch 0's gradients while rank 1 waits for its activations."""
    pipe = _pipeline(rank, world)
    assert _step(pipe)[0] == "passed"  # (the first step learns the shapes: its waits are others)
    if rank == 0:
        lowered = pipe.schedule.lower()
        row = list(lowered.actions[0])
        first = [a for a in row if a.microbatch == 0 and a.kind in (Kind.F, Kind.RECV_B, Kind.B)]
        row = first + [a for a in row if a not in first]  # (nothing sent before it waits)
        rows = [list(r) for r in lowered.codes]
        rows[0] = [a.code for a in row]
        pipe.programs[True] = encode(Schedule.from_codes(rows, lowered.topology, lowered.name), 0, {0: 0})
        pipe.plans._set_program(True)
    return _step(pipe)


def phases_seen(rank: int, world: int) -> list[list[str]]:
    """2 replicas of a 2-rank 1F1B pipeline (4 ranks): the flight record's phase, read from inside each step's
    first forward and the replicas' reduction, over two steps (the first learns its messages' shapes)."""
    from data_parallel_cases import data_parallel_mesh

    m = data_parallel_mesh(2, 2)
    sched = pc.build_schedule("1f1b", 2, 4)
    pp = m.get_group("pp")
    stages = [pc.PipelineStage(Troubled(), s, 2) for s in sched.rank_stages(dist.get_rank(pp))]
    pipe = pc.Pipeline(stages, sched, 4, loss_fn=lambda y, t: y.sum(), group=pp, dp_group=m.get_group("dp"),
                       timeout=60)
    seen: list[list[str]] = []
    stages[0].module.register_forward_pre_hook(
        lambda module, args: seen[-1].append(pipe.flight_record()["phase"]) if len(seen[-1]) == 0 else None)
    reducer = pipe.gradients.dp
    finish = reducer.finish

    def finishing():
        seen[-1].append(pipe.flight_record()["phase"])
        finish()
    reducer.finish = finishing
    for _ in range(2):
        seen.append([])
        pipe.step(torch.randn(8, 4), target=torch.zeros(8))
        seen[-1].append(pipe.flight_record()["phase"])
    return seen


def in_flight_seen(rank: int, world: int, microbatches: int) -> tuple[dict | None, dict]:
    """GPipe with every receive posted ahead (recv_window = microbatches): the flight record of the last rank
    read in its forward of microbatch 1 of step 1 (step 0 learns the shapes, posting each receive at its
    action), and each rank's record after that step."""
    sched = pc.build_schedule("gpipe", world, microbatches)
    stages = [pc.PipelineStage(Troubled(), s, world) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, microbatches, loss_fn=lambda y, t: y.sum(), timeout=60,
                       recv_window=microbatches)
    seen: list[dict] = []
    module = stages[0].module
    module.register_forward_pre_hook(
        lambda mod, args: seen.append(pipe.flight_record()) if mod.calls == microbatches + 1 else None)
    for _ in range(2):
        outcome = _step(pipe, rows=microbatches)
        assert outcome[0] == "passed", outcome
    return (seen[0] if rank == world - 1 else None), pipe.flight_record()


def slow_backward_half(rank: int, world: int) -> tuple:
    """dualpipev with its OVERLAP_F_B pairs' halves at once (overlap_f_b="concurrent": the backward half on a
    thread of its own). At step 1 a backward hook of rank 0's sleeps for twice the timeout, the first time it
    runs off the step's thread, i.e. in a pair's backward half; meanwhile the forward half may wait for a
    peer that waits for that half's gradients."""
    import threading

    m = 2 * world
    sched = pc.build_schedule("dualpipev", world, m, 2)
    stages = [pc.PipelineStage(nn.Linear(4, 4), s, sched.num_stages) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, m, loss_fn=lambda y, t: y.sum(), timeout=TIMEOUT, overlap_f_b="concurrent")
    assert _step(pipe)[0] == "passed"  # (the first step learns the shapes, its pairs in sequence)
    if rank == 0:
        slept = []

        def slow_hook(module, grad_in, grad_out):
            if not slept and threading.current_thread() is not threading.main_thread():
                slept.append(True)
                time.sleep(2 * TIMEOUT)
        for stage in stages:
            stage.module.register_full_backward_hook(slow_hook)
    return _step(pipe)


class _Failing(nn.Module):
    """A linear stage whose forward, from step 1 on (`on`), at its `at`-th call raises (`fail`) or sleeps for
    `sleep` seconds."""

    def __init__(self, at: int, fail: bool, sleep: float = 2 * TIMEOUT):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.at, self.fail, self.sleep, self.calls, self.on = at, fail, sleep, 0, False

    def forward(self, x):
        self.calls += 1
        if self.on and self.calls == self.at:
            if self.fail:
                raise RuntimeError("boom in the user's forward")
            time.sleep(self.sleep)
        return self.lin(x)


def own_error_while_peer_sleeps(rank: int, world: int) -> tuple:
    """2 ranks, 1F1B, 4 microbatches. In step 1 the last stage's forward of microbatch 0 raises; the first
    stage's forward of microbatch 1 sleeps for twice the timeout, so the last rank's release of its peer
    times out, and the first rank's next send finds the connection closed. Returns what `_step` does, and the
    notes of the error."""
    m = 4
    sched = pc.build_schedule("1f1b", world, m)
    modules = [_Failing(m + (1 if s == world - 1 else 2), fail=s == world - 1) for s in sched.rank_stages(rank)]
    stages = [pc.PipelineStage(mod, s, world) for mod, s in zip(modules, sched.rank_stages(rank))]
    pipe = pc.Pipeline(stages, sched, m, loss_fn=lambda y, t: y.sum(), timeout=TIMEOUT)
    assert _step(pipe)[0] == "passed"
    for mod in modules:
        mod.on = True
    try:
        pipe.step(torch.randn(8, 4), target=torch.zeros(8))
    except Exception as exc:  # noqa: BLE001 - the case reports it
        return type(exc).__name__, str(exc), getattr(exc, "__notes__", []), repr(exc.__cause__)
    return "passed", "", [], ""


def own_error_between_two_silent_peers(rank: int, world: int) -> tuple:
    """3 ranks, 1F1B, 4 microbatches. In step 1 the middle stage's forward of microbatch 0 raises, while rank 0
    sleeps in its forward of microbatch 1 and rank 2 calls step() only after 3 timeouts: the middle rank's
    release of its peers meets a wait on each of them that cannot end. Returns what `_step` does."""
    m = 4
    sched = pc.build_schedule("1f1b", world, m)
    late = 3 * TIMEOUT
    modules = [_Failing(m + (1 if s == 1 else 2), fail=s == 1, sleep=late) for s in sched.rank_stages(rank)]
    stages = [pc.PipelineStage(mod, s, world) for mod, s in zip(modules, sched.rank_stages(rank))]
    pipe = pc.Pipeline(stages, sched, m, loss_fn=lambda y, t: y.sum(), timeout=TIMEOUT)
    assert _step(pipe)[0] == "passed"
    for mod in modules:
        mod.on = rank != world - 1
    if rank == world - 1:
        time.sleep(late)
    return _step(pipe)
