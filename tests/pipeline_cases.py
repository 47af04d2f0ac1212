"""Cases run on every rank of a gloo pool: pipeline training against single-process training."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipecore as pc
from exactness import EXACT_DTYPE, assert_matches, default_dtype, difference, rounding_bound
from models import (Sleepy, make_batch, make_stages, model_stage_count, rank_stages, reference_forward, pipeline_step,
                    stack_terms)


def train_and_compare(rank, world, name, m, V, kind, rows, steps=1, scale_grads=True, optimizer=False,
                      accumulate=False, recv_window=None, messages="default", send_budget=None, dtype=EXACT_DTYPE):
    """`recv_window` = (receives ahead, past_sends, max_bytes ahead): run with that window, and check
    when every receive was posted. `messages`: see set_messages. `send_budget`: Pipeline's.
    `name` may be (name, build_schedule's keyword options). `dtype`: the model's and the batch's (other
    than float64: within the rounding of the stack's sums, models.stack_terms)."""
    name, options = (name, {}) if isinstance(name, str) else name
    sched = pc.build_schedule(name, world, m, V, **options)
    topo = sched.topology
    with default_dtype(dtype):
        model = make_stages(kind, model_stage_count(sched))
    bound = None if dtype == EXACT_DTYPE else rounding_bound(dtype, stack_terms(rows, model_stage_count(sched)))
    ref = copy.deepcopy(model)
    mine = rank_stages(sched, rank, model)
    reduction = "mean" if scale_grads else "sum"
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    pipe = pc.Pipeline(mine, sched, m, loss_fn=loss_fn, scale_grads=scale_grads, timeout=60,
                       **({} if send_budget is None else {"send_budget": send_budget}))
    if recv_window is not None:
        pipe.executor.set_recv_window(*recv_window)  # past_sends=False as on NCCL, here on gloo
    set_messages(pipe, messages)
    params = [p for s in mine for p in s.module.parameters()]
    ref_params = [p for s in ref for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.05) if optimizer else None
    ref_opt = torch.optim.SGD(ref_params, lr=0.05) if optimizer else None
    worst = 0.0
    for step in range(steps):
        with default_dtype(dtype):
            x, y = make_batch(rows, seed=step + 1)
        losses: list = []
        with torch.no_grad():
            ref_chunks = [reference_forward(ref, xc) for xc in torch.tensor_split(x, m)]
            ref_mb_losses = [loss_fn(o, yc) for o, yc in zip(ref_chunks, torch.tensor_split(y, m))]
        out = pipeline_step(pipe, x, y, losses=losses)
        ref_loss = loss_fn(reference_forward(ref, x), y)
        ref_loss.backward()
        # every parameter of this rank's stages
        for s in mine:
            ref_stage = ref[topo.model_stage[s.stage_index]]
            for (n, p), (_, q) in zip(s.module.named_parameters(), ref_stage.named_parameters()):
                worst = max(worst, assert_matches(p.grad, q.grad, f"rank {rank} stage {s.stage_index} {n} step {step}",
                                                  bound))
        # losses and outputs where computed
        if pipe.has_last:
            assert len(losses) == m
            computed = [mb for mb in range(m) if losses[mb] is not None]
            assert computed, "no loss computed on a last-stage rank"
            for mb in computed:
                assert_matches(losses[mb], ref_mb_losses[mb], f"rank {rank} loss of microbatch {mb} step {step}", bound)
            want = torch.cat([ref_chunks[mb] for mb in computed])
            assert_matches(out, want, f"rank {rank} output step {step}", bound)
        else:
            assert out is None and losses == []
        if recv_window is not None and step > 0:  # the first step posts each receive at its action
            _check_recv_posting(pipe, *recv_window)
        _check_program(pipe, sched)
        if messages == "device":  # (a first step, which learns shapes, posts its batches this way too)
            # every message went in a batch on the pipeline's group, posted by the compute thread
            assert pipe.executor.reverse_posts == 0 and pipe.executor.threaded_posts == 0
            assert pipe.executor._stream_violations() == []  # (tests/stream_contract_cases.py)
        else:
            _check_reverse_channel(pipe)
            if messages == "direct":
                assert pipe.executor.threaded_posts == 0
            elif pipe.has_first or world > 1:
                assert pipe.executor.threaded_posts > 0
        if optimizer:
            opt.step()
            ref_opt.step()
        if not accumulate:
            for p in params + ref_params:
                p.grad = None
    return worst


def pipelines_on_subgroups(rank, world, name):
    """Data parallel x pipeline parallel: two pipelines of world/2 ranks each, on groups of their own
    (each with its own second gloo channel), train on different batches; each matches one process."""
    half = world // 2
    groups = [dist.new_group(list(range(k * half, (k + 1) * half)), backend="gloo") for k in range(2)]
    replica = rank // half
    group = groups[replica]
    V = 1 if name in ("gpipe", "1f1b") else 2
    m = 2 * half
    sched = pc.build_schedule(name, half, m, V)
    topo = sched.topology
    model = make_stages("mlp", topo.num_stages)
    ref = copy.deepcopy(model)
    mine = [pc.PipelineStage(copy.deepcopy(model[s]), s, sched.num_stages)
            for s in sched.rank_stages(dist.get_rank(group))]
    pipe = pc.Pipeline(mine, sched, m, loss_fn=nn.CrossEntropyLoss(), group=group, timeout=60)
    x, y = make_batch(3 * m + 1, seed=10 + replica)
    pipeline_step(pipe, x, y)
    nn.CrossEntropyLoss()(reference_forward(ref, x), y).backward()
    for s in mine:
        for (n, p), q in zip(s.module.named_parameters(), ref[s.stage_index].parameters()):
            assert_matches(p.grad, q.grad, f"rank {rank} replica {replica} stage {s.stage_index} {n}")
    _check_reverse_channel(pipe)
    assert pipe.executor.reverse_posts > 0
    del pipe
    for g in groups:
        dist.destroy_process_group(g)


def set_messages(pipe, mode):
    """mode "large": every message as large ones go (its tensors from their own storage, then a
    trailer); "direct": sends and receives posted by the compute thread (as on NCCL), not the comm
    thread; "device": the device path's protocol (batches, statuses folded when consumed and read at
    the step's end, gated loss seeds), run by the host over gloo (csrc/testing/host_device_comm.cpp)."""
    if mode == "large":
        pipe.executor.set_large_messages(0)
    elif mode == "direct":
        pipe.executor.set_comm_thread(False)
    elif mode == "device":
        pipe.executor._emulate_device_comm()
        assert pipe.executor.device_comm


def _check_program(pipe, sched):
    """The executor runs exactly Schedule.lower()'s actions for this rank (what the simulator prices)."""
    labels = pipe.programs[True].labels
    want = []
    for a in sched.lower().actions[pipe.rank]:
        want.extend([f"PP:{a}", *(f"PP:{sub}" for sub in a.sub_actions), f"PP:{a}"] if a.kind is pc.Kind.OVERLAP_F_B
                    else [f"PP:{a}"])
    assert labels == want, (labels, want)


def _check_reverse_channel(pipe):
    """gloo: exactly the messages that travel to a lower rank went through the reverse channel."""
    flat = pipe.programs[True].instructions
    program = [flat[i:i + 5] for i in range(0, len(flat), 5)]  # op, stage, mb, peer, label
    sends, recvs = (4, 6), (5, 7)
    down = sum(1 for op, _, _, peer, _ in program
               if (op in sends and peer < pipe.rank) or (op in recvs and peer > pipe.rank))
    assert pipe.executor.reverse_posts == down, (pipe.executor.reverse_posts, down)


def _check_recv_posting(pipe, window, past_sends, max_bytes):
    """Each receive was posted exactly when the window allows: as early as possible, never more than
    `window` RECV actions ahead, never after its own RECV action, in program order, and (past_sends
    off) never before an earlier send to the same peer has been posted. A byte budget smaller than
    any message leaves one receive ahead."""
    if max_bytes < 16:
        window = min(window, 1)
    flat, labels = pipe.programs[True].instructions, pipe.programs[True].labels
    program = [flat[i:i + 5] for i in range(0, len(flat), 5)]  # op, stage, mb, peer, label
    SEND, RECV = {4, 6}, {5, 7}
    recvs = [i for i, ins in enumerate(program) if ins[0] in RECV]
    through = []  # RECV actions among program[0..i]
    for i, ins in enumerate(program):
        through.append((through[-1] if through else 0) + (ins[0] in RECV))
    posted_at = pipe.executor.recv_posted_at()
    assert len(posted_at) == len(recvs)
    earliest = 0
    for k, r in enumerate(recvs):
        last_send = max((i for i in range(r) if program[i][0] in SEND and program[i][3] == program[r][3]),
                        default=-1)
        earliest = max(earliest, next(a for a in range(len(program)) if through[a] + window > k))
        if not past_sends:
            earliest = max(earliest, last_send + 1)
        earliest = min(earliest, r)
        assert posted_at[k] == earliest, (labels[program[r][4]], posted_at[k], earliest)


def split_backward_defers_weight_grads(rank, world):
    """I computes input gradients only; the weight gradients appear at W, equal to a full backward."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))
    ref = copy.deepcopy(module)
    sched = pc.Schedule([["0F0", "0I0", "0F1", "0W0", "0I1", "0F2", "0I2", "0W1", "0W2"]])
    seen_at_f = []

    def check(mod, args):
        seen_at_f.append([p.grad is None for p in mod.parameters()])

    module.register_forward_pre_hook(check)
    pipe = pc.Pipeline(pc.PipelineStage(module, 0, 1), sched, 3, loss_fn=lambda out, y: out.pow(2).mean())
    x = torch.randn(6, 8, requires_grad=True)
    pipe.step(x, target=torch.zeros(6))
    # F1 runs after I0 but before W0: no weight gradient accumulated yet
    assert seen_at_f[1] == [True] * 6, seen_at_f
    # F2 runs after W0: every weight has its gradient
    assert seen_at_f[2] == [False] * 6, seen_at_f
    out = nn.Sequential(*ref)(x.detach())
    out.pow(2).mean().backward()
    for (n, p), q in zip(module.named_parameters(), ref.parameters()):
        assert_matches(p.grad, q.grad, n)
    return True


def sent_outputs_freed(rank, world, name, messages="default"):
    """Sent activations are released (storage too) by the send tracker once sent: at their backward
    (whose gradient proves the peer has the activation) they are gone, or go within a second while
    the compute thread waits in the hook. After step() nothing of the step (outputs, received
    buffers, saved activations) is alive."""
    from torch.multiprocessing.reductions import StorageWeakRef

    V = 1 if name in ("gpipe", "1f1b") else 2
    sched = pc.build_schedule(name, world, 4, V)
    model = make_stages("transformer", sched.num_stages)
    mine = [pc.PipelineStage(model[s], s, sched.num_stages) for s in sched.rank_stages(rank)]
    refs: dict = {}
    problems: list = []
    watching = {"on": messages != "device"}

    def keep(stage_index):
        def hook(mod, args, out):
            if not watching["on"]:
                return
            mb = len(refs.setdefault(("out", stage_index), []))
            refs[("out", stage_index)].append(StorageWeakRef(out.untyped_storage()))
            for a in args:
                if isinstance(a, torch.Tensor):
                    refs.setdefault(("in", stage_index), []).append(StorageWeakRef(a.untyped_storage()))
            last = sched.topology.next_stage[stage_index] < 0
            if not last and sched.stage_to_rank(stage_index + 1) != rank:
                # backward of this microbatch: by then the sent output must be gone
                def on_grad(g, mb=mb, stage_index=stage_index):
                    deadline = time.monotonic() + 1.0  # the tracker's thread may not have run yet
                    while not refs[("out", stage_index)][mb].expired() and time.monotonic() < deadline:
                        time.sleep(0.001)
                    if not refs[("out", stage_index)][mb].expired():
                        problems.append(f"stage {stage_index} microbatch {mb}: output alive at its backward")
                out.grad_fn.register_prehook(lambda grads: on_grad(grads))
        return hook

    for s in mine:
        s.module.register_forward_hook(keep(s.stage_index))
    pipe = pc.Pipeline(mine, sched, 4, loss_fn=nn.CrossEntropyLoss())
    set_messages(pipe, messages)
    x, y = make_batch(8)
    if messages == "device":  # the first step learns the shapes, the host reading each message; watch the next
        pipeline_step(pipe, x, y)
        watching["on"] = True
    pipeline_step(pipe, x, y)
    if messages == "device":
        assert pipe.executor.threaded_posts == 0 and pipe.executor.reverse_posts == 0, "not the device path"
    assert not problems, problems

    def alive():  # the first stage's inputs are the caller's batch (alive by design); everything else goes
        return [k for k, lst in refs.items() for r in lst
                if not r.expired() and not (k[0] == "in" and sched.topology.prev_stage[k[1]] < 0)]
    # (the device path's received buffers go when its communicator lets go of their completed group: on the CPU
    # model its stream's thread, as c10d's watchdog on NCCL, a moment after the step)
    deadline = time.monotonic() + 1.0
    while alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not alive(), f"still alive after step: {alive()}"
    return True


def profiler_events(rank, world):
    from torch.profiler import profile

    sched = pc.build_schedule("1f1b", world, 2)
    model = make_stages("mlp", world)
    pipe = pc.Pipeline(pc.PipelineStage(model[rank], rank, world), sched, 2, loss_fn=nn.CrossEntropyLoss())
    x, y = make_batch(4)
    with profile() as prof:
        pipe.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
    names = {e.name for e in prof.events()}
    expected = {f"PP:{a}" for a in sched.lower().actions[rank]}
    missing = expected - names
    assert not missing, f"profiler lacks {sorted(missing)}"
    return sorted(n for n in names if n.startswith("PP:"))


def eval_matches(rank, world, name):
    V = 1 if name in ("gpipe", "1f1b", "forward_only") else 2
    sched = pc.build_schedule(name, world, 4, V)
    model = make_stages("multi", model_stage_count(sched))
    mine = rank_stages(sched, rank, model)
    loss_fn = nn.CrossEntropyLoss()
    pipe = pc.Pipeline(mine, sched, 4, loss_fn=loss_fn)
    x, y = make_batch(10)
    losses: list = []
    out = pipe.eval(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None, losses=losses)
    for s in mine:
        assert all(p.grad is None for p in s.module.parameters())
    if pipe.has_last:
        with torch.no_grad():
            chunks = [reference_forward(model, xc) for xc in torch.tensor_split(x, 4)]
        computed = [mb for mb in range(4) if losses[mb] is not None]
        assert_matches(out, torch.cat([chunks[mb] for mb in computed]), f"rank {rank} output")
        for mb, yc in zip(computed, [torch.tensor_split(y, 4)[mb] for mb in computed]):
            assert_matches(losses[mb], loss_fn(chunks[mb], yc), f"rank {rank} loss of microbatch {mb}")
    if name == "forward_only":  # eval() is its one use: step() would compute no gradient
        with pytest.raises(pc.InputError, match="has no backward: call pipe.eval"):
            pipeline_step(pipe, x, y)
        assert all(p.grad is None for s in mine for p in s.module.parameters())
    return True


def view_outputs_are_copied(rank, world):
    class Slicer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 16)

        def forward(self, x):
            return self.fc(x)[:, :8]  # a view of a larger activation

    torch.manual_seed(0)
    model = [Slicer(), nn.Linear(8, 3)]
    ref = copy.deepcopy(model)
    pipe = pc.Pipeline(pc.PipelineStage(model[rank], rank, 2), "gpipe", 2, loss_fn=nn.CrossEntropyLoss())
    x, y = make_batch(4, width=8, classes=3)
    pipe.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
    nn.CrossEntropyLoss()(ref[1](ref[0](x)), y).backward()
    for p, q in zip(model[rank].parameters(), ref[rank].parameters()):
        assert_matches(p.grad, q.grad, "view stage")
    return True


def nvtx_step(rank, world, fail):
    """One step (1 rank: a stage that raises when `fail`); returns the action ranges expected."""
    sched = pc.build_schedule("1f1b", world, 4)
    model = make_stages("mlp", world)
    module = model[rank]
    if fail:
        def boom(mod, args):
            raise RuntimeError("boom")
        module.register_forward_pre_hook(boom)
    pipe = pc.Pipeline(pc.PipelineStage(module, rank, world), sched, 4, loss_fn=nn.CrossEntropyLoss())
    x, y = make_batch(8)
    try:
        pipe.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
    except RuntimeError as exc:
        if not fail:
            raise
        assert "boom" in str(exc)
    return [f"PP:{a}" for a in sched.lower().actions[rank]]


def traced_step(rank, world, out_dir):
    from pipecore.tools.profiling import draw_trace, gather_trace, to_chrome_trace

    sched = pc.build_schedule("1f1b", world, 4)
    model = make_stages("mlp", world)
    pipe = pc.Pipeline(pc.PipelineStage(model[rank], rank, world), sched, 4, loss_fn=nn.CrossEntropyLoss(),
                       trace=True)
    x, y = make_batch(8)
    pipe.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
    events = gather_trace(pipe)
    if rank == 0:
        to_chrome_trace(events, f"{out_dir}/trace.json")
        draw_trace(events, f"{out_dir}/timeline.png", schedule=sched)
        draw_trace(events, f"{out_dir}/timeline.svg")
    return events


def profiled_steps(rank, world):
    """Pipeline.profile() of a step and an eval where rank 0's forwards sleep 5 ms and rank 1's
    backwards sleep 3 ms (2 ranks, 1f1b, 4 microbatches); and whether profile() refuses untraced."""
    sched = pc.build_schedule("1f1b", world, 4)
    torch.manual_seed(0)
    module = Sleepy(5.0) if rank == 0 else Sleepy(0.0, 3.0)
    stage = pc.PipelineStage(module, rank, world)
    pipe = pc.Pipeline(stage, sched, 4, loss_fn=nn.MSELoss(), trace=True)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    call = {"x": (x,) if rank == 0 else (), "target": y if rank == world - 1 else None}
    pipe.step(*call["x"], target=call["target"])  # learns the shapes
    pipe.step(*call["x"], target=call["target"])
    stepped = pipe.profile()
    pipe.eval(*call["x"], target=call["target"])  # learns the shapes of eval
    pipe.eval(*call["x"], target=call["target"])
    evaluated = pipe.profile()
    untraced = pc.Pipeline(pc.PipelineStage(copy.deepcopy(module), rank, world), sched, 4, loss_fn=nn.MSELoss())
    try:
        untraced.profile()
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return stepped, evaluated, len(pipe.programs[True].labels), refused


def changing_batch_shapes(rank, world, name, messages="default"):
    """Batches of different sizes step after step (and eval in between): each step equals
    single-process training; shapes are agreed on again only when they change (the device path),
    or never (gloo: messages carry them)."""
    V = 1 if name in ("gpipe", "1f1b") else 2
    sched = pc.build_schedule(name, world, 4, V)
    topo = sched.topology
    model = make_stages("multi", model_stage_count(sched))
    ref = copy.deepcopy(model)
    mine = rank_stages(sched, rank, model)
    pipe = pc.Pipeline(mine, sched, 4, loss_fn=nn.CrossEntropyLoss(), timeout=60)
    set_messages(pipe, messages)
    for i, rows in enumerate([12, 12, 9, 9, 12, 16]):
        x, y = make_batch(rows, seed=i)
        if i == 3:
            pipe.eval(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
        pipeline_step(pipe, x, y)
        nn.CrossEntropyLoss()(reference_forward(ref, x), y).backward()
        for s in mine:
            for (n, p), q in zip(s.module.named_parameters(), ref[topo.model_stage[s.stage_index]].parameters()):
                assert_matches(p.grad, q.grad, f"step {i} rows {rows} stage {s.stage_index} {n}")
                p.grad = None
        for q in ref:
            q.zero_grad(set_to_none=True)
    return len(pipe.plans)


def given_shapes(rank, world, name, kind, rows, wrong):
    """Stages built with input_args/output_args (as torch's PipelineStage takes them): training equal
    to the reference; `wrong`: stage 0 declares wrong "rows" or "width", which its first forward
    shaped like input_args contradicts."""
    from models import as_call

    m = 2 * world
    V = 1 if name in ("gpipe", "1f1b") else 2
    sched = pc.build_schedule(name, world, m, V)
    model = make_stages(kind, sched.topology.num_stages)
    ref = copy.deepcopy(model)
    x, y = make_batch(rows)
    # one full microbatch's inputs and outputs of every stage, as a user would declare them (meta)
    examples, value = [], torch.tensor_split(x, m)[0]
    with torch.no_grad():
        for i, st in enumerate(model):
            args, kwargs = ((value,), {}) if i == 0 else as_call(value)
            value = st(*args, **kwargs)
            examples.append((tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args),
                             torch.utils._pytree.tree_map(
                                 lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)))
    if wrong:  # stage 0 declares 99 rows or 99 columns
        rows0, cols0 = examples[0][1].shape
        examples[0] = (examples[0][0], torch.empty((99, cols0) if wrong == "rows" else (rows0, 99), device="meta"))
    mine = [pc.PipelineStage(copy.deepcopy(model[s]), s, sched.num_stages, input_args=examples[s][0],
                             output_args=examples[s][1]) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(mine, sched, m, loss_fn=nn.CrossEntropyLoss(), timeout=60)
    try:
        pipeline_step(pipe, x, y)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    nn.CrossEntropyLoss()(reference_forward(ref, x), y).backward()
    for s in mine:
        for (n, p), q in zip(s.module.named_parameters(), ref[s.stage_index].parameters()):
            assert_matches(p.grad, q.grad, f"rank {rank} stage {s.stage_index} {n}")
    return "ok", ""


class _StageWithUnusedLayer(nn.Module):
    """A stage whose forward never uses one of its layers (an MoE expert no token reached)."""

    def __init__(self, width: int):
        super().__init__()
        self.used = nn.Linear(width, width)
        self.unused = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.used(x))


def unused_parameters_keep_no_gradient(rank, world, name, m, tie=False):
    """A parameter no forward used keeps `.grad` None, as in one process, so AdamW with weight decay
    leaves it alone; the others match one process. Two steps: the second accumulates on the first.
    `tie`: the first and last model stages' unused weights are one tied weight."""
    torch.manual_seed(0)
    sched = pc.build_schedule(name, world, m)
    topo = sched.topology
    n_model = world if topo.style == "dualpipe" else topo.num_stages
    model = nn.Sequential(*[_StageWithUnusedLayer(8) for _ in range(n_model)])
    if tie:
        model[-1].unused.weight = model[0].unused.weight
    ref = copy.deepcopy(model)

    def stage(s):
        module = copy.deepcopy(model[topo.model_stage[s]])
        tied = {"u": module.unused.weight} if tie and topo.model_stage[s] in (0, n_model - 1) else None
        return pc.PipelineStage(module, s, sched.num_stages, tied=tied)

    mine = [stage(s) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(mine, sched, m, loss_fn=nn.functional.mse_loss, timeout=60)
    params = list({id(p): p for s in mine for p in s.module.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x, y = torch.randn(2 * m, 8, generator=g), torch.randn(2 * m, 8, generator=g)
        pipeline_step(pipe, x, y)
        nn.functional.mse_loss(ref(x), y).backward()
        for s in mine:
            for (n, p), (_, q) in zip(s.module.named_parameters(), ref[topo.model_stage[s.stage_index]].named_parameters()):
                assert_matches(p.grad, q.grad, f"rank {rank} stage {s.stage_index} {n} step {step}")
    opt.step()
    ref_opt.step()
    for s in mine:
        for (n, p), (_, q) in zip(s.module.named_parameters(), ref[topo.model_stage[s.stage_index]].named_parameters()):
            assert_matches(p.detach(), q.detach(), f"rank {rank} stage {s.stage_index} {n} after AdamW")


def output_only_loss(rank, world, name, m, V, rows):
    """loss_fn(output) with no target (a model that computes its own loss, say): each microbatch's
    loss is weighted by its share of the batch rows, learnt from the first stages' inputs, so that
    uneven microbatches still give the gradient of the whole batch's mean."""
    sched = pc.build_schedule(name, world, m, V)
    topo = sched.topology
    model = make_stages("mlp", model_stage_count(sched))
    ref = copy.deepcopy(model)
    mine = rank_stages(sched, rank, model)

    def loss_fn(out):
        return out.pow(2).mean()
    pipe = pc.Pipeline(mine, sched, m, loss_fn=loss_fn, timeout=60)
    for step, n in enumerate((rows, rows + 2)):  # the row count changes with the batch's shape
        x, _ = make_batch(n, seed=step + 1)
        pipe.step(*((x,) if pipe.has_first else ()))
        loss_fn(reference_forward(ref, x)).backward()
        for s in mine:
            ref_stage = ref[topo.model_stage[s.stage_index]]
            for (n_, p), (_, q) in zip(s.module.named_parameters(), ref_stage.named_parameters()):
                assert_matches(p.grad, q.grad, f"rank {rank} stage {s.stage_index} {n_} step {step}")
            s.module.zero_grad()
        for r in ref:
            r.zero_grad()


def loss_divisor_over_scale_grads(rank, world, name, scale_grads):
    """A step's loss_divisor decides the weight whatever scale_grads says: .grad = sum loss / N."""
    sched = pc.build_schedule(name, world, 4)
    model = make_stages("mlp", model_stage_count(sched))
    ref = copy.deepcopy(model)
    mine = rank_stages(sched, rank, model)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    pipe = pc.Pipeline(mine, sched, 4, loss_fn=loss_fn, scale_grads=scale_grads)
    x, y = make_batch(10)
    pipeline_step(pipe, x, y, loss_divisor=7.0)
    (loss_fn(reference_forward(ref, x), y) / 7.0).backward()
    for s in mine:
        for p, q in zip(s.module.parameters(), ref[sched.topology.model_stage[s.stage_index]].parameters()):
            assert_matches(p.grad, q.grad, f"rank {rank} stage {s.stage_index}")
    return True


def shared_by_three_ranks(rank, world, part):
    """ALBERT-style sharing: one weight in layers 0, 2 and 3 of a 4-layer model, split by pc.partition
    over 4 ranks (1f1b): three ranks hold a copy, summed by an all-reduce. Returns the worst relative
    gradient difference from one process over two steps, and (`part`: rank 2 leaves its copy out of
    the optimizer) each step's outcome."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    layers = [nn.Linear(8, 8) for _ in range(4)]
    for i in (0, 2, 3):
        layers[i].weight = shared.weight
    model = nn.Sequential(*layers)
    reference = copy.deepcopy(model)
    sched = pc.build_schedule("1f1b", world, 4)
    parts = pc.partition(model, world, verbose=False)
    stage = pc.PipelineStage(copy.deepcopy(parts[rank]), rank, world)
    pipe = pc.Pipeline(stage, sched, 4, loss_fn=nn.functional.mse_loss, timeout=60)
    left_out = {id(p) for p in stage.tied.values()} if part and rank == 2 else set()
    own = [p for p in stage.module.parameters() if id(p) not in left_out]
    opt, ref_opt = torch.optim.SGD(own, lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    worst, outcomes = 0.0, []
    for step in range(3 if part else 2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        try:
            pipeline_step(pipe, x, y)
            outcomes.append("ok")
        except (pc.errors.InputError, pc.PeerFailedError) as exc:
            outcomes.append(str(exc))
        nn.functional.mse_loss(reference(x), y).backward()
        if not part:
            name_of = {id(p): n for n, p in parts[rank].named_parameters()}
            for n, p in stage.module.named_parameters():
                want = reference.get_parameter(name_of[id(parts[rank].get_parameter(n))].replace("_", "."))
                worst = max(worst, difference(p.grad, want.grad))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return worst, outcomes, sorted(stage.tied)


def freed_with_its_last_reference(rank, world, name, tie):
    """With the cycle collector off, a Pipeline that stepped (ties learnt, with `tie`) is freed when
    its last reference goes: nothing of it refers back to it, so its executor's threads and its hold
    on the process group end then, not at a collection that may come only at exit."""
    import gc
    import weakref

    gc.disable()
    try:
        sched = pc.build_schedule(name, world, 2 * world)
        n = model_stage_count(sched)
        model = make_stages("mlp", n)
        first, last = model[0].fc, model[-1][0].fc
        if tie:  # the first and last model stages share a weight
            last.weight = first.weight
        topo = sched.topology
        stages = [pc.PipelineStage(model[topo.model_stage[s]], s, sched.num_stages,
                                   tied={"w": first.weight} if tie and topo.model_stage[s] in (0, n - 1) else None)
                  for s in sched.rank_stages(rank)]
        pipe = pc.Pipeline(stages, sched, 2 * world, loss_fn=nn.CrossEntropyLoss(), timeout=60)
        x, y = make_batch(8)
        pipeline_step(pipe, x, y)
        assert (pipe.gradients.ties is not None) == tie
        alive = weakref.ref(pipe)
        del pipe
        return alive() is None
    finally:
        gc.enable()


def step_under_graph_capture(rank, world):
    """1F1B on 2 ranks; rank 1 calls its first step as if a CUDA graph were being captured (its stage
    taken for a CUDA one, torch.cuda.is_current_stream_capturing() True). Returns each rank's error of
    that step (type, text) and the gradient difference of the next step, run normally, from one process."""
    sched = pc.build_schedule("1f1b", world, 4)
    model = make_stages("mlp", sched.num_stages)
    ref = copy.deepcopy(model)
    stage = pc.PipelineStage(copy.deepcopy(model[rank]), rank, sched.num_stages)
    pipe = pc.Pipeline([stage], sched, 4, loss_fn=nn.CrossEntropyLoss(), timeout=60)
    x, y = make_batch(8, seed=3)
    capturing, device = torch.cuda.is_current_stream_capturing, stage.device
    if rank == 1:
        torch.cuda.is_current_stream_capturing, stage.device = (lambda: True), torch.device("cuda")
    try:
        pipeline_step(pipe, x, y)
        error = None
    except pc.InputError as exc:
        error = (type(exc).__name__, str(exc))
    finally:
        torch.cuda.is_current_stream_capturing, stage.device = capturing, device
    pipeline_step(pipe, x, y)
    nn.CrossEntropyLoss()(reference_forward(ref, x), y).backward()
    worst = max(difference(p.grad, q.grad) for p, q in zip(stage.module.parameters(), ref[rank].parameters()))
    return error, worst
