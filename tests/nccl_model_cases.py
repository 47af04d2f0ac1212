"""Cases for the device path run on the CPU model of NCCL (csrc/testing/host_device_comm.cpp: the
host runs the device path's protocol over gloo and refuses what NCCL refuses). Each compares every
loss and gradient with single-process training."""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import nn

import pipecore as pc
from exactness import EXACT_DTYPE, assert_matches
from models import NEVER, pipeline_step, reference_forward
from pipeline_cases import set_messages
from said import said

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


STORE_VALUE_LIMIT = 8 * 1024 * 1024  # torch's libuv TCPStore refuses larger values ("Invalid payload size")


class CountingStore(dist.Store):
    """The group's store as a Pipeline sees it, counting the operations a step makes on it, and
    refusing a value over 8 MiB as the libuv TCPStore does (its connection then reset)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.ops, self.largest = inner, 0, 0

    def _count(self):
        self.ops += 1

    def set(self, key, value):
        self._count()
        size = len(value)
        self.largest = max(self.largest, size)
        if size > STORE_VALUE_LIMIT:
            raise RuntimeError(f"Invalid payload size: {size}, max: {STORE_VALUE_LIMIT}")
        return self.inner.set(key, value)

    def get(self, key):
        self._count()
        return self.inner.get(key)

    def add(self, key, value):
        self._count()
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self._count()
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        self._count()
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        self._count()
        return self.inner.check(keys)

    def delete_key(self, key):
        self._count()
        return self.inner.delete_key(key)

    deleteKey = delete_key  # (the name c10d calls it by, through a PrefixStore)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


GROWN_WIDTH = 128


def grown_messages_cross_without_the_store(rank, world, lengths):
    """1F1B on 2 ranks, two Linear stages of GROWN_WIDTH, float64, on the device path with shapes
    travelling: each step's sequences are `lengths[step]` long (one per microbatch), so a step with
    longer sequences than any before sends messages that outgrow their capacity. Every step's gradients
    match one process. Returns the store operations of each step after the first (which learns the
    plan), the largest value set, and the messages each step sent grown."""
    torch.manual_seed(0)
    model = [nn.Linear(GROWN_WIDTH, GROWN_WIDTH), nn.Linear(GROWN_WIDTH, GROWN_WIDTH)]
    ref = copy.deepcopy(model)
    m = 2
    sched = pc.build_schedule("1f1b", world, m, 1)
    stage = pc.PipelineStage(copy.deepcopy(model[rank]), rank, world)
    pipe = pc.Pipeline(stage, sched, m, loss_fn=nn.MSELoss(), timeout=60, variable_shapes=True)
    set_messages(pipe, "device")
    pipe.executor.set_shapes_travel(True)  # (variable_shapes=True, as on NCCL)
    store = pipe.comm.store = CountingStore(pipe.comm.store)
    ops, grown = [], []
    for step, length in enumerate(lengths):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(m, length, GROWN_WIDTH, generator=g)
        y = torch.randn(m, length, GROWN_WIDTH, generator=g)
        for q in [*stage.module.parameters(), *ref[0].parameters(), *ref[1].parameters()]:
            q.grad = None
        before = store.ops
        losses: list = []
        pipeline_step(pipe, x, y, losses=losses)
        ops.append(store.ops - before)
        grown.append(pipe.executor.message_counts[2])
        nn.MSELoss()(reference_forward(ref, x), y).backward()
        for (name, p), q in zip(stage.module.named_parameters(), ref[rank].parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m_: f"step {step}: stage {rank} {name}: {m_}")
    return ops[1:], store.largest, grown


def store_operations_per_step(rank, world, schedule, microbatches, path, rows):
    """`schedule` on `world` ranks, one Linear stage of WIDTH per rank in float64, on the host path
    ("default": gloo, whose messages carry their shapes) or the device path without shapes in messages
    ("device": the CPU model of NCCL), where each new batch shape is learnt by a discovery step. Step k has `rows[k]` rows per
    microbatch; every step's gradients match one process. Returns the store operations of each step."""
    torch.manual_seed(0)
    model = [nn.Linear(WIDTH, WIDTH).to(EXACT_DTYPE) for _ in range(world)]
    ref = copy.deepcopy(model)
    sched = pc.build_schedule(schedule, world, microbatches, 1)
    stage = pc.PipelineStage(copy.deepcopy(model[rank]), rank, world)
    pipe = pc.Pipeline(stage, sched, microbatches, loss_fn=nn.MSELoss(), timeout=60)
    set_messages(pipe, path)
    store = pipe.comm.store = CountingStore(pipe.comm.store)
    ops = []
    for step, n in enumerate(rows):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(microbatches * n, WIDTH, dtype=EXACT_DTYPE, generator=g)
        y = torch.randn(microbatches * n, WIDTH, dtype=EXACT_DTYPE, generator=g)
        for q in [*stage.module.parameters(), *(p for r in ref for p in r.parameters())]:
            q.grad = None
        before = store.ops
        pipeline_step(pipe, x, y)
        ops.append(store.ops - before)
        assert pipe.comm.descriptions.unsettled == 0, step  # a step every rank ran: every one was read
        nn.MSELoss()(reference_forward(ref, x), y).backward()
        for (name, p), q in zip(stage.module.named_parameters(), ref[rank].parameters()):
            assert_matches(p.grad, q.grad, f"step {step}: stage {rank} {name}")
    return ops


def descriptions_on_a_communicator_of_their_own(rank, world):
    """Rank 0 sends boundary descriptions to rank 1 on a gloo group used as NCCL would use a
    communicator (one tag: matched by order alone): one left from an earlier step, then step 5's in
    another order than rank 1 asks for them, one longer than a chunk, one "no output", then bytes that
    are no description. Returns what rank 1 read, in the order it asked."""
    from pipecore.executor.descriptions import CHUNK, DescriptionTimeout, Descriptions, OutOfStep

    group = dist.new_group(backend="gloo")
    mail = Descriptions(group, 0, torch.device("cpu"))
    long = bytes(range(256)) * (3 * CHUNK // 256)
    if rank == 0:
        mail.send(1, 4, 0, 0, b"left from step 4" * 200)  # (a rest of its own, dropped with it)
        for mb, payload in [(0, b"short"), (1, long), (2, None)]:
            mail.send(1, 5, 0, mb, payload)
        not_one = torch.zeros(CHUNK, dtype=torch.uint8)
        sent = group.send([not_one], 1, 0)  # (kept: gloo may not send what a dropped Work asked for)
        dist.barrier()  # (not on `group`: rank 1's timed-out receive closes its connections)
        return None
    read = [mail.receive(0, 5, 0, 2, timeout=30)]
    kept = [mail.waiting(0, 5, 0, mb) for mb in range(3)]
    read += [mail.receive(0, 5, 0, 1, timeout=30) == long, mail.receive(0, 5, 0, 0, timeout=30)]
    for ask, error in [(3, OutOfStep), (4, DescriptionTimeout)]:
        try:
            mail.receive(0, 5, 0, ask, timeout=0.5)
        except error as exc:
            read.append(f"{type(exc).__name__}: {exc}")
    dist.barrier()
    return read, kept


def shapes_in_messages_on_one_rank(rank, world):
    """variable_shapes=True on rank 0 only (the timeout never runs out: only an agreement can end
    this). Returns the error each rank's first step raised (type, text) and how long it took."""
    torch.manual_seed(0)
    model = [nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)]
    stage = pc.PipelineStage(model[rank], rank, world)
    pipe = pc.Pipeline(stage, pc.build_schedule("1f1b", world, 2, 1), 2, loss_fn=nn.MSELoss(), timeout=NEVER,
                       variable_shapes=rank == 0)
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    start = time.monotonic()
    try:
        pipeline_step(pipe, x, y)
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return type(exc).__name__, said(exc), time.monotonic() - start
    return None, None, time.monotonic() - start


class Scale(nn.Module):
    """A stage of one parameter: large messages at little compute."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.w


def timed_out_send_is_held(rank, world):
    """1F1B on 2 ranks, timeout 2 s, 32 MiB activations (more than a socket takes in): rank 1 posts
    each receive only at its action (recv_window=0) and hangs in its first forward for 5 s, so rank
    0's send of microbatch 1 is not taken within its timeout. Returns each rank's step outcome and how
    many failed sends its executor holds, waited for up to 5 s after the step's error (a send's own
    timeout may end after it)."""
    group = dist.new_group(backend="gloo")
    stage = pc.PipelineStage(Scale(), rank, world)
    pipe = pc.Pipeline(stage, pc.build_schedule("1f1b", world, 4, 1), 4, loss_fn=nn.MSELoss(), timeout=2,
                       group=group, recv_window=0)
    x, y = torch.randn(4 * 1024, 4096), torch.randn(4 * 1024, 4096)  # float64: 32 MiB per microbatch
    pipeline_step(pipe, x, y)
    if rank == 1:
        hang = {"left": 1}

        def stall(mod, args):
            if hang["left"]:
                hang["left"] -= 1
                time.sleep(5)
        stage.module.register_forward_pre_hook(stall)
    try:
        pipeline_step(pipe, x, y)
        outcome = "ok"
    except Exception as exc:  # noqa: BLE001 - returned to the test
        outcome = type(exc).__name__
    deadline = time.monotonic() + 5
    while pipe.executor.held_failed_sends == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return outcome, pipe.executor.held_failed_sends


def stuck_replica_aborts_its_group(rank, world):
    """2 data-parallel replicas of a 1-rank pipeline, timeout 2 s: replica 1's backward takes 5 s, so
    replica 0's gradient reduction times out. Both groups are taken for NCCL ones and the aborts asked
    for are recorded (these gloo groups have no communicator to abort). Returns the step's outcome and
    which groups the abort was asked for ("dp", "pp")."""
    dp_group = dist.new_group(backend="gloo")
    own = [dist.new_group([r], backend="gloo") for r in range(world)][rank]
    torch.manual_seed(0)
    stage = pc.PipelineStage(Scale(), 0, 1)
    pipe = pc.Pipeline(stage, pc.build_schedule("1f1b", 1, 2, 1), 2, loss_fn=nn.MSELoss(), timeout=2, group=own,
                       dp_group=dp_group)
    pipe.comm.p2p_is_nccl = lambda: True
    pipe.comm._is_nccl = lambda group: True
    asked = []
    real = dist.distributed_c10d._abort_process_group
    dist.distributed_c10d._abort_process_group = lambda group=None: asked.append(
        "dp" if group is dp_group else "pp" if group is own else "other")
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    try:
        pipeline_step(pipe, x, y)
        if rank == 1:
            stage.module.w.register_hook(lambda g: time.sleep(5) or g)
        pipeline_step(pipe, x, y)
        outcome = ("ok", "")
    except Exception as exc:  # noqa: BLE001 - returned to the test
        outcome = (type(exc).__name__, said(exc))
    finally:
        dist.distributed_c10d._abort_process_group = real
    return outcome, asked
