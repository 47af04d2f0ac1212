"""Data parallel x pipeline parallel (issue 16) with plain stages, run on every rank of a gloo pool
next to single-process training of the whole model on the whole global batch.

Layout (pc.init_mesh): rank = dp_index * pp + pp_index; each dp replica is a pipeline of `pp`
consecutive ranks and takes its own slice of the global batch (replica d: rows [d*B/dp, (d+1)*B/dp)).
Each case asserts on its rank what only it can see (the mesh's layout, a missing gradient) and
returns the worst relative differences it saw (largest |got - want| over the largest |want|, per
tensor), which the tests bound.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import pipecore as pc
from exactness import difference
from models import NEVER, make_batch, make_stages, reference_forward
from pipeline_cases import set_messages
from reliability_cases import _outcome

_MESHES: dict[tuple[int, int], object] = {}


def data_parallel_mesh(dp: int, pp: int):
    """pc.init_mesh(dp, pp), once per process (making groups is a collective and takes time)."""
    if (dp, pp) not in _MESHES:
        _MESHES[(dp, pp)] = pc.init_mesh(dp=dp, pp=pp)
    return _MESHES[(dp, pp)]


def stages_per_rank(name: str) -> int:
    return 1 if name in ("gpipe", "1f1b") else 2


def microbatch_counts(name: str, pp: int, want: int = 2) -> list[int]:
    """The first `want` of 2, 4, 6 microbatches per replica that `name` accepts on `pp` ranks."""
    counts = []
    for m in (2, 4, 6):
        try:
            pc.build_schedule(name, pp, m, stages_per_rank(name))
        except ValueError:
            continue
        counts.append(m)
    return counts[:want]


def check_mesh_layout(mesh, rank: int, dp: int, pp: int) -> None:
    replica, position = divmod(rank, pp)
    assert tuple(mesh.mesh_dim_names) == ("dp", "pp"), mesh.mesh_dim_names
    assert mesh.mesh.tolist() == torch.arange(dp * pp).reshape(dp, pp).tolist(), mesh.mesh
    pp_ranks = dist.get_process_group_ranks(mesh.get_group("pp"))
    dp_ranks = dist.get_process_group_ranks(mesh.get_group("dp"))
    assert pp_ranks == [replica * pp + p for p in range(pp)], (rank, pp_ranks)
    assert dp_ranks == [d * pp + position for d in range(dp)], (rank, dp_ranks)


class Replica:
    """This rank's part of a dp x pp run: its Pipeline, the whole model in one process, and the
    replica's slice of each global batch."""

    def __init__(self, rank, world, name, m, dp, tokens=False, mesh=None, width=16, bucket_bytes=None,
                 odd_params=False, trace=False):
        self.rank, self.dp, self.pp, self.m, self.tokens, self.width = rank, dp, world // dp, m, tokens, width
        self.replica, self.position = divmod(rank, self.pp)
        self.mesh = mesh if mesh is not None else data_parallel_mesh(dp, self.pp)
        check_mesh_layout(self.mesh, rank, dp, self.pp)
        sched = pc.build_schedule(name, self.pp, m, stages_per_rank(name))
        self.topo = sched.topology
        model = make_stages("transformer", self.topo.num_stages, width=width)
        if odd_params:  # every stage: a parameter its forward never uses; stage 0: a frozen one
            for module in model:  # a parameter, not a module: a Sequential would call a module
                module.register_parameter("unused", nn.Parameter(torch.randn(3, 3)))
            next(model[0].parameters()).requires_grad_(False)
        self.ref = copy.deepcopy(model)
        self.stages = [pc.PipelineStage(copy.deepcopy(model[self.topo.model_stage[s]]), s, sched.num_stages)
                       for s in sched.rank_stages(self.position)]
        # sum: token-style loss, padding (-100) ignored, divided by the global count (loss_divisor)
        self.loss_fn = nn.CrossEntropyLoss(reduction="sum" if tokens else "mean", ignore_index=-100)
        self.pipe = pc.Pipeline(self.stages, sched, m, self.loss_fn, group=self.mesh.get_group("pp"),
                                dp_group=self.mesh.get_group("dp"), timeout=NEVER, trace=trace,
                                **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}))
        assert self.pipe.rank == self.position and self.pipe.world == self.pp, (self.pipe.rank, self.pipe.world)
        self.params = [p for s in self.stages for p in s.module.parameters()]
        self.ref_params = [p for s in self.ref for p in s.parameters()]
        self.worst = {"grad": 0.0, "loss": 0.0, "output": 0.0, "param": 0.0, "norm": 0.0, "where": ""}
        self.norms: list[float] = []

    # -- batches ------------------------------------------------------------------------
    def global_batch(self, step: int, rows_per_replica: int):
        """The global batch of `step`; with tokens, targets ignored (-100) at random, a different
        number on each replica."""
        x, y = make_batch(self.dp * rows_per_replica, width=self.width, seed=step + 1)
        if self.tokens:
            g = torch.Generator().manual_seed(100 + step)
            y = torch.where(torch.rand(y.shape, generator=g) < 0.3, torch.full_like(y, -100), y)
            y[:rows_per_replica // 2] = -100  # replica 0 has fewer tokens than the others
            counts = [(c != -100).sum().item() for c in y.chunk(self.dp)]
            assert len(set(counts)) == self.dp and min(counts) > 0, counts
        return x, y

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t.chunk(self.dp)[self.replica]

    # -- one step of both ---------------------------------------------------------------
    def reference_step(self, x, y):
        """Whole model, whole global batch: mean loss, or sum / token count. Returns this replica's
        per-microbatch losses and outputs (before any update)."""
        with torch.no_grad():
            outs = [reference_forward(self.ref, xc) for xc in torch.tensor_split(self.local(x), self.m)]
            losses = [self.loss_fn(o, t) for o, t in zip(outs, torch.tensor_split(self.local(y), self.m))]
        loss = self.loss_fn(reference_forward(self.ref, x), y)
        (loss / (y != -100).sum() if self.tokens else loss).backward()
        return losses, outs

    def pipeline_step(self, x, y, losses: list):
        pipe = self.pipe
        extra = {}
        if self.tokens and pipe.has_last:
            n = (self.local(y) != -100).sum()  # this replica's count; the user sums it over dp
            dist.all_reduce(n, group=self.mesh.get_group("dp"))
            assert n.item() == (y != -100).sum().item()
            extra["loss_divisor"] = n
        return pipe.step(*((self.local(x),) if pipe.has_first else ()),
                         target=self.local(y) if pipe.has_last else None, losses=losses, **extra)

    # -- comparisons --------------------------------------------------------------------
    def _note(self, key: str, err: float, where: str):
        if err > self.worst[key]:
            self.worst[key] = err
            if key == "grad":
                self.worst["where"] = where

    def compare_grads(self, what: str):
        for s in self.stages:
            ref_stage = self.ref[self.topo.model_stage[s.stage_index]]
            for (n, p), q in zip(s.module.named_parameters(), ref_stage.parameters()):
                where = f"rank {self.rank} stage {s.stage_index} {n} {what}"
                if q.grad is None:  # unused or frozen: None here too (zeros would move it under AdamW)
                    assert p.grad is None, f"{where}: a gradient where one process has none"
                    continue
                assert p.grad is not None, f"{where}: gradient missing"
                self._note("grad", difference(p.grad, q.grad), where)

    def compare_params(self):
        for s in self.stages:
            ref_stage = self.ref[self.topo.model_stage[s.stage_index]]
            for p, q in zip(s.module.parameters(), ref_stage.parameters()):
                self._note("param", difference(p, q), "")

    def compare_losses(self, losses, out, ref_losses, ref_outs):
        if not self.pipe.has_last:
            assert losses == [] and out is None, (self.rank, losses, out)
            return
        assert len(losses) == self.m and all(v is not None for v in losses), (self.rank, losses)
        for got, want in zip(losses, ref_losses):
            self._note("loss", difference(got.detach(), want.detach()), "")
        self._note("output", difference(out, torch.cat(ref_outs)), "")

    def zero_grad(self):
        for p in self.params + self.ref_params:
            p.grad = None


def train(rank, world, name, m, dp, options=None):
    return _train(rank, world, name, m, dp, **(options or {}))


def _train(rank, world, name, m, dp, steps=2, tokens=False, accumulate=False, max_norm=None, optimizer=True,
           rows_per_microbatch=3, width=16, bucket_bytes=None, odd_params=False):
    """`steps` steps of the dp x pp pipeline and of one process, compared after each: every
    gradient of this rank's stages (after clipping with `max_norm`), its losses and outputs, and
    (with `optimizer`: SGD with momentum) every parameter after the update. `accumulate`: no
    zero_grad between steps. `bucket_bytes`: the Pipeline's (small: a bucket per parameter or two).
    `odd_params`: each stage also holds an unused parameter, stage 0 a frozen one.
    The replica's last microbatch is one row shorter than the others."""
    r = Replica(rank, world, name, m, dp, tokens=tokens, width=width, bucket_bytes=bucket_bytes,
                odd_params=odd_params)
    opt = torch.optim.SGD(r.params, lr=0.1, momentum=0.9) if optimizer else None
    ref_opt = torch.optim.SGD(r.ref_params, lr=0.1, momentum=0.9) if optimizer else None
    for step in range(steps):
        x, y = r.global_batch(step, rows_per_microbatch * m - 1)
        ref_losses, ref_outs = r.reference_step(x, y)
        losses: list = []
        out = r.pipeline_step(x, y, losses)
        if max_norm is not None:
            norm = pc.clip_grad_norm_(r.pipe, max_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_(r.ref_params, max_norm)
            assert ref_norm > max_norm, f"the test's gradients ({ref_norm}) should be clipped at {max_norm}"
            r._note("norm", difference(norm, ref_norm), "")
            r.norms.append(float(norm))
        r.compare_grads(f"step {step}")
        r.compare_losses(losses, out, ref_losses, ref_outs)
        if optimizer:
            opt.step()
            ref_opt.step()
            r.compare_params()
        if not accumulate:
            r.zero_grad()
    return dict(r.worst, norms=r.norms, has_last=r.pipe.has_last)


def failing_replica(rank, world, name, m, bad_rank, fail_step, messages="default"):
    """The forward of `bad_rank`'s first stage raises at step `fail_step` (earlier steps succeed and
    match one process): returns (that step's outcome on this rank, worst differences of the steps
    before and of two clean steps after it, with zeroed gradients, and whether the failed step left
    .grad as it was before it). `messages`: see set_messages."""
    r = Replica(rank, world, name, m, 2)
    set_messages(r.pipe, messages)
    state = {"step": 0}

    def boom(module, args):
        if state["step"] == fail_step:
            raise RuntimeError(f"boom in forward on rank {rank}")

    if rank == bad_rank:
        r.stages[0].module.register_forward_pre_hook(boom)
    rows = 3 * m
    for step in range(fail_step):
        state["step"] = step
        x, y = r.global_batch(step, rows)
        ref_losses, ref_outs = r.reference_step(x, y)
        losses: list = []
        out = r.pipeline_step(x, y, losses)
        r.compare_grads(f"step {step}, before the failure")
        r.compare_losses(losses, out, ref_losses, ref_outs)
        r.zero_grad()
    state["step"] = fail_step
    x, y = r.global_batch(fail_step, rows)
    held = [torch.full_like(p, 0.25 * (i + 1)) for i, p in enumerate(r.params)]  # .grad before the step
    for p, g in zip(r.params, held):
        p.grad = g.clone()
    failed = _outcome(lambda: r.pipeline_step(x, y, []))
    kept = all(p.grad is not None and torch.equal(p.grad, g) for p, g in zip(r.params, held))
    r.zero_grad()
    for step in range(fail_step + 1, fail_step + 3):  # two clean steps after it
        state["step"] = step
        x, y = r.global_batch(step, rows)
        ref_losses, ref_outs = r.reference_step(x, y)
        losses = []
        out = r.pipeline_step(x, y, losses)
        r.compare_grads(f"step {step}, after the failure")
        r.compare_losses(losses, out, ref_losses, ref_outs)
        r.zero_grad()
    return failed, dict(r.worst, grads_kept=kept)


def bad_meshes(rank, world):
    """Misbuilt meshes and dp groups: what each attempt raised on this rank (kind, message, seconds)."""
    seen = {}
    # dp * pp != world: refused before any communication (rank 0 tries twice: a collective would hang)
    seen["dp*pp != world"] = _outcome(lambda: pc.init_mesh(dp=3, pp=2))
    if rank == 0:
        seen["dp*pp != world, again"] = _outcome(lambda: pc.init_mesh(dp=1, pp=2))
    check = torch.ones(1)
    dist.all_reduce(check)
    assert check.item() == world, check
    pp = world // 2
    mesh = data_parallel_mesh(2, pp)
    position = rank % pp
    sched = pc.build_schedule("1f1b", pp, 2, 1)

    def pipeline(group, dp_group, n_ranks=pp):
        s = sched if n_ranks == pp else pc.build_schedule("1f1b", n_ranks, 2, 1)
        place = dist.get_rank(group) if group is not None else rank
        model = make_stages("mlp", s.num_stages)
        stages = [pc.PipelineStage(model[i], i, s.num_stages) for i in s.rank_stages(place)]
        return pc.Pipeline(stages, s, 2, nn.CrossEntropyLoss(), group=group, dp_group=dp_group, timeout=NEVER)

    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    # the dp group's ranks must hold the same pipeline position
    seen["dp_group = the pp group"] = _outcome(lambda: pipeline(pp_group, pp_group))
    seen["group = WORLD with the mesh's dp_group"] = _outcome(lambda: pipeline(None, dp_group, world))
    # a dp group this rank is not in (new_group gives non-members a placeholder)
    others = [dist.new_group([d * pp + p for d in range(2)], backend="gloo") for p in range(pp)]
    seen["dp_group without this rank"] = _outcome(lambda: pipeline(pp_group, others[(position + 1) % pp]))
    seen["the right groups"] = _outcome(lambda: pipeline(pp_group, dp_group))
    for g in others:
        if isinstance(g, dist.ProcessGroup):
            dist.destroy_process_group(g)
    return seen


def reduction_overlap(rank, world, name):
    """A traced step (the second: plans learnt) with small buckets: which buckets went from the last
    backward's hooks, and when each stage's buckets were sent relative to this rank's backwards."""
    r = Replica(rank, world, name, 4, 2, width=32, bucket_bytes=2048, trace=True)
    for step in range(2):
        x, y = r.global_batch(step, 8)
        r.pipeline_step(x, y, [])
        r.zero_grad()
    pipe = r.pipe
    x, y = r.global_batch(2, 8)
    r.pipeline_step(x, y, [])
    events = pipe.trace()
    sent: dict[int, list[float]] = {}
    for e in events:
        if e["name"].startswith("DP:reduce "):
            sent.setdefault(int(e["name"].split()[1].split("/")[0]), []).append(e["start_us"])
    backwards = {s.stage_index: [e for e in events if e["name"].startswith(f"PP:{s.stage_index}")
                                 and e["name"][len(f"PP:{s.stage_index}")] in "BIW"] for s in r.stages}
    last = {s: max(evs, key=lambda e: e["end_us"]) for s, evs in backwards.items()}
    # each stage: its first bucket went before its last backward ended (from the hooks, inside it)
    inside = {s: min(sent[s]) < last[s]["end_us"] for s in sent}
    # two stages: the one reduced first had all its buckets out before the other's last backward began
    order = sorted(sent, key=lambda s: max(sent[s]))
    under_other = None
    if len(order) == 2:
        under_other = max(sent[order[0]]) < last[order[1]]["start_us"]
    # buckets go in index order (the same on every replica): their send times rise with the index
    starts = [t0 for _, _, _, t0, _ in sorted(pipe.gradients.dp.reducer.trace(), key=lambda e: e[1])]
    return {"early": pipe.gradients.dp.reducer.early_buckets, "buckets": pipe.gradients.dp.reducer.num_buckets, "inside": inside,
            "under_other": under_other, "stages": sorted(sent), "in_order": starts == sorted(starts)}


class _SharedWeightMatmul(torch.autograd.Function):
    """x @ w.T whose weight gradient is accumulated into w.grad by a closure handed to
    pc.defer_weight_grad (at W under a split backward): w also gets gradient the usual way."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors

        def weight_grad():
            g = grad_out.flatten(0, -2).t() @ x.flatten(0, -2)
            if w.grad is None:
                w.grad = g
            else:
                w.grad += g

        pc.defer_weight_grad(weight_grad)
        return grad_out @ w, None


class SharedDeferred(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return _SharedWeightMatmul.apply(h, self.lin.weight) + h


def deferred_shared_weight(rank, world, name):
    """A stage weight that gets gradient both from its accumulator and from a deferred closure: the
    bucket holding it must go only after both (W runs closures first)."""
    dp, pp, m, width = 2, world // 2, 4, 8
    mesh = data_parallel_mesh(dp, pp)
    replica, position = divmod(rank, pp)
    sched = pc.build_schedule(name, pp, m, stages_per_rank(name))
    topo = sched.topology
    torch.manual_seed(0)
    model = [SharedDeferred(width) for _ in range(len(set(topo.model_stage)))]
    stages = [pc.PipelineStage(copy.deepcopy(model[topo.model_stage[s]]), s, sched.num_stages)
              for s in sched.rank_stages(position)]
    pipe = pc.Pipeline(stages, sched, m, nn.functional.mse_loss, group=mesh.get_group("pp"),
                       dp_group=mesh.get_group("dp"), timeout=NEVER)
    worst = 0.0
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(dp * m * 2, width, generator=g), torch.randn(dp * m * 2, width, generator=g)
        pipe.step(*((x.chunk(dp)[replica],) if pipe.has_first else ()),
                  target=y.chunk(dp)[replica] if pipe.has_last else None)
        for mod in model:
            mod.zero_grad()
        h = x
        for mod in model:
            h = mod(h)
        nn.functional.mse_loss(h, y).backward()
        for s in stages:
            for p, q in zip(s.module.parameters(), model[topo.model_stage[s.stage_index]].parameters()):
                worst = max(worst, difference(p.grad, q.grad))
            s.module.zero_grad()
    return worst


def replicas_differ(rank, world):
    """Replica 1 holds a wider model: every rank's first step fails, naming what differs."""
    dp, pp = 2, world // 2
    mesh = data_parallel_mesh(dp, pp)
    replica, position = divmod(rank, pp)
    sched = pc.build_schedule("1f1b", pp, 2)
    width = 8 if replica == 0 else 12
    torch.manual_seed(0)
    stage = pc.PipelineStage(nn.Linear(width, width), position, pp)
    pipe = pc.Pipeline(stage, sched, 2, nn.functional.mse_loss, group=mesh.get_group("pp"),
                       dp_group=mesh.get_group("dp"), timeout=NEVER)
    return _outcome(lambda: pipe.step(*((torch.randn(4, width),) if pipe.has_first else ()),
                                      target=torch.randn(4, width) if pipe.has_last else None))


def checkpoint_round_trip(rank, world, path):
    """save_checkpoint on every rank (replica 0 writes), a step later load_checkpoint: every rank's
    weights and optimizer state are back to the saved ones."""
    r = Replica(rank, world, "interleaved_1f1b", 4, 2)
    opt = torch.optim.SGD(r.params, lr=0.1, momentum=0.9)
    x, y = r.global_batch(0, 8)
    r.pipeline_step(x, y, [])
    opt.step()
    pc.save_checkpoint(path, r.pipe, opt, extra={"step": 1})
    saved = [p.detach().clone() for p in r.params]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in r.params]
    r.zero_grad()
    x, y = r.global_batch(1, 8)
    r.pipeline_step(x, y, [])
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(saved, r.params))
    extra = pc.load_checkpoint(path, r.pipe, opt)
    return {"extra": extra, "weights": all(torch.equal(a, p) for a, p in zip(saved, r.params)),
            "momentum": all(torch.equal(a, opt.state[p]["momentum_buffer"]) for a, p in zip(momentum, r.params))}


class _FailInBackward(torch.autograd.Function):
    """Identity whose backward raises while `state["fail"]` and the step's `last`-th backward runs."""

    @staticmethod
    def forward(ctx, x, state):
        ctx.state = state
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        state = ctx.state
        state["backwards"] += 1
        if state["fail"] and state["backwards"] == state["last"]:
            raise RuntimeError("boom in the last backward")
        return grad, None


class FailingLastBackward(nn.Module):
    def __init__(self, inner, state):
        super().__init__()
        self.inner, self.state = inner, state

    def forward(self, x):
        return _FailInBackward.apply(self.inner(x), self.state)


def late_failure(rank, world, name, bad_rank):
    """`bad_rank` (a first stage) raises in its last backward of step 1, after its pipeline's other
    ranks sent and received everything: every rank of every replica fails the step, .grad stays as
    before it, and the next step equals one process."""
    r = Replica(rank, world, name, 4, 2)
    state = {"fail": False, "backwards": 0, "last": 4}
    first = [s for s in r.stages if s.stage_index == 0]
    if first:
        first[0].module = FailingLastBackward(first[0].module, state)
    x, y = r.global_batch(0, 8)
    r.reference_step(x, y)
    r.pipeline_step(x, y, [])
    before = [None if p.grad is None else p.grad.clone() for p in r.params]
    state.update(fail=rank == bad_rank, backwards=0)
    x, y = r.global_batch(1, 8)
    outcome = _outcome(lambda: r.pipeline_step(x, y, []))
    kept = all((a is None and p.grad is None) or (a is not None and p.grad is not None and torch.equal(a, p.grad))
               for a, p in zip(before, r.params))
    state.update(fail=False, backwards=0)
    r.zero_grad()
    x, y = r.global_batch(2, 8)
    r.reference_step(x, y)
    r.pipeline_step(x, y, [])
    r.compare_grads("after the failed step")
    return {"outcome": outcome, "kept": kept, "grad": r.worst["grad"]}


class ScaledLinear(nn.Module):
    """A Linear whose output is scaled by a 0-dim parameter registered last (first in its bucket)."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale


def scalar_parameters(rank, world):
    dp, pp, m, width = 2, world // 2, 4, 8
    mesh = data_parallel_mesh(dp, pp)
    replica, position = divmod(rank, pp)
    sched = pc.build_schedule("1f1b", pp, m)
    torch.manual_seed(0)
    model = [ScaledLinear(width) for _ in range(pp)]
    stage = pc.PipelineStage(copy.deepcopy(model[position]), position, pp)
    pipe = pc.Pipeline(stage, sched, m, nn.functional.mse_loss, group=mesh.get_group("pp"),
                       dp_group=mesh.get_group("dp"), timeout=NEVER, bucket_bytes=64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(dp * m * 2, width, generator=g)
    y = torch.randn(dp * m * 2, width, generator=g)
    pipe.step(*((x.chunk(dp)[replica],) if pipe.has_first else ()),
              target=y.chunk(dp)[replica] if pipe.has_last else None)
    h = x
    for mod in model:
        h = mod(h)
    nn.functional.mse_loss(h, y).backward()
    return {n: difference(p.grad, q.grad)
            for (n, p), q in zip(stage.module.named_parameters(), model[position].parameters())}


def eval_on_one_replica_first(rank, world):
    """Replica 0 evaluates before any training step (replica 1 does not): no dp exchange, then both
    train and match one process."""
    r = Replica(rank, world, "1f1b", 2, 2)
    x, y = r.global_batch(0, 4)
    if r.replica == 0:
        r.pipe.eval(*((r.local(x),) if r.pipe.has_first else ()))
    r.reference_step(x, y)
    r.pipeline_step(x, y, [])
    r.compare_grads("after eval on one replica")
    return r.worst["grad"]


def unfrozen_after_building(rank, world):
    """A parameter frozen when the Pipeline was built and trained later: the step fails on every
    rank (it would not be reduced over the replicas) instead of letting the replicas drift apart."""
    r = Replica(rank, world, "1f1b", 2, 2)
    frozen = next(r.stages[0].module.parameters())
    frozen.requires_grad_(False)
    pipe = pc.Pipeline(r.stages, r.pipe.schedule, 2, r.loss_fn, group=r.mesh.get_group("pp"),
                       dp_group=r.mesh.get_group("dp"), timeout=NEVER)
    frozen.requires_grad_(True)
    x, y = r.global_batch(0, 4)
    r.pipe = pipe
    return _outcome(lambda: r.pipeline_step(x, y, []))


def wrapped_pipeline_is_freed(rank, world):
    """A Pipeline with DDP stages is garbage once dropped (the executor's event callback holds it weakly)."""
    import gc
    import weakref

    mesh = data_parallel_mesh(2, world // 2)
    position = rank % (world // 2)
    module = nn.parallel.DistributedDataParallel(nn.Linear(4, 4), process_group=mesh.get_group("dp"))
    pipe = pc.Pipeline(pc.PipelineStage(module, position, world // 2), "1f1b", 2, nn.functional.mse_loss,
                       group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"))
    ref = weakref.ref(pipe)
    del pipe
    gc.collect()
    return ref() is None


def gpt_tied(rank, world, name, m):
    """The example GPT (token embedding tied to the LM head across pipeline ranks) on dp=2 x pp=2:
    the tied copies are reduced over dp with the other parameters, then summed over their stages."""
    from gpt import build_gpt, get_batch, lm_loss, pipeline_stages
    from gpt_cases import small_config, text

    dp, pp = 2, world // 2
    mesh = data_parallel_mesh(dp, pp)
    replica, position = divmod(rank, pp)
    sched = pc.build_schedule(name, pp, m, stages_per_rank(name))
    cfg = small_config(sched)
    model = build_gpt(cfg, seed=1)
    reference = copy.deepcopy(model)
    stages = pipeline_stages(model, sched, position)
    pipe = pc.Pipeline(stages, sched, m, loss_fn=lm_loss, group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"),
                       timeout=NEVER)
    worst = 0.0
    for step in range(2):
        x, y = get_batch(text(), step, 2 * m * dp, cfg.seq_len, seed=7)
        lm_loss(reference(x), y).backward()
        pipe.step(*((x.chunk(dp)[replica],) if pipe.has_first else ()),
                  target=y.chunk(dp)[replica] if pipe.has_last else None)
        for s in stages:
            for name_, p in s.module.named_parameters():
                worst = max(worst, difference(p.grad, reference.get_parameter(name_).grad))
            s.module.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    return worst


def dualpipe_mirrors(rank, world, bucket_bytes=None):
    """dualpipe (each rank holds two mirrored copies of model stages, summed after the step) with dp."""
    dp, pp, m = 2, world // 2, 4
    mesh = data_parallel_mesh(dp, pp)
    replica, position = divmod(rank, pp)
    sched = pc.build_schedule("dualpipe", pp, m, 2)
    topo = sched.topology
    model = make_stages("transformer", len(set(topo.model_stage)), width=16)
    ref = copy.deepcopy(model)
    stages = [pc.PipelineStage(copy.deepcopy(model[topo.model_stage[s]]), s, sched.num_stages)
              for s in sched.rank_stages(position)]
    loss_fn = nn.CrossEntropyLoss()
    pipe = pc.Pipeline(stages, sched, m, loss_fn, group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"),
                       timeout=NEVER, **({"bucket_bytes": bucket_bytes} if bucket_bytes else {}))
    worst = 0.0
    for step in range(2):
        x, y = make_batch(dp * 3 * m, width=16, seed=step + 1)
        for p in ref:
            p.zero_grad()
        loss_fn(reference_forward(ref, x), y).backward()
        pipe.step(*((x.chunk(dp)[replica],) if pipe.has_first else ()),
                  target=y.chunk(dp)[replica] if pipe.has_last else None)
        for s in stages:
            for p, q in zip(s.module.parameters(), ref[topo.model_stage[s.stage_index]].parameters()):
                worst = max(worst, difference(p.grad, q.grad))
            s.module.zero_grad(set_to_none=True)
    return worst


def shape_changes_on_the_device_path(rank, world, name, m, rows):
    """`rows[step][replica]`: the rows of each replica's batch, on the device path's protocol
    (messages="device"): a batch that changes shape runs a pass over stand-ins first. Each step is
    compared with one process (the replicas' mean losses averaged, as the reduction averages them);
    a step that fails with PeerFailedError is stepped again, as its message says. Returns per step
    the outcomes of its tries and the worst gradient difference of the one that counted."""
    r = Replica(rank, world, name, m, 2)
    set_messages(r.pipe, "device")
    pipe, seen = r.pipe, []
    for step, counts in enumerate(rows):
        xs, ys = zip(*[make_batch(n, width=r.width, seed=10 * step + d) for d, n in enumerate(counts)])
        loss = sum(r.loss_fn(reference_forward(r.ref, xc), yc) for xc, yc in zip(xs, ys)) / len(xs)
        loss.backward()
        tries = []
        for _ in range(2):
            outcome = _outcome(lambda: pipe.step(*((xs[r.replica],) if pipe.has_first else ()),
                                                 target=ys[r.replica] if pipe.has_last else None))
            tries.append((outcome[0], round(outcome[2], 1), outcome[1][:400]))
            if outcome[0] != "PeerFailedError":
                break
        if tries[-1][0] == "ok":
            r.compare_grads(f"step {step}")
        seen.append((tries, r.worst["grad"]))
        r.worst["grad"] = 0.0
        r.zero_grad()
    return seen


def executed_program(rank, world, name, m, dp):
    """A dp x pp step, then the program this rank's executor ran (REDUCE_GRAD placed for its
    buckets), as (replica, pipeline position, action labels)."""
    r = Replica(rank, world, name, m, dp)
    x, y = r.global_batch(0, 3 * m - 1)
    r.pipeline_step(x, y, [])
    return r.replica, r.position, list(r.pipe.programs[True].labels)
