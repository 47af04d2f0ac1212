"""Cases run on every rank of a gloo pool: OVERLAP_F_B pairs run concurrently, in lock-step, in
sequence and through hooks, against each other and against single-process training."""

from __future__ import annotations

import copy
import threading
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

import pipecore as pc
from models import make_batch, make_stages, reference_forward, pipeline_step
from exactness import assert_matches
from pipeline_cases import set_messages

MODES = ("sequential", "concurrent", "lockstep")


def _model(kind, name, world):
    """dualpipe's two directions run the same model; dualpipev's V holds a model of 2 x world stages."""
    return make_stages(kind, world if name == "dualpipe" else 2 * world)


def _build(rank, world, name, m, model, overlap_f_b, **kw):
    sched = pc.build_schedule(name, world, m, 2)
    topo = sched.topology
    stages = [pc.PipelineStage(copy.deepcopy(model[topo.model_stage[s]]), s, sched.num_stages)
              for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, m, loss_fn=nn.CrossEntropyLoss(), timeout=60, overlap_f_b=overlap_f_b, **kw)
    return pipe, topo


def _pairs_of(pipe) -> list[str]:
    """This rank's OVERLAP_F_B containers, in program order."""
    return [str(a) for a in pipe.schedule.lower().actions[pipe.rank] if a.kind is pc.Kind.OVERLAP_F_B]


def _values(losses):
    return [None if v is None else float(v) for v in losses]


def modes_match(rank, world, name, m, kind, steps=3, messages="default"):
    """Every mode gives the same losses and gradients, to the last bit, as each other; and those of
    single-process training (within exactness.FLOAT64_BOUND) at every step. `messages`: see set_messages."""
    model = _model(kind, name, world)
    ref = copy.deepcopy(model)
    pipes = {mode: _build(rank, world, name, m, model, mode) for mode in MODES}
    for pipe, _ in pipes.values():
        set_messages(pipe, messages)
    topo = pipes["sequential"][1]
    for step in range(steps):
        # on the device path the last batch changes shape: its first pass runs on stand-ins, with
        # "shapes changed" statuses folded from both halves' threads
        rows = 2 * m + 1 if messages == "device" and step == steps - 1 else 3 * m + 1
        x, y = make_batch(rows, seed=step + 1)
        losses = {mode: [] for mode in MODES}
        for mode, (pipe, _) in pipes.items():
            pipeline_step(pipe, x, y, losses=losses[mode])
        nn.CrossEntropyLoss()(reference_forward(ref, x), y).backward()
        seq = pipes["sequential"][0]
        for mode in ("concurrent", "lockstep"):
            pipe = pipes[mode][0]
            for s, t in zip(pipe.stages, seq.stages):
                for (n, p), (_, q) in zip(s.module.named_parameters(), t.module.named_parameters()):
                    assert torch.equal(p.grad, q.grad), f"{mode} {n} of stage {s.stage_index} differs at step {step}"
            assert _values(losses[mode]) == _values(losses["sequential"]), mode
        for s in seq.stages:
            ref_stage = ref[topo.model_stage[s.stage_index]]
            for (n, p), (_, q) in zip(s.module.named_parameters(), ref_stage.named_parameters()):
                assert_matches(p.grad, q.grad, f"rank {rank} stage {s.stage_index} {n} step {step}")
    pairs = len(_pairs_of(pipes["sequential"][0]))
    # the first step of a batch shape learns its shapes: its pairs run in program order; lock-step
    # pairs that never hand over run on one thread
    want = {"sequential": 0, "concurrent": pairs * (steps - 1), "lockstep": 0}
    for mode, (pipe, _) in pipes.items():
        if messages == "device" and mode == "concurrent":  # the stand-in pass overlaps until it fails, if it does
            assert pairs * (steps - 2) <= pipe.overlapped_pairs <= want[mode], (mode, pipe.overlapped_pairs, pairs)
        else:
            assert pipe.overlapped_pairs == want[mode], (mode, pipe.overlapped_pairs, pairs)
        assert pipe.overlap_fallbacks == {}, pipe.overlap_fallbacks
    return pairs


class _Active:
    """How many halves compute at once (outside handoff blocks), and the most seen."""

    def __init__(self):
        self.lock = threading.Lock()
        self.now = self.most = 0

    def compute(self, seconds):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(seconds)  # releases the GIL like a kernel
        with self.lock:
            self.now -= 1


class _Probe(torch.autograd.Function):
    """Forward of (stage, mb): computes, then (when armed) waits for its pair's backward to start,
    which proves the two halves run at once; backward: says it started, computes."""

    @staticmethod
    def forward(ctx, x, w, probe, mb):
        ctx.probe, ctx.mb = probe, mb
        probe.shared.active.compute(0.002)
        partner = probe.shared.partner_of.get((probe.stage, mb)) if probe.shared.armed["on"] else None
        if partner is not None:
            with pc.overlap_handoff():  # lockstep: the backward half runs meanwhile
                started = probe.shared.started.setdefault(partner, threading.Event()).wait(20)
            assert started, f"the backward {partner} paired with forward {(probe.stage, mb)} did not run beside it"
            probe.shared.log.append(("F", probe.stage, mb, threading.get_ident()))
        probe.shared.active.compute(0.002)
        return x * w

    @staticmethod
    def backward(ctx, g):
        probe = ctx.probe
        probe.shared.started.setdefault((probe.stage, ctx.mb), threading.Event()).set()
        probe.shared.log.append(("B", probe.stage, ctx.mb, threading.get_ident()))
        probe.shared.active.compute(0.002)
        return g * 1.0, (g * 0).sum().reshape(1), None, None


class _ProbeStage(nn.Module):
    def __init__(self, width, stage, shared, head=False):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.w = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(width, 5) if head else None
        self.stage = stage
        self.shared = shared
        self.calls = 0

    def forward(self, x):
        mb = self.shared.forward_order[self.stage][self.calls % len(self.shared.forward_order[self.stage])]
        self.calls += 1
        h = _Probe.apply(torch.tanh(self.fc(x)), self.w, self, mb)
        return self.head(h) if self.head is not None else h


class _Shared:
    def __init__(self, m):
        self.m = m
        self.active = _Active()
        self.partner_of: dict = {}
        self.armed = {"on": False}
        self.started: dict = {}
        self.log: list = []
        self.forward_order: dict = {}  # stage -> its microbatches in the order its forwards run


def halves_run_at_once(rank, world, name, m, mode):
    """From the second step on, each pair's forward waits (in a handoff block) until its backward
    has started: that finishes only if the halves run at once. In lock-step, no two halves compute
    at the same time; the backward half runs on another thread."""
    sched = pc.build_schedule(name, world, m, 2)
    shared = _Shared(m)
    topo = sched.topology
    stages = [pc.PipelineStage(_ProbeStage(8, s, shared, head=topo.next_stage[s] < 0), s, sched.num_stages)
              for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, m, loss_fn=nn.CrossEntropyLoss(), timeout=60, overlap_f_b=mode)
    for a in pipe.schedule.lower().actions[rank]:
        for f in (a.sub_actions if a.kind is pc.Kind.OVERLAP_F_B else (a,)):
            if f.kind is pc.Kind.F:
                shared.forward_order.setdefault(f.stage, []).append(f.microbatch)
        if a.kind is pc.Kind.OVERLAP_F_B:
            f = [s for s in a.sub_actions if s.kind is pc.Kind.F]
            b = [s for s in a.sub_actions if s.kind is not pc.Kind.F]
            shared.partner_of[(f[0].stage, f[0].microbatch)] = (b[0].stage, b[0].microbatch)
    x, y = make_batch(4 * m, width=8)
    pipeline_step(pipe, x, y)  # shapes
    shared.armed["on"] = True
    shared.log.clear()
    for _ in range(2):
        shared.started.clear()
        for s in pipe.stages:
            s.module.calls = 0
        pipeline_step(pipe, x, y)
    main = threading.get_ident()
    forwards = {t for k, *_, t in shared.log if k == "F"}
    paired = set(shared.partner_of.values())
    backwards = {t for k, stage, mb, t in shared.log if k == "B" and (stage, mb) in paired}
    return {"pairs": len(shared.partner_of), "waited": sum(1 for e in shared.log if e[0] == "F"),
            "most_at_once": shared.active.most, "forward_on_main": forwards <= {main},
            "backward_elsewhere": bool(backwards) and main not in backwards,
            "overlapped": pipe.overlapped_pairs}


def failing_half(rank, world, name, where):
    """At the second step, the forward (or backward) half of one of rank 0's overlapped pairs
    raises: the step fails on every rank with that error, and the next step matches one process."""
    model = _model("mlp", name, world)
    m = 2 * world
    pipe, topo = _build(rank, world, name, m, model, "concurrent")
    x, y = make_batch(3 * m + 1)
    pipeline_step(pipe, x, y)
    fail = {"on": False}
    if rank == 0:
        pair = pc.Action.parse(_pairs_of(pipe)[0])
        target = next(a for a in pair.sub_actions if (a.kind is pc.Kind.F) == (where == "forward"))
        module = pipe.stage_by_index[target.stage].module
        # the target's place among its stage's forwards (or backwards) of a step
        kinds = (pc.Kind.F,) if where == "forward" else (pc.Kind.B, pc.Kind.I)
        order = [a.microbatch for c in pipe.schedule.lower().actions[rank]
                 for a in (c.sub_actions if c.kind is pc.Kind.OVERLAP_F_B else (c,))
                 if a.kind in kinds and a.stage == target.stage]
        place = order.index(target.microbatch)
        if where == "forward":
            calls = {"n": 0}

            def pre(mod, args):
                if fail["on"]:
                    calls["n"] += 1
                    if calls["n"] - 1 == place:
                        raise RuntimeError(f"boom in the forward half of {pair}")
            module.register_forward_pre_hook(pre)
        else:
            calls = {"n": 0}

            def bhook(mod, grad_in, grad_out):
                if fail["on"]:
                    calls["n"] += 1
                    if calls["n"] - 1 == place:
                        raise RuntimeError(f"boom in the backward half of {pair}")
            module.register_full_backward_hook(bhook)
    fail["on"] = True
    for s in pipe.stages:
        s.module.zero_grad(set_to_none=True)
    before = pipe.overlapped_pairs
    try:
        pipeline_step(pipe, x, y)
        first = ("ok", "")
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        first = (type(exc).__name__, str(exc))
    ran_overlapped = pipe.overlapped_pairs > before
    fail["on"] = False
    _step_matches_one_process(pipe, topo, model, x, y, steps=1)
    return first, ran_overlapped


def _step_matches_one_process(pipe, topo, model, x, y, steps):
    """`steps` steps from zero gradients; then every gradient matches one process's (within exactness.FLOAT64_BOUND)."""
    for _ in range(steps):
        for s in pipe.stages:
            s.module.zero_grad(set_to_none=True)
        pipeline_step(pipe, x, y)
    ref = copy.deepcopy(model)
    nn.CrossEntropyLoss()(reference_forward(ref, x), y).backward()
    for s in pipe.stages:
        for p, q in zip(s.module.parameters(), ref[topo.model_stage[s.stage_index]].parameters()):
            assert_matches(p.grad, q.grad, f"stage {s.stage_index}")


def hooks_get_their_pairs(rank, world, name, how):
    """A Pipeline hook is called once per pair, in program order, with the pair's microbatches;
    running the backward half first changes nothing. A stage module's own `overlapped_forward_backward`
    (DualPipe's name) is never called."""
    model = _model("transformer", name, world)
    seen: list = []

    def hook(pair):
        seen.append((str(pair.action), [str(a) for a in pair.forward], [str(a) for a in pair.backward],
                     sorted(pair.modules)))
        if how == "backward_first":
            pair.run_backward()
            pair.run_forward()
        elif how == "threads":  # each half on a thread of the hook's own
            done = []
            t = threading.Thread(target=lambda: (pair.run_backward(), done.append(1)))
            t.start()
            pair.run_forward()
            t.join()
            assert done
        else:
            pair.run("lockstep")

    if how == "module":  # DualPipe's method name, with its own signature: overlap_f_b decides, not the module
        model = [_DualPipeModule(m_) for m_ in model]
        pipe, topo = _build(rank, world, name, 4, model, "concurrent")
        x, y = make_batch(13)
        _step_matches_one_process(pipe, topo, model, x, y, steps=2)
        assert seen == [] and pipe.overlapped_pairs > 0, (seen, pipe.overlapped_pairs)
        return pipe.overlapped_pairs
    pipe, topo = _build(rank, world, name, 4, model, hook)
    x, y = make_batch(13)
    _step_matches_one_process(pipe, topo, model, x, y, steps=2)
    want = []
    for text in _pairs_of(pipe):
        a = pc.Action.parse(text)
        want.append((text, [str(s) for s in a.sub_actions if s.kind is pc.Kind.F],
                     [str(s) for s in a.sub_actions if s.kind is not pc.Kind.F],
                     sorted({s.stage for s in a.sub_actions})))
    # the first step (learning shapes) runs its pairs in program order without hooks
    assert seen == want, (seen, want)
    return len(seen)


class _DualPipeModule(nn.Module):
    """A module written for DualPipe, with its overlap method."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                    output_grads1):  # DualPipe's signature
        raise AssertionError("pipecore called a module's overlapped_forward_backward")


def bad_hooks(rank, world, name, how):
    """A hook that skips a half, or runs one twice: the step fails on every rank, saying so."""
    model = _model("mlp", name, world)

    late: list = []

    def hook(pair):
        if how == "skip":
            pair.run_forward()
        elif how == "late":  # the backward half starts on a thread after the hook returned
            def backward():
                time.sleep(0.2)
                try:
                    pair.run_backward()
                except RuntimeError as exc:
                    late.append(str(exc))
            late.append(threading.Thread(target=backward))
            late[0].start()
            pair.run_forward()
        elif how == "twice":
            pair.run_forward()
            pair.run_forward()
        else:
            raise ValueError("the hook's own error")

    pipe, _ = _build(rank, world, name, 4, model, hook)
    x, y = make_batch(13)
    pipeline_step(pipe, x, y)
    try:
        pipeline_step(pipe, x, y)
        outcome = ("ok", "")
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        outcome = (type(exc).__name__, str(exc))
    if late:
        late[0].join()
        assert len(late) == 2 and "before the hook returns" in late[1], late  # refused, not run
    return outcome


class _Checkpointed(nn.Module):
    """Dropout, then the inner module under a checkpoint: every forward call, or (`every=2`) every
    other one, so that some microbatches' backwards recompute and others do not."""

    def __init__(self, inner, every=1):
        super().__init__()
        self.inner = inner
        self.drop = nn.Dropout(0.3)
        self.every = every
        self.calls = 0

    def forward(self, x, *rest):
        x = self.drop(x)
        with pc.overlap_handoff():  # lock-step: the backward half starts here, unless it recomputes
            pass
        self.calls += 1
        if self.calls % self.every:
            return self.inner(x, *rest)
        return torch.utils.checkpoint.checkpoint(self.inner, x, *rest, use_reentrant=False)


def checkpoints_run_in_sequence(rank, world, name):
    """Dropout in every forward and checkpointed stages (recomputed in backward with the saved RNG
    state): concurrent pairs fall back to sequence, warn once, and equal a sequential run bit for bit."""
    base = _model("mlp", name, world)
    model = [_Checkpointed(m_) for m_ in base]
    out = {}
    for mode in ("sequential", "concurrent"):
        torch.manual_seed(1234 + rank)
        pipe, _ = _build(rank, world, name, 4, model, mode)
        x, y = make_batch(13)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                pipeline_step(pipe, x, y)
        grads = [p.grad.clone() for s in pipe.stages for p in s.module.parameters()]
        out[mode] = (grads, pipe.overlap_fallbacks, pipe.overlapped_pairs,
                     [str(w.message) for w in caught if "OVERLAP_F_B" in str(w.message)])
    for g, h in zip(out["sequential"][0], out["concurrent"][0]):
        assert torch.equal(g, h)
    _, fallbacks, overlapped, warned = out["concurrent"]
    pairs = len(_pairs_of(pipe))
    assert overlapped == 0 and fallbacks == ({"checkpoint": 2 * pairs} if pairs else {}), (fallbacks, pairs)
    assert len(warned) == (1 if pairs else 0) and "checkpoint" in (warned[0] if warned else "checkpoint"), warned
    return pairs


def some_checkpoints_and_dropout(rank, world, name):
    """Dropout everywhere and checkpoints on every other forward of a stage: every backward action
    is looked at, so concurrent pairs whose backward recomputes run in sequence and the others
    overlap; gradients equal a sequential run bit for bit, with and without checkpoints."""
    out = {}
    modes = ("sequential", "concurrent", "lockstep")
    for every in (2, 10 ** 6):  # some microbatches checkpointed; none (dropout only)
        for mode in modes:
            model = [_Checkpointed(m_, every) for m_ in _model("mlp", name, world)]
            torch.manual_seed(99 + rank)
            pipe, _ = _build(rank, world, name, 8, model, mode)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for step in range(3):
                    x, y = make_batch(25, seed=step)
                    pipeline_step(pipe, x, y)
            out[every, mode] = ([p.grad.clone() for s in pipe.stages for p in s.module.parameters()],
                                pipe.overlapped_pairs, pipe.overlap_fallbacks)
        for mode in modes[1:]:
            for g, h in zip(out[every, "sequential"][0], out[every, mode][0]):
                assert torch.equal(g, h), f"{mode}, every={every}"
    pairs = 2 * len(_pairs_of(pipe))  # two steps after the one that learns shapes
    for mode in modes[1:]:  # lock-step looks when the forward hands over: here, every pair
        overlapped, fallbacks = out[2, mode][1:]
        assert overlapped + fallbacks.get("checkpoint", 0) == pairs and fallbacks.get("checkpoint", 0) > 0, \
            (mode, overlapped, fallbacks, pairs)
        assert out[10 ** 6, mode][1:] == (pairs, {}), (mode, out[10 ** 6, mode][1:])
    return out[2, "concurrent"][1]


class _TensorParallel(torch.autograd.Function):
    """An all-reduce over a "tensor-parallel" group in forward and in backward, as a TP layer does;
    a sleep before either (the ranks do not run in step: on one rank forwards are slow, on the
    other backwards, so two halves running at once would all-reduce in opposite orders)."""

    @staticmethod
    def forward(ctx, x, group, delays):
        ctx.group, ctx.delays = group, delays
        time.sleep(delays[0])
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.delays[1])
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None, None


class _TPStage(nn.Module):
    def __init__(self, inner, group, delays):
        super().__init__()
        self.inner, self.group, self.delays = inner, group, delays

    def forward(self, x, *rest):
        return self.inner(_TensorParallel.apply(x, self.group, self.delays), *rest)


def collectives_in_both_halves(rank, world, mode):
    """Every rank runs its own one-rank dualpipev pipeline; its stages all-reduce over all ranks in
    forward and backward (tensor parallel). Lock-step pairs (the default) keep the collectives in
    one order on every rank: gradients equal the sequential run bit for bit."""
    own = [dist.new_group([r]) for r in range(world)][rank]
    tp = dist.new_group(list(range(world)))
    grads = {}
    for how in ("sequential", mode):
        base = _model("mlp", "dualpipev", 1)
        model = [_TPStage(m_, tp, (0.02, 0.0) if rank == 0 else (0.0, 0.02)) for m_ in base]
        sched = pc.build_schedule("dualpipev", 1, 4)
        stages = [pc.PipelineStage(model[s], s, sched.num_stages) for s in sched.rank_stages(0)]  # fresh, seeded
        pipe = pc.Pipeline(stages, sched, 4, loss_fn=nn.CrossEntropyLoss(), group=own, timeout=60, overlap_f_b=how)
        for step in range(3):
            x, y = make_batch(13, seed=step)
            pipeline_step(pipe, x, y)
        grads[how] = [p.grad.clone() for s in pipe.stages for p in s.module.parameters()]
    for g, h in zip(grads["sequential"], grads[mode]):
        assert torch.equal(g, h)
    return True


def hooked_pipelines_are_freed(rank, world):
    """A Pipeline with an overlap hook is freed once dropped."""
    import gc
    import weakref

    model = _model("mlp", "dualpipev", world)
    pipe, _ = _build(rank, world, "dualpipev", 4, model, lambda pair: pair.run())
    x, y = make_batch(13)
    for _ in range(2):
        pipeline_step(pipe, x, y)
    ref = weakref.ref(pipe)
    del pipe
    gc.collect()
    return ref() is None


def traced_lanes(rank, world, name):
    """With trace=True, the backward halves that ran beside their forward are on lane 1; the Chrome
    trace puts them on a row of their own."""
    pipe, _ = _build(rank, world, name, 4, _model("mlp", name, world), "concurrent", trace=True)
    x, y = make_batch(13)
    for _ in range(2):
        pipeline_step(pipe, x, y)
    events = pipe.trace()
    backs = {f"PP:{s}" for t in _pairs_of(pipe) for s in pc.Action.parse(t).sub_actions if s.kind is not pc.Kind.F}
    lane1 = [e["name"] for e in events if e["lane"] == 1]
    assert sorted(lane1) == sorted(backs), (lane1, backs)
    from pipecore.tools.profiling import to_chrome_trace

    rows = {e["tid"] for e in to_chrome_trace(events)["traceEvents"] if e["ph"] == "X" and e["name"] in backs}
    assert rows == ({2} if backs else set()), rows
    # sub-actions still nest inside their container's span
    for e in events:
        if e["name"].endswith("OVERLAP_F_B"):
            subs = [f"PP:{s}" for s in pc.Action.parse(e["name"][3:]).sub_actions]
            for sub in (s for s in events if s["name"] in subs):
                assert e["start_us"] <= sub["start_us"] <= sub["end_us"] <= e["end_us"] + 1, (e, sub)
    return len(lane1)


__all__ = ["modes_match", "halves_run_at_once", "failing_half", "hooks_get_their_pairs", "bad_hooks",
           "checkpoints_run_in_sequence", "some_checkpoints_and_dropout", "collectives_in_both_halves",
           "hooked_pipelines_are_freed", "traced_lanes"]
