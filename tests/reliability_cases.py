"""Failure cases run on every rank of a gloo pool; each returns what its rank saw."""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import pipecore as pc
from exactness import assert_matches
from models import NEVER, make_batch, make_stages, model_stage_count, rank_stages, reference_forward, pipeline_step
from pipecore.errors import CommunicationError, InputError, PeerFailedError
from pipeline_cases import set_messages


def _pipe(rank, world, name="1f1b", m=4, kind="mlp", group=None, timeout=NEVER, model=None, **kw):
    V = 1 if name in ("gpipe", "1f1b") else 2
    sched = pc.build_schedule(name, world, m, V)
    model = model if model is not None else make_stages(kind, model_stage_count(sched))
    stages = rank_stages(sched, rank, model)
    return pc.Pipeline(stages, sched, m, loss_fn=nn.CrossEntropyLoss(), group=group, timeout=timeout, **kw), model


def _outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return (type(exc).__name__, str(exc), time.monotonic() - t0)


def failing_stage(rank, world, name, bad_rank, where, messages="default"):
    """A stage raising in forward / loss / backward on `bad_rank`; then a clean step must match the
    reference (the pipeline recovered). `messages`: see set_messages."""
    group = dist.new_group(backend="gloo")
    pipe, model = _pipe(rank, world, name, group=group)
    set_messages(pipe, messages)
    fail = {"on": True}
    stage = pipe.stages[0]
    if rank == bad_rank:
        if where == "forward":
            def hook(mod, args):
                if fail["on"]:
                    raise RuntimeError("boom in forward")
            stage.module.register_forward_pre_hook(hook)
        elif where == "backward":
            def bhook(mod, grad_in, grad_out):
                if fail["on"]:
                    raise RuntimeError("boom in backward")
            stage.module.register_full_backward_hook(bhook)
    if where == "loss" and pipe.has_last:
        inner = pipe.loss_fn

        def loss(out, y):
            if fail["on"]:
                raise RuntimeError("boom in loss")
            return inner(out, y)
        pipe.loss_fn = loss
    x, y = make_batch(8)
    if messages == "device":  # a first step learns the shapes (the host reads each message); the failing one is the device path's
        fail["on"] = False
        pipeline_step(pipe, x, y)
        fail["on"] = True
        for s in pipe.stages:
            s.module.zero_grad(set_to_none=True)
    first = _outcome(lambda: pipeline_step(pipe, x, y))
    if messages == "device":
        assert pipe.executor.threaded_posts == 0 and pipe.executor.reverse_posts == 0, "not the device path"
    fail["on"] = False
    for s in pipe.stages:
        s.module.zero_grad(set_to_none=True)
    second = _outcome(lambda: pipeline_step(pipe, x, y))
    # the recovered step equals single-process training
    ref = copy.deepcopy(model)
    nn.CrossEntropyLoss()(reference_forward(ref, x), y).backward()
    topo = pipe.schedule.topology
    for s in pipe.stages:
        for p, q in zip(s.module.parameters(), ref[topo.model_stage[s.stage_index]].parameters()):
            assert_matches(p.grad, q.grad, f"rank {rank} stage {s.stage_index}")
    dist.destroy_process_group(group)
    return first, second


def _faulty_pipe(rank, world, bad_rank, fault, timeout, messages="default"):
    """A 1f1b pipeline on a group of its own whose `bad_rank` runs `fault` before its forward."""
    group = dist.new_group(backend="gloo")
    pipe, _ = _pipe(rank, world, "1f1b", group=group, timeout=timeout)
    set_messages(pipe, messages)
    if rank == bad_rank:
        pipe.stages[0].module.register_forward_pre_hook(lambda mod, args: fault())
    return pipe


def hanging_rank(rank, world, bad_rank, warm=False, messages="default"):
    """A rank stuck in its forward longer than the timeout: its peers fail with a clear error.
    `warm`: after a first good step (the hang is then met waiting for data, not for shapes)."""
    hang = {"on": not warm}
    pipe = _faulty_pipe(rank, world, bad_rank, lambda: time.sleep(6) if hang["on"] else None, 2, messages)
    x, y = make_batch(8)
    if warm:
        pipeline_step(pipe, x, y)
        hang["on"] = True
    result = _outcome(lambda: pipeline_step(pipe, x, y))
    after = _outcome(lambda: pipeline_step(pipe, x, y))
    return result, after


def comm_error_aborts_an_nccl_group(rank, world):
    """hanging_rank (rank 0 hangs) with the Pipeline's group taken for an NCCL one: the abort of its
    communicator is asked for that group (recorded here: this gloo group has none), and the error
    says so. Returns the step's outcome, the groups the abort was asked for (True: the Pipeline's),
    and where each receive of the run was posted (-1: never; nothing goes onto a wedged communicator)."""
    hang = {"on": False}  # from the second step: the first learns the shapes
    pipe = _faulty_pipe(rank, world, 0, lambda: time.sleep(6) if hang["on"] else None, 2, "device")
    pipe.comm.p2p_is_nccl = lambda: True
    asked = []
    real = dist.distributed_c10d._abort_process_group
    dist.distributed_c10d._abort_process_group = lambda group=None: asked.append(group is pipe.group)
    try:
        x, y = make_batch(8)
        pipeline_step(pipe, x, y)
        hang["on"] = True
        return _outcome(lambda: pipeline_step(pipe, x, y)), asked, pipe.executor.recv_posted_at()
    finally:
        dist.distributed_c10d._abort_process_group = real


def dying_rank(rank, world, bad_rank):
    pipe = _faulty_pipe(rank, world, bad_rank, lambda: os._exit(3), timeout=NEVER)
    x, y = make_batch(8)
    return _outcome(lambda: pipeline_step(pipe, x, y))


def bad_input(rank, world, case):
    pipe, _ = _pipe(rank, world, "1f1b", m=4, check_finite=(case == "nan"))
    x, y = make_batch(8)
    if case == "unsplittable" and rank == 0:
        x = x[:3]
    if case == "no_target" and pipe.has_last:
        y = None
    if case == "nan" and pipe.has_last:
        inner = pipe.loss_fn
        pipe.loss_fn = lambda out, t: inner(out, t) * float("nan")
    if case == "rank":
        mod = pipe.stages[0].module
        calls = {"n": 0}

        def grow(m_, args, out):  # from the second step on, an output of another rank than the plan's (its
            calls["n"] += 1       # shapes may change: messages carry them)
            return out.unsqueeze(0) if rank == 0 and calls["n"] > 6 else out
        mod.register_forward_hook(grow)
        pipeline_step(pipe, x, y)
    first = _outcome(lambda: pipeline_step(pipe, x, y))
    return first


def mismatched_stage(rank, world, name, bad_stage):
    """Stage `bad_stage` takes another width than its predecessor returns (a model bug): its forward
    fails in the first step; every rank fails at once, twice in a row (the group stays usable)."""
    V = 1 if name in ("gpipe", "1f1b") else 2
    model = make_stages("mlp", world * V)
    model[bad_stage].fc = nn.Linear(7, 16)
    pipe, _ = _pipe(rank, world, name, m=4, model=model)
    x, y = make_batch(8)
    outcomes = []
    for _ in range(2):
        t0 = time.monotonic()
        try:
            pipeline_step(pipe, x, y)
            outcomes.append(("ok", "", time.monotonic() - t0, ""))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            notes = "\n".join(getattr(exc, "__notes__", []))
            outcomes.append((type(exc).__name__, str(exc), time.monotonic() - t0, notes))
    return outcomes


def no_loss_fn(rank, world):
    sched = pc.build_schedule("1f1b", world, 2)
    model = make_stages("mlp", world)
    pipe = pc.Pipeline(pc.PipelineStage(model[rank], rank, world), sched, 2, loss_fn=None, timeout=20)
    x, y = make_batch(4)
    return _outcome(lambda: pipeline_step(pipe, x, y))


def construction_errors(rank, world):
    model = make_stages("mlp", 4)
    out = {}
    out["wrong_count"] = _outcome(lambda: pc.Pipeline(pc.PipelineStage(model[rank], rank, 4), "1f1b", 4))
    out["wrong_index"] = _outcome(lambda: pc.Pipeline(pc.PipelineStage(model[0], 1 - rank, 2), "1f1b", 4))
    out["too_few_microbatches"] = _outcome(lambda: pc.Pipeline(
        [pc.PipelineStage(model[rank], rank, 4), pc.PipelineStage(model[3 - rank], 3 - rank, 4)], "dualpipev", 3))
    bad = pc.Schedule([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]])
    out["bad_schedule"] = _outcome(lambda: pc.Pipeline(pc.PipelineStage(model[0], rank, 2), bad, 2))
    out["bad_recv_window"] = _outcome(lambda: pc.Pipeline(pc.PipelineStage(model[0], rank, 2), "1f1b", 2,
                                                          recv_window=-1))
    out["endless_timeout"] = _outcome(lambda: pc.Pipeline(pc.PipelineStage(model[0], rank, 2), "1f1b", 2,
                                                          timeout=float("inf")))
    return out


def stress(rank, world, name, steps, max_delay_us, seed):
    """Random delays before every send and receive; many steps with an optimizer; every step equal
    to single-process training."""
    pipe, model = _pipe(rank, world, name, m=4, kind="transformer")
    pipe.executor.set_delays(max_delay_us, seed + rank)
    ref = copy.deepcopy(model)
    params = [p for s in pipe.stages for p in s.module.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    ref_opt = torch.optim.SGD([p for s in ref for p in s.parameters()], lr=0.05)
    topo = pipe.schedule.topology
    for step in range(steps):
        x, y = make_batch(10, seed=step)
        pipeline_step(pipe, x, y)
        nn.CrossEntropyLoss()(reference_forward(ref, x), y).backward()
        for s in pipe.stages:
            for p, q in zip(s.module.parameters(), ref[topo.model_stage[s.stage_index]].parameters()):
                assert_matches(p.grad, q.grad, f"stage {s.stage_index} step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    return True


def memory_is_flat(rank, world, steps):
    pipe, _ = _pipe(rank, world, "interleaved_1f1b", m=4, kind="transformer")
    x, y = make_batch(64)

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    for _ in range(5):
        pipeline_step(pipe, x, y)
    before = rss()
    for _ in range(steps):
        pipeline_step(pipe, x, y)
    return rss() - before


def threads_of_this_process():
    """(name, scheduling policy) of each thread of this process, read from /proc (policy 3 is SCHED_BATCH)."""
    found = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the name: fields[0] is field 3
        except OSError:  # a thread that ended meanwhile
            continue
        found.append((name, int(fields[38])))  # field 41: the policy
    return found


def reverse_channel(rank, world):
    """The reverse channel opens at the first step, once, over the pipeline's group, on that group's
    own gloo device (no extra event-loop thread)."""
    def loop_threads():
        return sum(name == "gloo_tcp_loop" for name, _ in threads_of_this_process())

    group = dist.new_group(backend="gloo")
    before = loop_threads()
    pipe, _ = _pipe(rank, world, "1f1b", group=group)
    assert pipe.comm.reverse_channel is None
    x, y = make_batch(8)
    pipeline_step(pipe, x, y)
    channel = pipe.comm.reverse_channel
    assert channel is not None and channel.size() == world and channel.rank() == rank
    pipeline_step(pipe, x, y)
    assert pipe.comm.reverse_channel is channel
    assert loop_threads() == before
    assert pipe.executor.reverse_posts > 0
    dist.destroy_process_group(group)


def sends_posted_here(rank, world, name, rows):
    """A steady step's posting: a small send whose next compute action takes a received message goes
    out on the compute thread (when the comm worker has nothing queued), everything else through the
    worker. Returns, for 5 steps, (posted here, threaded posts), and the sends allowed to be posted
    here and the sends and receives of one step."""
    from pipecore.executor.native import OPCODES
    from shaped_message_cases import actions_in_program

    group = dist.new_group(backend="gloo")
    pipe, _ = _pipe(rank, world, name, m=8, group=group)
    x, y = make_batch(rows)
    pipeline_step(pipe, x, y)  # learns the shapes
    steps = []
    for _ in range(5):  # whether the worker is idle at a send varies: several steps
        pipeline_step(pipe, x, y)
        steps.append((pipe.executor.posted_here, pipe.executor.threaded_posts))
    flat = pipe.programs[True].instructions
    ops = [tuple(flat[i:i + 3]) for i in range(0, len(flat), 5)]  # (op, stage, microbatch)
    received = {(op, s, k) for op, s, k in ops if op in (OPCODES["RECV_F"], OPCODES["RECV_B"])}
    sends = (OPCODES["SEND_F"], OPCODES["SEND_B"])
    comm = sends + (OPCODES["RECV_F"], OPCODES["RECV_B"])
    allowed = 0
    for i, (op, _, _) in enumerate(ops):
        if op not in sends:
            continue
        nxt = next(((o, s, k) for o, s, k in ops[i + 1:] if o not in comm), None)
        if nxt is None:
            continue
        takes = OPCODES["RECV_F"] if nxt[0] == OPCODES["F"] else OPCODES["RECV_B"] if nxt[0] in (
            OPCODES["B"], OPCODES["I"]) else None
        allowed += (takes, nxt[1], nxt[2]) in received
    dist.destroy_process_group(group)
    return steps, allowed, actions_in_program(pipe, "SEND_F", "SEND_B", "RECV_F", "RECV_B")


def helper_threads(rank, world):
    """After a gloo step: pipecore's own threads of this process, as (name, scheduling policy)."""
    import gc

    group = dist.new_group(backend="gloo")
    pipe, _ = _pipe(rank, world, "1f1b", m=4, group=group)
    x, y = make_batch(8)
    pipeline_step(pipe, x, y)
    pipeline_step(pipe, x, y)
    gc.collect()  # (Pipelines of earlier tests in this pooled process: their threads end with them)
    found = sorted(t for t in threads_of_this_process() if t[0].startswith("pipecore"))
    dist.destroy_process_group(group)
    return found


def own_error_then_peer_hangs(rank, world, messages="default", m=4, hang=4):
    """Rank 0's forward of microbatch 1 raises while rank 1 hangs longer than the timeout (for `hang` s): rank 0
    cannot release rank 1 (its wait for rank 1's gradients times out), so its own error must not
    hide that the group broke, and the group's communicator is aborted (the Pipeline's group taken
    for an NCCL one: the abort is recorded, as in comm_error_aborts_an_nccl_group). `messages`:
    set_messages' (on "device" a timed-out wait leaves the connection open, as on NCCL)."""
    group = dist.new_group(backend="gloo")
    pipe, _ = _pipe(rank, world, "1f1b", m=m, group=group, timeout=2)
    set_messages(pipe, messages)
    pipe.comm.p2p_is_nccl = lambda: True
    asked = []
    real = dist.distributed_c10d._abort_process_group
    dist.distributed_c10d._abort_process_group = lambda group=None: asked.append(group is pipe.group)
    x, y = make_batch(8)
    pipeline_step(pipe, x, y)
    calls = {"n": 0}

    def fault(mod, args):
        calls["n"] += 1
        if rank == 0 and calls["n"] == 2:
            raise RuntimeError("boom on rank 0")
        if rank == 1 and calls["n"] == 1:
            time.sleep(hang)
    pipe.stages[0].module.register_forward_pre_hook(fault)
    t0 = time.monotonic()
    try:
        pipeline_step(pipe, x, y)
        first = ("ok", "", None)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        first = (type(exc).__name__, str(exc), f"{type(exc.__cause__).__name__}: {exc.__cause__}")
    seconds = time.monotonic() - t0
    after = _outcome(lambda: pipeline_step(pipe, x, y))
    dist.distributed_c10d._abort_process_group = real
    return first, seconds, after, asked


def comm_error_keeps_gradients_held_before(rank, world, bad_rank):
    """dualpipe (its mirrors' gradients are set aside during a step): the first step's gradients are
    held, then `bad_rank` hangs past the timeout in the second step. Whatever each rank raises, every
    parameter's .grad is what it held before that step, not lost."""
    group = dist.new_group(backend="gloo")
    pipe, _ = _pipe(rank, world, "dualpipe", group=group, timeout=2)
    hang = {"on": False}
    if rank == bad_rank:
        pipe.stages[0].module.register_forward_pre_hook(lambda mod, args: time.sleep(6) if hang["on"] else None)
    x, y = make_batch(8)
    pipeline_step(pipe, x, y)
    params = [p for s in pipe.stages for p in s.module.parameters()]
    held = [None if p.grad is None else p.grad.clone() for p in params]
    hang["on"] = True
    outcome = _outcome(lambda: pipeline_step(pipe, x, y))
    kept = all((h is None and p.grad is None) or (h is not None and p.grad is not None and torch.equal(h, p.grad))
               for h, p in zip(held, params))
    return outcome, kept, sum(h is not None for h in held)


# -- an error on one rank, at building or at the first step: every rank raises it at once -------------
BUILD_ERRORS = ("wrong_stages", "microbatches", "world_size", "bad_keyword")
STEP_ERRORS = ("bad_input", "forward_raises", "returns_none", "cannot_take_inputs")


def one_rank_fails(rank, world, kind, name, bad_rank, dp=1, steps=1, local=0):
    """`kind` goes wrong on `bad_rank` only: building its Pipeline (BUILD_ERRORS), or its first
    `steps` steps (STEP_ERRORS; a stage's fault is in its `local`-th stage). With dp=2, pipelines of
    world/2 ranks over pc.init_mesh(dp=2, pp=world/2). Returns this rank's outcome of building, then of
    each step that ran: (what, kind, message, seconds since that began on this rank)."""
    pp = world // dp
    V = 1 if name in ("gpipe", "1f1b") else 2
    m = 4
    sched = pc.build_schedule(name, pp, m, V)
    group = dp_group = None
    if dp > 1:
        from data_parallel_cases import data_parallel_mesh

        mesh = data_parallel_mesh(dp, pp)
        group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    position = rank % pp
    model = make_stages("mlp", model_stage_count(sched))
    stages = rank_stages(sched, position, model)
    if kind.endswith("_ddp"):  # the stages wrapped in DDP, no dp_group given: the wrappers name the replicas
        kind = kind.removesuffix("_ddp")
        for s in stages:
            s.module = nn.parallel.DistributedDataParallel(s.module, process_group=dp_group)
        dp_group = None
    args = [stages, sched, m]
    options = {}
    bad = rank == bad_rank
    if bad and kind == "wrong_stages":
        args[0] = rank_stages(sched, (position + 1) % pp, model)
    if bad and kind == "microbatches":
        args[2] = 2 * m
    if bad and kind == "world_size":
        args[1] = pc.build_schedule(name, pp + 1, 2 * m, V)
    if bad and kind == "bad_keyword":
        options["recv_windw"] = 0
    outcomes = []
    t0 = time.monotonic()
    try:
        pipe = pc.Pipeline(*args, loss_fn=nn.CrossEntropyLoss(), group=group, dp_group=dp_group, timeout=NEVER,
                           **options)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return [("build", type(exc).__name__, str(exc), time.monotonic() - t0)]
    stage = pipe.stages[local]
    if bad and kind == "forward_raises":
        def boom(*a, **k):
            raise RuntimeError(f"boom in forward of stage {stage.stage_index}")
        stage.module.forward = boom
    if bad and kind == "returns_none":
        stage.module.forward = lambda *a, **k: None  # a forgotten `return`
    if bad and kind == "cannot_take_inputs":
        narrow = nn.Linear(7, 16)
        stage.module.forward = lambda x, *rest, **k: narrow(x)
    x, y = make_batch(8 * dp)
    x, y = x.chunk(dp)[rank // pp], y.chunk(dp)[rank // pp]
    for _ in range(steps):
        inputs, extra = ((x,) if pipe.has_first else ()), {}
        if bad and kind == "bad_input":  # a batch that does not split; keyword inputs where no stage takes them
            inputs, extra = ((x[:3],), {}) if pipe.has_first else ((), {"mask": x})
        t0 = time.monotonic()
        try:
            pipe.step(*inputs, target=y if pipe.has_last else None, **extra)
            outcomes.append(("step", "ok", "", time.monotonic() - t0))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcomes.append(("step", type(exc).__name__, str(exc), time.monotonic() - t0))
    return [("build", "ok", "", 0.0)] + outcomes


def build_fails_then(rank, world, name, bad_rank, then, dp=1):
    """Rank `bad_rank`'s Pipeline cannot be built (twice the microbatches); it catches the error, then
    `then`: "collective" (every rank all-reduces on the pipeline's group before its first step, as a
    user's logging might), "eval" (the first call is eval(); with dp=2 the other replica trains) or
    "rebuild" (every rank builds the Pipeline again, right, after the error). Returns this rank's
    (build seconds, its error or '', the first call's error or '', the rebuilt Pipeline's step: 'ok'
    or its error)."""
    pp = world // dp
    sched = pc.build_schedule(name, pp, 4, 1 if name in ("gpipe", "1f1b") else 2)
    group = dp_group = None
    if dp > 1:
        from data_parallel_cases import data_parallel_mesh

        mesh = data_parallel_mesh(dp, pp)
        group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    model = make_stages("mlp", model_stage_count(sched))
    stages = rank_stages(sched, rank % pp, model)
    x, y = make_batch(8)
    t0 = time.monotonic()
    built = ""
    try:
        pipe = pc.Pipeline(stages, sched, 8 if rank == bad_rank else 4, loss_fn=nn.CrossEntropyLoss(), group=group,
                           dp_group=dp_group, timeout=NEVER)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        pipe, built = None, str(exc)
    seconds = time.monotonic() - t0
    if then == "collective":
        dist.all_reduce(torch.ones(1), group=group)
    first = ""
    if pipe is not None:
        try:
            if then == "eval" and rank // pp == bad_rank // pp:  # the broken pipeline evaluates first
                pipe.eval(*((x,) if pipe.has_first else ()))
            else:
                pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
            first = "ok"
        except Exception as exc:  # noqa: BLE001
            first = str(exc)
    rebuilt = ""
    if then == "rebuild":
        pipe = pc.Pipeline(stages, sched, 4, loss_fn=nn.CrossEntropyLoss(), group=group, dp_group=dp_group,
                           timeout=NEVER)
        pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
        rebuilt = "ok"
    return seconds, built, first, rebuilt


def tie_copies_not_made_equal(rank, world):
    """1F1B, the first and last stages' weights tied, `timeout` 2 s; on the last rank making the copies equal at the
    first agreement fails (out of memory, say). What each rank's first step raised, whether its group was broken
    then, and what its second step raised."""
    from pipecore.training.ties import TiedWeights

    group = dist.new_group(backend="gloo")
    sched = pc.build_schedule("1f1b", world, 4)
    torch.manual_seed(0)
    model = [nn.Linear(4, 4) for _ in range(world)]
    stages = [pc.PipelineStage(model[s], s, world, tied={"w": model[s].weight} if s in (0, world - 1) else None)
              for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, 4, loss_fn=lambda y, t: y.sum(), group=group, timeout=2)
    real = TiedWeights.make_copies_equal

    def refused(self):
        raise RuntimeError("out of memory while making the copies equal")
    if rank == world - 1:
        TiedWeights.make_copies_equal = refused
    try:
        first = _outcome(lambda: pipe.step(torch.randn(8, 4), target=torch.zeros(8)))
    finally:
        TiedWeights.make_copies_equal = real
    broken = pipe.comm.broken is not None
    return first, broken, _outcome(lambda: pipe.step(torch.randn(8, 4), target=torch.zeros(8)))
