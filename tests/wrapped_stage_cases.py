"""Stages wrapped in DDP or FSDP2 driven through pipecore.training.wrapped_stages.WrappedStage by hand, the way
the executor drives them, on every rank of a pool (the pool's world is the data-parallel group): each
rank runs all stages of a schedule in one process, every stage seeing the order of forwards and
backwards its rank runs in that schedule, and compares every gradient, loss and weight with one
process training the whole model on the whole (all replicas') batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipecore as pc
from models import pipeline_step
from pipecore.errors import InputError, PipelineError
from pipecore.training.wrapped_stages import WrappedStage
from exactness import difference

WIDTH = 16


def stage_modules(num_stages: int, seed: int = 0) -> list[torch.nn.Module]:
    """Linear+GELU stages; 15 rows in the middle shard unevenly over 2 ranks (FSDP2 pads)."""
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, 15), torch.nn.GELU(), torch.nn.Linear(15, WIDTH), torch.nn.GELU())
            for _ in range(num_stages)]


def dp_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,))


def wrap(module: torch.nn.Module, kind: str, world: int, options: dict) -> torch.nn.Module:
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            module, process_group=dist.group.WORLD, gradient_as_bucket_view=options.get("bucket_view", False),
            bucket_cap_mb=options.get("bucket_cap_mb", 25))
    from torch.distributed.fsdp import fully_shard
    mesh = dp_mesh(world)
    if options.get("nested"):  # one group per layer, then the stage's root group
        for layer in module:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=options.get("reshard_after_forward", True))
    return fully_shard(module, mesh=mesh)


def compute_order(name: str, m: int, num_ranks: int = 2) -> tuple[int, list[tuple[str, int, int]]]:
    """All ranks' compute actions of schedule `name` merged into one order that respects the data
    dependencies, as ("F"|"B", stage, microbatch); an input backward (I) is the stage's whole backward
    and a weight backward (W) nothing, as the executor runs wrapped stages. Also the stage count."""
    if name == "reversed":  # every forward, then the backwards from the last microbatch to the first
        return 2, ([("F", s, mb) for mb in range(m) for s in (0, 1)]
                   + [("B", s, mb) for mb in reversed(range(m)) for s in (1, 0)])
    sched = pc.build_schedule(name, num_ranks, m)
    topo = sched.topology
    queues = []
    for r in range(num_ranks):
        row = []
        for a in sched.actions[r]:
            for leaf in (a.sub_actions or (a,)):
                kind = leaf.kind.name
                if kind in ("F", "B", "I"):
                    row.append(("F" if kind == "F" else "B", leaf.stage, leaf.microbatch))
        queues.append(row)
    done: set = set()
    order = []
    while any(queues):
        progressed = False
        for q in queues:
            while q:
                kind, s, mb = q[0]
                if kind == "F":
                    ready = topo.prev_stage[s] < 0 or ("F", topo.prev_stage[s], mb) in done
                else:
                    ready = ("F", s, mb) in done and (topo.next_stage[s] < 0 or ("B", topo.next_stage[s], mb) in done)
                if not ready:
                    break
                order.append(q.pop(0))
                done.add(order[-1])
                progressed = True
        assert progressed, f"{name}: no action can run"
    return sched.num_stages, order


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class CommCounter:
    """Counts DDP's bucket all-reduces (pipecore's sum hook calls dist.all_reduce) and FSDP2's
    reduce-scatters and all-gathers."""

    def __init__(self, wrapped: list[torch.nn.Module], kind: str):
        self.count = {"allreduce": 0, "reduce_scatter": 0, "all_gather": 0}
        self._undo = []
        if kind == "ddp":
            assert all(w._comm_hooks for w in wrapped), "the adapters register their hook first"
            counted_ops = (("all_reduce", "allreduce"),)
        else:
            counted_ops = (("reduce_scatter_single", "reduce_scatter"), ("all_gather_single", "all_gather"))
        for name, key in counted_ops:
            orig = getattr(dist, name)

            def counted(*args, _orig=orig, _key=key, **kwargs):
                self.count[_key] += 1
                return _orig(*args, **kwargs)
            setattr(dist, name, counted)
            self._undo.append((name, orig))

    def snapshot(self) -> dict:
        return dict(self.count)

    def close(self) -> None:
        for name, orig in self._undo:
            setattr(dist, name, orig)


def train(rank: int, world: int, kind: str, name: str, m: int = 4, options: dict | None = None) -> dict:
    """`steps` optimizer steps through hand-driven wrapped stages and in one process. Returns the
    worst relative differences of gradients, losses and weights, and where reductions ran."""
    options = options or {}
    steps = options.get("steps", 2)
    average = not options.get("sum", False)
    num_stages, order = compute_order(name, m)
    plain = stage_modules(num_stages)
    for mod in plain:  # DDP broadcasts rank 0's buffers at the first forward of each step
        mod.register_buffer("tag", torch.zeros(()))
    reference = stage_modules(num_stages)
    wrapped = [wrap(mod, kind, world, options) for mod in plain]
    adapters = [WrappedStage.of(w, dist.group.WORLD) for w in wrapped]
    assert all(a is not None and a.kind == kind for a in adapters)
    optim = options.get("optim", "sgd")

    def make_opt(params):
        if optim == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(params, lr=0.1)
    opts = make_opt([p for w in wrapped for p in w.parameters()])
    ref_opt = make_opt([p for r in reference for p in r.parameters()])
    counter = CommCounter(wrapped, kind)
    last_b = {s: max(i for i, (k, st, _) in enumerate(order) if k == "B" and st == s) for s in range(num_stages)}
    worst = {"grad": 0.0, "loss": 0.0, "weight": 0.0}
    comm_outside: list[str] = []  # reductions that ran in an event other than the last backward / REDUCE_GRAD
    comm_at: dict[str, int] = {}
    grad_by_step: list[float] = []
    tags: list[list[float]] = []
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            X = torch.randn(world * m * 2, WIDTH, generator=g)
            Y = torch.randn(world * m * 2, WIDTH, generator=g)
            n_total = Y.numel()
            xs = X.chunk(world)[rank].chunk(m)
            ys = Y.chunk(world)[rank].chunk(m)

            def loss_fn(out, y):
                return F.mse_loss(out, y, reduction="mean" if average else "sum")
            weight = 1.0 / m if average else 1.0 / n_total

            failing = options.get("fail_step") == step
            if failing:
                before_step = [[None if p.grad is None else _full(p.grad).clone() for p in w.parameters()]
                               for w in wrapped]
            # reference: the whole model on the whole batch in one process
            h = X
            for mod in reference:
                h = mod(h)
            ref_loss = F.mse_loss(h, Y) if average else F.mse_loss(h, Y, reduction="sum") / n_total
            if not failing:
                ref_loss.backward()
            ref_mb_losses = []
            with torch.no_grad():
                for mb in range(m):
                    h = xs[mb]
                    for mod in reference:
                        h = mod(h)
                    ref_mb_losses.append(loss_fn(h, ys[mb]))

            for mod in plain:
                mod.tag.fill_(rank)
            for a in adapters:
                a.begin_step()
            for s, a in enumerate(adapters):
                if a.sharded:
                    before = counter.snapshot()
                    a.unshard()
                    comm_at[f"{s}UNSHARD"] = counter.snapshot()["all_gather"] - before["all_gather"]
            inputs: dict = {}
            outputs: dict = {}
            losses: dict = {}
            if failing:
                _failing_step(order, adapters, wrapped, xs, ys, loss_fn, weight, options["fail_where"], last_b)
                for a in adapters:
                    a.end_step(failed=True)
                for w, grads in zip(wrapped, before_step):  # .grad as before the failed step
                    for p, g in zip(w.parameters(), grads):
                        assert (p.grad is None) == (g is None) and (g is None or torch.equal(_full(p.grad), g)), \
                            f"step {step}: a failed step changed .grad"
                continue
            for i, (k, s, mb) in enumerate(order):
                before = counter.snapshot()
                if k == "F":
                    x = xs[mb] if s == 0 else outputs[(s - 1, mb)].detach().requires_grad_()
                    inputs[(s, mb)] = x
                    with torch.enable_grad(), adapters[s].forward_context():
                        out = wrapped[s](x)
                    if s == num_stages - 1:
                        losses[mb] = loss_fn(out, ys[mb])
                    outputs[(s, mb)] = out
                else:
                    if i == last_b[s]:
                        adapters[s].before_last_backward()
                    if s == num_stages - 1:
                        torch.autograd.backward(losses[mb], torch.tensor(weight))
                    else:
                        torch.autograd.backward(outputs[(s, mb)], inputs[(s + 1, mb)].grad)
                    del outputs[(s, mb)]
                    if i == last_b[s]:
                        after_b = counter.snapshot()
                        comm_at[f"{s}B_last"] = sum(after_b.values()) - sum(before.values())
                        adapters[s].reduce_grad(average)
                        after = counter.snapshot()
                        comm_at[f"{s}REDUCE_GRAD"] = after["reduce_scatter"] - after_b["reduce_scatter"]
                        if adapters[s].sharded:
                            adapters[s].reshard()
                        continue
                after = counter.snapshot()
                moved = {c: after[c] - before[c] for c in after if after[c] != before[c]}
                # an all-gather in a nested group's forward/backward is FSDP's reshard_after_forward
                if moved and set(moved) != {"all_gather"}:
                    comm_outside.append(f"{k}{s},{mb}: {moved}")
            for a in adapters:
                a.end_step(failed=False)
            tags.append([mod.tag.item() for mod in plain])

            for mb in range(m):
                worst["loss"] = max(worst["loss"], difference(losses[mb].detach(), ref_mb_losses[mb]))
            grad = 0.0
            for w, r in zip(wrapped, reference):
                for (pname, p), q in zip(w.named_parameters(), r.parameters()):
                    assert p.grad is not None, f"{pname} has no gradient"
                    grad = max(grad, difference(_full(p.grad), q.grad))
            worst["grad"] = max(worst["grad"], grad)
            grad_by_step.append(grad)
            if options.get("accumulate"):  # the next step adds to .grad, as loss.backward() twice
                continue
            opts.step()
            ref_opt.step()
            opts.zero_grad()
            ref_opt.zero_grad()
            for w, r in zip(wrapped, reference):
                for p, q in zip(w.parameters(), r.parameters()):
                    worst["weight"] = max(worst["weight"], difference(_full(p.detach()), q.detach()))
    finally:
        counter.close()
    # the module still works outside the pipeline: a plain forward/backward reduces as usual
    x = torch.randn(2, WIDTH)
    for w in wrapped:
        w(x).sum().backward()
        for p in w.parameters():
            assert p.grad is not None
            assert not (kind == "fsdp" and not hasattr(p.grad, "full_tensor")), "FSDP2 grad is not sharded"
    return {"worst": worst, "grad_by_step": grad_by_step, "comm_outside": comm_outside, "comm_at": comm_at, "tags": tags,
            "count": counter.snapshot(), "order": order}


def _failing_step(order, adapters, wrapped, xs, ys, loss_fn, weight, where, last_b) -> None:
    """Runs `order` until `where`: "forward", the last forward raises; "armed", the first stage to
    reach its last backward is armed and the backward never runs; "reduced", after the first
    stage's REDUCE_GRAD (a later stage of the step fails)."""
    num_stages = len(wrapped)
    inputs, outputs, losses = {}, {}, {}
    last_f = max(i for i, (k, _, _) in enumerate(order) if k == "F")
    for i, (k, s, mb) in enumerate(order):
        if k == "F":
            if where == "forward" and i == last_f:
                return
            x = xs[mb] if s == 0 else outputs[(s - 1, mb)].detach().requires_grad_()
            inputs[(s, mb)] = x
            with torch.enable_grad(), adapters[s].forward_context():
                outputs[(s, mb)] = wrapped[s](x)
            if s == num_stages - 1:
                losses[mb] = loss_fn(outputs[(s, mb)], ys[mb])
        else:
            if i == last_b[s]:
                adapters[s].before_last_backward()
                if where == "armed":
                    return
            if s == num_stages - 1:
                torch.autograd.backward(losses[mb], torch.tensor(weight))
            else:
                torch.autograd.backward(outputs[(s, mb)], inputs[(s + 1, mb)].grad)
            if i == last_b[s] and where == "reduced":
                adapters[s].reduce_grad(True)
                return


def misconfigured(rank: int, world: int, what: str) -> str:
    """The InputError message of.of() gives for a misconfigured wrapper ('' when none is raised)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    mod = stage_modules(1)[0]
    dp = dist.group.WORLD
    if what == "no_dp_group":
        module, dp = DDP(mod), None
    elif what == "ddp_other_group":
        own = [dist.new_group([r]) for r in range(world)][rank]
        module = DDP(mod, process_group=own)
    elif what == "fsdp_other_mesh":
        from torch.distributed.device_mesh import init_device_mesh
        module = fully_shard(mod, mesh=init_device_mesh("cpu", (world,)))
        dp = [dist.new_group([r]) for r in range(world)][rank]
    elif what == "find_unused":
        module = DDP(mod, find_unused_parameters=True)
    elif what == "static_graph":
        module = DDP(mod, static_graph=True)
    elif what == "nested_ddp":
        module = torch.nn.Sequential(DDP(mod))
    elif what == "nested_fsdp":
        fully_shard(mod[0], mesh=dp_mesh(world))
        module = mod
    else:
        raise ValueError(what)
    try:
        WrappedStage.of(module, dp)
    except InputError as exc:
        return str(exc)
    return ""


def different_dp_groups(rank: int, world: int) -> str:
    """The InputError for two DDP stage modules of one rank over different groups, or ''."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    pairs = [dist.new_group(list(r)) for r in ((0, 1), (2, 3))], [dist.new_group(list(r)) for r in ((0, 2), (1, 3))]
    groups = [pairs[0][rank // 2], pairs[1][rank % 2]]
    modules = [DDP(m, process_group=g) for m, g in zip(stage_modules(2), groups)]
    try:
        WrappedStage.common_group(modules)
    except InputError as exc:
        return str(exc)
    return ""


def hsdp_without_dp_group(rank: int, world: int) -> str:
    """FSDP2 over a 2 x 2 mesh (HSDP), no dp_group: which dimension replicates is not for pipecore to
    guess; the InputError, or ''."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    module = fully_shard(stage_modules(1)[0], mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("r", "s")))
    try:
        WrappedStage.common_group([module])
    except InputError as exc:
        return str(exc)
    return ""


def plain_is_none(rank: int, world: int) -> bool:
    return WrappedStage.of(stage_modules(1)[0], dist.group.WORLD) is None and \
        WrappedStage.of(stage_modules(1)[0], None) is None


def ddp_unused_parameter(rank: int, world: int) -> dict:
    """A DDP stage with a parameter no microbatch uses: REDUCE_GRAD says so (PipelineError), and after
    end_step(failed=True) the module trains again."""
    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(WIDTH, WIDTH)
            self.unused = torch.nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return self.used(x)
    torch.manual_seed(0)
    module = torch.nn.parallel.DistributedDataParallel(WithUnused(), process_group=dist.group.WORLD)
    stage = WrappedStage.of(module, dist.group.WORLD)
    stage.begin_step()
    with stage.forward_context():
        out = module(torch.randn(4, WIDTH))
    stage.before_last_backward()
    out.sum().backward()
    message = ""
    try:
        stage.reduce_grad(True)
    except PipelineError as exc:
        message = str(exc)
    stage.end_step(failed=True)
    module.zero_grad()
    stage.begin_step()
    with stage.forward_context():
        out = module(torch.randn(4, WIDTH)) + module.module.unused(torch.randn(4, WIDTH))
    stage.before_last_backward()
    out.sum().backward()
    stage.reduce_grad(True)
    stage.end_step(failed=False)
    return {"message": message, "grads": all(p.grad is not None for p in module.parameters())}


# -- end to end: pc.Pipeline(..., dp_group=) with wrapped stage modules, 4 ranks = dp 2 x pp 2 --------

_MESH = {}


def _mesh(dp: int, pp: int):
    """pc.init_mesh(dp, pp), once per process (making groups is a collective)."""
    if (dp, pp) not in _MESH:
        _MESH[(dp, pp)] = pc.init_mesh(dp=dp, pp=pp)
    return _MESH[(dp, pp)]


def weights_last(pp: int, m: int) -> pc.Schedule:
    """A user's CSV schedule with the I/W split: 1F1B whose backwards are input backwards (I), each
    rank's weight backwards (W) all after its last I, the last microbatch's first."""
    import tempfile

    rows = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        row = [f"{r}F{mb}" for mb in range(warmup)]
        for mb in range(m):
            if mb + warmup < m:
                row.append(f"{r}F{mb + warmup}")
            row.append(f"{r}I{mb}")
        rows.append(",".join(row + [f"{r}W{mb}" for mb in reversed(range(m))]))
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/weights_last.csv"
        with open(path, "w") as f:
            f.write("\n".join(rows) + "\n")
        return pc.Schedule.from_csv(path)


def schedule(name: str, pp: int, m: int) -> pc.Schedule:
    """Schedule `name` on `pp` ranks (2 stages per rank where it takes a number), or "weights_last"."""
    if name == "weights_last":
        return weights_last(pp, m)
    return pc.build_schedule(name, pp, m, None if name in ("1f1b", "gpipe", "dualpipe") else 2)


def pipeline_train(rank: int, world: int, kind: str, name: str, m: int = 4, options: dict | None = None) -> dict:
    """`steps` SGD steps through pc.Pipeline with every stage module wrapped in DDP (over the dp
    group) or FSDP2 (over the dp mesh dimension; options "dp": its size, 2 unless given, and
    "reshard_after_forward"), next to one process training the whole model on
    the whole global batch. Returns the worst relative differences per step."""
    import copy

    from torch.distributed.fsdp import fully_shard

    options = options or {}
    dp = options.get("dp", 2)
    pp = world // dp
    mesh = _mesh(dp, pp)
    replica, position = divmod(rank, pp)
    sched = schedule(name, pp, m)
    topo = sched.topology
    model = stage_modules(len(set(topo.model_stage)))
    reference = copy.deepcopy(model)
    wrapped = {}
    reshard = options.get("reshard_after_forward", True)
    for s in sched.rank_stages(position):
        module = copy.deepcopy(model[topo.model_stage[s]])
        if position in options.get("plain_positions", ()):  # this rank's stages left plain
            pass
        elif kind == "ddp":
            module = torch.nn.parallel.DistributedDataParallel(module, process_group=mesh.get_group("dp"))
        else:
            if options.get("nested"):
                for layer in module:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard)
            module = fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard)
        wrapped[s] = module
    stages = [pc.PipelineStage(wrapped[s], s, sched.num_stages) for s in sched.rank_stages(position)]
    pipe = pc.Pipeline(stages, sched, m, loss_fn=torch.nn.MSELoss(), group=mesh.get_group("pp"),
                       dp_group=None if options.get("infer_dp_group") else mesh.get_group("dp"), timeout=60)
    opt = torch.optim.SGD([p for w in wrapped.values() for p in w.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([p for r in reference for p in r.parameters()], lr=0.1)
    result = {"grad": [], "loss": [], "weight": [], "dp_replicas": pipe.gradients.dp is not None}
    for step in range(options.get("steps", 2)):
        g = torch.Generator().manual_seed(100 + step)
        X = torch.randn(dp * m * 2, WIDTH, generator=g)
        Y = torch.randn(dp * m * 2, WIDTH, generator=g)
        x, y = X.chunk(dp)[replica], Y.chunk(dp)[replica]
        losses: list = []
        if step == 0 and options.get("fail_first_step"):  # rank 0's input is bad: every rank fails the step
            try:
                pipeline_step(pipe, x[:, :3] if rank == 0 else x, y, losses=losses)
            except Exception as exc:  # noqa: BLE001 - reported
                result["first_step"] = f"{type(exc).__name__}: {exc}"
            else:
                result["first_step"] = "ok"
            assert all(p.grad is None for w in wrapped.values() for p in w.parameters())
        pipeline_step(pipe, x, y, losses=losses)
        h = X
        for mod in reference:
            h = mod(h)
        F.mse_loss(h, Y).backward()
        if options.get("max_norm"):  # global-norm clipping over pp x dp (FSDP2: shards summed over dp)
            norm = pc.clip_grad_norm_(pipe, options["max_norm"])
            ref_norm = torch.nn.utils.clip_grad_norm_([p for r in reference for p in r.parameters()],
                                                      options["max_norm"])
            assert ref_norm > options["max_norm"], ref_norm
            result.setdefault("norm", []).append(difference(norm, ref_norm))
        loss = 0.0
        if pipe.has_last:
            with torch.no_grad():
                for mb, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):
                    if losses[mb] is None:  # dualpipe: computed by the other direction's last stage
                        continue
                    h = xm
                    for mod in reference:
                        h = mod(h)
                    loss = max(loss, difference(losses[mb].detach(), F.mse_loss(h, ym)))
        grad = 0.0
        for s, w in wrapped.items():
            for p, q in zip(w.parameters(), reference[topo.model_stage[s]].parameters()):
                grad = max(grad, difference(_full(p.grad), q.grad))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        weight = max(difference(_full(p.detach()), q.detach()) for s, w in wrapped.items()
                     for p, q in zip(w.parameters(), reference[topo.model_stage[s]].parameters()))
        result["grad"].append(grad)
        result["loss"].append(loss)
        result["weight"].append(weight)
    if options.get("checkpoint_dir"):  # saved and loaded back: the weights as they were
        before = {(s, n): _full(p.detach()).clone() for s, w in wrapped.items() for n, p in w.named_parameters()}
        pc.save_checkpoint(options["checkpoint_dir"], pipe, opt)
        with torch.no_grad():
            for w in wrapped.values():
                for p in w.parameters():
                    p.zero_()
        pc.load_checkpoint(options["checkpoint_dir"], pipe, opt)
        result["checkpoint"] = max(difference(_full(p.detach()), before[s, n]) for s, w in wrapped.items()
                                   for n, p in w.named_parameters())
    # OVERLAP_F_B pairs of wrapped stages run in sequence (their hooks expect one backward at a time)
    result["pairs"] = sum(a.kind is pc.Kind.OVERLAP_F_B for a in pipe.schedule.lower().actions[position])
    result["overlap_fallbacks"], result["overlapped"] = pipe.overlap_fallbacks, pipe.overlapped_pairs
    return result


def ddp_armed_late(rank: int, world: int) -> dict:
    """The executor's contract broken: the DDP reducer armed after the stage's last backward ran.
    The step fails with a PipelineError (instead of all-reducing in the next step's first backward),
    and after end_step(failed=True) a correct step equals one process."""
    module = wrap(stage_modules(1)[0], "ddp", world, {})
    reference = stage_modules(1)[0]
    stage = WrappedStage.of(module, dist.group.WORLD)
    xs = [torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    stage.begin_step()
    with stage.forward_context():
        out = module(xs[rank])
    out.sum().backward()
    stage.before_last_backward()
    message = ""
    try:
        stage.reduce_grad(True)
        stage.end_step(failed=False)
    except PipelineError as exc:
        message = str(exc)
        stage.end_step(failed=True)
    module.zero_grad()
    counter = CommCounter([module], "ddp")
    stage.begin_step()
    with stage.forward_context():
        out = module(xs[rank])
    out.sum().backward()  # one microbatch before the last: no all-reduce may run here
    early = counter.snapshot()["allreduce"]
    with stage.forward_context():
        out = module(xs[rank])
    stage.before_last_backward()
    out.sum().backward()
    stage.reduce_grad(True)
    stage.end_step(failed=False)
    reference(torch.cat(xs)).sum().mul(2 / world).backward()
    grad = max(difference(p.grad, q.grad) for p, q in zip(module.parameters(), reference.parameters()))
    return {"message": message, "grad": grad, "early": early}


def fsdp_adapter_made_while_unsharded(rank: int, world: int) -> bool:
    """of() on an FSDP2 root left unsharded by a plain forward still sets the sharded .grad aside."""
    from torch.distributed.fsdp import fully_shard
    module = fully_shard(stage_modules(1)[0], mesh=dp_mesh(world))
    module(torch.randn(2, WIDTH)).sum().backward()  # a plain step: sharded .grad set
    with torch.no_grad():
        module(torch.randn(2, WIDTH))  # the root keeps its parameters unsharded after forward
    stage = WrappedStage.of(module, dist.group.WORLD)
    sharded = [p for p in stage._params]
    stage.begin_step()
    aside = all(p.grad is None for p in sharded) and stage._stash is not None
    stage.end_step(failed=True)
    return aside and all(hasattr(p, "full_tensor") and p.grad is not None for p in sharded)


def ddp_sums_exactly(rank: int, world: int) -> dict:
    """dp = `world` replicas (3: not a power of two) of a one-stage pipeline whose stage is a DDP
    Linear, with integer inputs and a sum loss divided by loss_divisor=1: each replica's gradient is
    integers, so the replicas' sum is exact in fp32, the dtype this case is about. .grad must be exactly
    that sum (DDP's own hook divides by dp, which multiplied back is exact only when dp is a power of two)."""
    mesh = _mesh(world, 1)
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8, bias=False, dtype=torch.float32)
    ddp = torch.nn.parallel.DistributedDataParallel(layer, process_group=mesh.get_group("dp"))
    pipe = pc.Pipeline(pc.PipelineStage(ddp, 0, 1), "1f1b", 2, loss_fn=lambda out: out.sum(),
                       group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"), timeout=60)
    g = torch.Generator().manual_seed(7)
    X = torch.randint(-50, 50, (world * 4, 8), generator=g).float()  # fp32 on purpose
    pipe.step(X.chunk(world)[rank], loss_divisor=1.0)
    want = X.sum(0).expand(8, 8)  # d(sum(X W^T))/dW: every row of W gets the column sums of X
    return {"exact": bool(torch.equal(layer.weight.grad, want)),
            "worst": float((layer.weight.grad - want).abs().max())}
