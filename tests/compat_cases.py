"""Rank functions for tests/test_compat.py: torch.distributed.pipelining's names run by pipecore."""

from __future__ import annotations

import copy
import os
import types

import torch
import torch.distributed as dist
from torch import nn

from exactness import difference

LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_style_loop.py")
TORCH_IMPORTS = ("from torch.distributed.pipelining import PipelineStage\n",
                 "from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineScheduleRuntime, "
                 "get_schedule_class\n")


def load_loop(api: str) -> types.ModuleType:
    """tests/torch_style_loop.py as written ("torch") or with its imports switched to pipecore.compat."""
    with open(LOOP) as f:
        source = f.read()
    if api == "pipecore":
        for line in TORCH_IMPORTS:
            assert source.count(line) == 1, f"the loop's import changed: {line!r}"
            source = source.replace(line, line.replace("torch.distributed.pipelining", "pipecore.compat"))
        imports = [ln for ln in source.splitlines() if ln.startswith(("from ", "import "))]
        assert not any("torch.distributed.pipelining" in ln for ln in imports), imports
    module = types.ModuleType(f"torch_style_loop_{api}")
    module.__file__ = LOOP
    exec(compile(source, LOOP, "exec"), module.__dict__)
    return module


def reference(loop, schedule_name: str, world: int, n_microbatches: int, steps: int, rows: int, seed: int,
              scale_grads: bool) -> dict:
    """The same training in one process on the whole model: per step, the microbatches' losses
    (each microbatch's mean / n_microbatches, as both pipelines weigh them) and every gradient."""
    looped = issubclass(loop.get_schedule_class(schedule_name), loop.PipelineScheduleMulti)
    num_stages = world * (2 if looped else 1)
    whole = loop.make_model(2 * num_stages, seed)
    chunks = [loop.model_chunk(whole, s, num_stages) for s in range(num_stages)]  # each adds pos_bias

    def model(x, pos_bias):
        for chunk in chunks:
            x = chunk(x, pos_bias=pos_bias)
        return x

    def named_parameters():
        return [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]

    opt = torch.optim.AdamW([p for _, p in named_parameters()], lr=1e-2)
    data = loop.batches(steps, rows, seed + 1)
    out = {"losses": [], "grads": []}
    split = lambda t: t.tensor_split(n_microbatches)  # noqa: E731
    for tokens, labels, pos_bias in data[:steps]:
        opt.zero_grad()
        losses = [loop.cross_entropy(model(x, b), y, ignore_index=-1)
                  for x, y, b in zip(split(tokens), split(labels), split(pos_bias))]
        (sum(losses) / n_microbatches).backward()
        out["losses"].append([float(x.detach()) for x in losses])
        out["grads"].append({n: p.grad.clone() for n, p in named_parameters()})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in named_parameters()}
    tokens, labels, pos_bias = data[steps]
    with torch.no_grad():
        logits = model(tokens, pos_bias)
        out["eval_losses"] = [float(loop.cross_entropy(model(x, b), y, ignore_index=-1))
                              for x, y, b in zip(split(tokens), split(labels), split(pos_bias))]
    out["eval_output"] = logits
    return out


def torch_and_pipecore(rank, world, schedule_name, n_microbatches, steps=3, rows=16, seed=0, scale_grads=True,
                       torch_evaluates=True, csv=None):
    """The loop on this group with torch (as written) and with pipecore (imports switched), and the
    single-process reference on rank 0."""
    results = {}
    for api in ("torch", "pipecore"):
        loop = load_loop(api)
        results[api] = loop.train(schedule_name, n_microbatches, steps, rows, seed, scale_grads,
                                  evaluate=api == "pipecore" or torch_evaluates, csv=csv)
        dist.barrier()
    if rank == 0:
        results["reference"] = reference(load_loop("torch"), schedule_name, world, n_microbatches, steps, rows,
                                         seed, scale_grads)
    return results


def torch_215_loop(rank, world, schedule_name, n_microbatches, options, step_options, csv):
    """torch 2.15's arguments in the loop: torch's run (which writes its compute_comms CSV, waits
    included, to `csv`), pipecore's with the same arguments, and pipecore's _PipelineScheduleRuntime
    running torch's CSV. Each: losses, gradients, parameters, and pipeline_order_with_comms."""
    results = {}
    for api, kwargs in (("torch", dict(dump_csv=csv)), ("pipecore", {}),
                        ("pipecore_csv", dict(csv=csv, csv_format="compute_comms"))):
        loop = load_loop("torch" if api == "torch" else "pipecore")
        results[api] = loop.train(schedule_name, n_microbatches, 2, 16, 0, True, evaluate=False, options=options,
                                  step_options=step_options, **kwargs)
        dist.barrier()
    return results


def refused_215_option(rank, world, schedule_name, options):
    """What the loop's schedule class says to `options` on pipecore (the error's type and text)."""
    loop = load_loop("pipecore")
    try:
        loop.Run(schedule_name, 4, options=options)
    except Exception as exc:  # noqa: BLE001 (the test checks what it is)
        return type(exc).__name__, str(exc)
    return None


def finalize_gradients_on_fsdp2(rank, world, wrapped_ranks):
    """step(finalize_gradients=False) with FSDP2 stage modules on `wrapped_ranks` (dp=1), through
    pipecore.compat: what each rank's step raises, then whether a plain step() works after it."""
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    from pipecore.compat import PipelineStage
    from pipecore.compat.schedules import Schedule1F1B
    from wrapped_stage_cases import WIDTH as W, _mesh, stage_modules

    mesh = _mesh(1, world)
    module = stage_modules(world)[rank]
    if rank in wrapped_ranks:
        module = fully_shard(module, mesh=mesh["dp"])
    schedule = Schedule1F1B(PipelineStage(module, rank, world, torch.device("cpu"), group=mesh.get_group("pp")),
                            n_microbatches=2, loss_fn=F.mse_loss)
    x, y = torch.randn(4, W), torch.randn(4, W)
    args = (x,) if rank == 0 else ()
    target = y if rank == world - 1 else None
    try:
        schedule.step(*args, target=target, finalize_gradients=False)
        raised = None
    except Exception as exc:  # noqa: BLE001 (the test checks what it is)
        raised = (type(exc).__name__, str(exc))
    schedule.step(*args, target=target)
    return raised, all(p.grad is not None for p in module.parameters())


def forward_contexts(rank, world, checkpointing=False):
    """torch 2.15's register_forward_context on pipecore.compat's stages: what each factory saw, whether
    the stage's module ran inside the context, after step(), eval() and after the handle's removal."""
    import contextlib

    from pipecore.compat import PipelineStage, PipelineStageInfo
    from pipecore.compat.schedules import ScheduleInterleaved1F1B

    inside = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            inside.append(bool(active))
            return torch.tanh(self.lin(x))

    active: list = []
    seen: list = []

    @contextlib.contextmanager
    def context(info):
        assert isinstance(info, PipelineStageInfo)
        seen.append((info.stage_index, info.microbatch_index, info.is_metadata_inference))
        active.append(info)
        try:
            yield
        finally:
            active.pop()

    torch.manual_seed(0)
    ids = [rank, rank + world]
    stages = [PipelineStage(Probe(), s, 2 * world, torch.device("cpu"), activation_checkpointing=checkpointing)
              for s in ids]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    handles = [s.register_forward_context(context) for s in stages]
    try:
        stages[0].register_forward_context(context)
        second = None
    except RuntimeError as exc:
        second = str(exc)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    run = dict(target=y if rank == world - 1 else None)
    schedule.step(*((x,) if rank == 0 else ()), **run)
    after_step = sorted(seen)
    seen.clear()
    schedule.eval(*((x,) if rank == 0 else ()), **run)
    after_eval = sorted(seen)
    seen.clear()
    for h in handles:
        h.remove()
    schedule.step(*((x,) if rank == 0 else ()), **run)
    return {"step": after_step, "eval": after_eval, "removed": list(seen), "inside": inside, "second": second}


def activation_liveness(rank, world, schedule_name):
    """torch 2.15's analyze_pipeline_activation_liveness (served by pipecore.compat) over a pipecore.compat
    schedule, for each rank's stages: {rank: (num_slots, {(stage, mb): (forward, release)})}."""
    from pipecore.compat import analyze_pipeline_activation_liveness

    loop = load_loop("pipecore")
    run = loop.Run(schedule_name, 4)
    topo = run.schedule.schedule.topology
    out = {}
    for r in range(world):
        plan = analyze_pipeline_activation_liveness(run.schedule, pp_rank=r, stage_indices=topo.rank_stages(r),
                                                    granularity="stage_microbatch")
        lifetimes = {key: plan.get_activation_lifetime(*key) for key in plan.slot_by_stage_and_microbatch}
        out[r] = (plan.num_slots, lifetimes)
    return out


# -- torch's own stage objects, dw_builder, chunk specs -------------------------------------------

WIDTH = 8


class LinearNoWeightGrad(torch.autograd.Function):
    """A fused linear whose backward computes only the input gradient: its weight gradient is the
    stage's dw_builder's work (torch's recipe for custom weight-gradient code)."""

    @staticmethod
    def forward(ctx, x, weight, store):
        ctx.save_for_backward(x)
        ctx.weight, ctx.store = weight, store
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        ctx.store.append((x.detach(), grad_out.detach()))
        return grad_out @ ctx.weight, None, None


class DwLinear(nn.Module):
    """y = tanh(x @ W^T); W's gradient comes from the dw_builder below, never from autograd."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH ** 0.5)
        self.bias = nn.Parameter(torch.zeros(WIDTH))  # an autograd-computed parameter beside it
        self.store: list = []
        self.log: list = []

    def forward(self, x):
        return torch.tanh(LinearNoWeightGrad.apply(x, self.weight, self.store) + self.bias)

    def dw_builder(self):
        """Called after a microbatch's backward: its runner accumulates that microbatch's W gradient."""
        pending = list(self.store)
        self.store.clear()
        self.log.append(("build", len(pending)))

        def runner():
            self.log.append(("run", len(pending)))
            for x, g in pending:
                grad = g.flatten(0, -2).t() @ x.flatten(0, -2)
                self.weight.grad = grad if self.weight.grad is None else self.weight.grad + grad
        return runner


def dw_builder_run(rank, world, api, schedule_name, m, options=None):
    """Two stages per rank (one for gpipe/1f1b) of DwLinear, each with its dw_builder, 2 steps;
    returns grads, losses and each stage's build/run log."""
    from torch.distributed.pipelining import schedules as torch_schedules

    import pipecore.compat as compat

    looped = schedule_name not in ("GPipe", "1F1B")
    n_stages = world * (2 if looped else 1)
    ids = ([rank, 2 * world - 1 - rank] if schedule_name in ("ZBVZeroBubble", "DualPipeV")
           else [rank + k * world for k in range(2 if looped else 1)])
    mods = {s: DwLinear(100 + s) for s in ids}
    if api == "torch":
        from torch.distributed.pipelining import PipelineStage
        get_cls = torch_schedules.get_schedule_class
    else:
        PipelineStage, get_cls = compat.PipelineStage, compat.get_schedule_class
    stages = [PipelineStage(mods[s], s, n_stages, torch.device("cpu"), dw_builder=mods[s].dw_builder) for s in ids]
    sched = get_cls(schedule_name)(stages if looped else stages[0], m, loss_fn=nn.MSELoss(), **(options or {}))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(4 * m, WIDTH, generator=g), torch.randn(4 * m, WIDTH, generator=g)
    out = {"losses": [], "grads": []}
    for _ in range(2):
        for mod in mods.values():
            mod.zero_grad()
            mod.log.clear()
        losses = []
        first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        out["losses"].append([float(v.detach()) for v in losses])
        out["grads"].append({f"{s}.{n}": p.grad.clone() for s in ids for n, p in mods[s].named_parameters()})
        out["log"] = {s: list(mods[s].log) for s in ids}
    out["overlapped_pairs"] = sched.pipeline.overlapped_pairs if api == "pipecore" else None
    return out


def dw_reference(world, schedule_name, m):
    looped = schedule_name not in ("GPipe", "1F1B")
    n_stages = world * (2 if looped else 1)
    mods = [DwLinear(100 + s) for s in range(n_stages)]
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(4 * m, WIDTH, generator=g), torch.randn(4 * m, WIDTH, generator=g)
    h = x
    for mod in mods:
        h = mod(h)
    (nn.functional.mse_loss(h, y)).backward()
    for mod in mods:
        mod.dw_builder()()
    return {f"{s}.{n}": p.grad.clone() for s, mod in enumerate(mods) for n, p in mod.named_parameters()}


def torch_stage_objects(rank, world):
    """torch's own PipelineStage objects handed to pc.Pipeline and to a compat schedule: converted,
    and the result equals single-process training."""
    from torch.distributed.pipelining import PipelineStage as TorchStage

    import pipecore as pc
    import pipecore.compat as compat

    torch.manual_seed(0)
    model = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(world)]
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    ref = [copy.deepcopy(m) for m in model]
    h = x
    for m in ref:
        h = m(h)
    nn.functional.mse_loss(h, y).backward()
    results = {}
    for how in ("Pipeline", "schedule"):
        mod = copy.deepcopy(model[rank])
        stage = TorchStage(mod, rank, world, torch.device("cpu"))
        if how == "Pipeline":
            runner = pc.Pipeline(stage, "1f1b", 4, loss_fn=nn.MSELoss())
        else:
            runner = compat.Schedule1F1B(stage, 4, loss_fn=nn.MSELoss())
        runner.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        results[how] = max(difference(p.grad, q.grad)
                           for p, q in zip(mod.parameters(), ref[rank].parameters()))
    return results


class TwoInputs(nn.Module):
    """First stage of the chunk-spec case: x split along dim 1 (time), a replicated bias vector."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, shift):
        return self.fc(x + shift)


def time_major_mse(out, target):
    return nn.functional.mse_loss(out.transpose(0, 1), target)


def chunk_specs(rank, world, api):
    """args_chunk_spec splitting along dim 1 and a replicated argument; output_merge_spec merging
    along dim 1: torch and pipecore give the same outputs and gradients."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    import pipecore.compat as compat

    if api == "torch":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    else:
        PipelineStage, Schedule1F1B = compat.PipelineStage, compat.Schedule1F1B
    torch.manual_seed(4)
    mod = TwoInputs() if rank == 0 else nn.Linear(WIDTH, WIDTH)
    x = torch.randn(3, 8, WIDTH)  # (batch, time, width): microbatches are time slices
    shift = torch.randn(WIDTH)
    y = torch.randn(3, 8, WIDTH)
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    sched = Schedule1F1B(stage, 4, loss_fn=time_major_mse, args_chunk_spec=(TensorChunkSpec(1), _Replicate),
                         output_merge_spec=TensorChunkSpec(1))
    # both split the target along dim 0 (torch's _TARGET_CHUNK_SPEC): it is given time-major
    out = sched.step(*((x, shift) if rank == 0 else ()), target=y.transpose(0, 1).contiguous() if rank == 1 else None)
    return {"out": out.detach() if out is not None else None,
            "grads": {n: p.grad.clone() for n, p in mod.named_parameters()}}


def misuse(rank, world, case, tmp):
    """One misuse (or option) of the compat surface on every rank: (exception type name, message),
    or ("ok", detail)."""
    import pipecore as pc
    from pipecore.compat import PipelineStage, Schedule1F1B, ScheduleDualPipe, ScheduleInterleaved1F1B
    from pipecore.compat.schedules import PipelineScheduleMulti, _PipelineScheduleRuntime

    torch.manual_seed(0)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    try:
        if case == "no_grad":
            sched = Schedule1F1B(PipelineStage(nn.Linear(WIDTH, WIDTH), rank, world), 4, loss_fn=nn.MSELoss())
            with torch.no_grad():
                sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
        elif case == "no_schedule":
            PipelineScheduleMulti([PipelineStage(nn.Linear(WIDTH, WIDTH), rank, world)], 4,
                                  loss_fn=nn.MSELoss()).step(x)
        elif case == "list_to_single":
            Schedule1F1B([PipelineStage(nn.Linear(WIDTH, WIDTH), rank, world)], 4)
        elif case == "bad_dw_builder":
            PipelineStage(nn.Linear(WIDTH, WIDTH), rank, world, dw_builder=3)
        elif case == "runner_not_callable":
            builder = (lambda: None) if rank == 1 else (lambda: (lambda: None))
            stages = [PipelineStage(nn.Linear(WIDTH, WIDTH), s, 2 * world, dw_builder=builder)
                      for s in (rank, 2 * world - 1 - rank)]
            sched = pc.compat.ScheduleZBVZeroBubble(stages, 4, loss_fn=nn.MSELoss())
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == 0 else None)
        elif case == "csv_microbatches":
            path = os.path.join(tmp, "custom.csv")
            if rank == 0:
                pc.build_schedule("interleaved_1f1b", world, 6, 2).to_csv(path)
            dist.barrier()
            stages = [PipelineStage(nn.Linear(WIDTH, WIDTH), s, 2 * world) for s in (rank, rank + world)]
            _PipelineScheduleRuntime(stages, 4, loss_fn=nn.MSELoss())._load_csv(path)
        elif case == "comms_as_compute_only":
            path = os.path.join(tmp, "lowered.csv")
            if rank == 0:
                pc.build_schedule("interleaved_1f1b", world, 4, 2).lower().to_csv(path)
            dist.barrier()
            stages = [PipelineStage(nn.Linear(WIDTH, WIDTH), s, 2 * world) for s in (rank, rank + world)]
            sched = _PipelineScheduleRuntime(stages, 4, loss_fn=nn.MSELoss())
            try:
                sched._load_csv(path)
            except Exception as exc:
                # the same file as compute_comms: pipecore keeps its compute order
                sched._load_csv(path, format="compute_comms")
                assert [str(a) for a in sched.pipeline_order[rank]] == [
                    str(a) for a in pc.build_schedule("interleaved_1f1b", world, 4, 2).actions[rank]]
                raise exc
        elif case == "dualpipe_roles":
            # rank r holds stages r and 2R-1-r; stage R starts the reverse direction, R-1 ends the forward one
            torch.manual_seed(1)
            model = [nn.Linear(WIDTH, WIDTH) for _ in range(world)]
            ids = (rank, 2 * world - 1 - rank)
            stages = [PipelineStage(copy.deepcopy(model[s % world]), s, 2 * world) for s in ids]
            before = [(s.is_first, s.is_last) for s in stages]
            sched = ScheduleDualPipe(stages, 4, loss_fn=nn.MSELoss())
            after = [(s.is_first, s.is_last) for s in stages]
            want = [(s in (0, world), s in (world - 1, 2 * world - 1)) for s in ids]
            assert before == [(s == 0, s == 2 * world - 1) for s in ids] and after == want, (before, after, want)
            first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
            losses = []
            sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
            mine = [v for v in losses if v is not None]  # each direction carries half the microbatches
            assert len(losses) == 4 and len(mine) == 2 and all(torch.isfinite(v) for v in mine), losses
        elif case == "dw_builder_with_ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            mod = DDP(nn.Linear(WIDTH, WIDTH))
            Schedule1F1B(PipelineStage(mod, rank, world, dw_builder=lambda: (lambda: None)), 4, loss_fn=nn.MSELoss())
        elif case == "custom_function":
            stages = [PipelineStage(nn.Linear(WIDTH, WIDTH), s, 2 * world) for s in (rank, 2 * world - 1 - rank)]
            pc.compat.ScheduleDualPipeV(stages, 4, loss_fn=nn.MSELoss()).register_custom_function("OVERLAP_F_B", print)
        elif case == "no_loss_fn":
            # torch: a schedule without loss_fn runs forwards only; step() returns what eval() returns
            torch.manual_seed(2)
            mod = nn.Linear(WIDTH, WIDTH)
            sched = Schedule1F1B(PipelineStage(mod, rank, world), 4)
            out = sched.step(*((x,) if rank == 0 else ()))
            again = sched.eval(*((x,) if rank == 0 else ()))
            assert all(p.grad is None for p in mod.parameters())
            if rank == world - 1:
                assert out.shape == (8, WIDTH) and torch.equal(out, again), (out, again)
            else:
                assert out is None and again is None
        elif case == "losses_replaced":
            sched = Schedule1F1B(PipelineStage(nn.Linear(WIDTH, WIDTH), rank, world), 4, loss_fn=nn.MSELoss())
            losses = ["stale"]
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None, losses=losses)
            assert losses == ["stale"] if rank == 0 else (len(losses) == 4 and "stale" not in losses), losses
        elif case == "torch_csv":
            # torch's own _dump_csv files, both formats, load with torch's compute order
            from torch.distributed.pipelining import PipelineStage as TorchStage
            from torch.distributed.pipelining import schedules as ts

            for cls in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
                        "ScheduleDualPipeV", "ScheduleLoopedBFS"):
                ids = (rank, 2 * world - 1 - rank) if "V" in cls[8:] else (rank, rank + world)
                theirs = getattr(ts, cls)([TorchStage(nn.Linear(WIDTH, WIDTH), s, 2 * world, torch.device("cpu"))
                                           for s in ids], 8, loss_fn=nn.MSELoss())
                for fmt in ("compute_only", "compute_comms"):
                    path = os.path.join(tmp, f"{cls}_{fmt}_{rank}.csv")
                    theirs._dump_csv(path, format=fmt)
                    ours = _PipelineScheduleRuntime([PipelineStage(nn.Linear(WIDTH, WIDTH), s, 2 * world) for s in ids],
                                                    8, loss_fn=nn.MSELoss())
                    ours._load_csv(path, format=fmt)
                    want = {r: [str(a) for a in row if a is not None] for r, row in theirs.pipeline_order.items()}
                    got = {r: [str(a) for a in row] for r, row in ours.pipeline_order.items()}
                    assert got == want, (cls, fmt, got, want)
                    assert type(ours.pipeline_order[0][0]).__module__ == "torch.distributed.pipelining.schedules"
        elif case == "runner_raises":
            # a runner that raises fails the step on every rank; the next step trains as if it never ran
            fail = {"now": True}

            def builder():
                def runner():
                    if fail["now"] and rank == 1:
                        raise RuntimeError("runner failed on purpose")
                return runner
            torch.manual_seed(3)
            mods = {s: nn.Linear(WIDTH, WIDTH) for s in (rank, 2 * world - 1 - rank)}
            fresh = {s: copy.deepcopy(m) for s, m in mods.items()}
            sched = pc.compat.ScheduleZBVZeroBubble([PipelineStage(m, s, 2 * world, dw_builder=builder)
                                                     for s, m in mods.items()], 4, loss_fn=nn.MSELoss())
            again = pc.compat.ScheduleZBVZeroBubble([PipelineStage(m, s, 2 * world, dw_builder=builder)
                                                     for s, m in fresh.items()], 4, loss_fn=nn.MSELoss())
            args = dict(target=y if rank == 0 else None)
            try:
                sched.step(*((x,) if rank == 0 else ()), **args)
                raise AssertionError("the step did not fail")
            except (RuntimeError, pc.errors.PeerFailedError) as exc:
                first = f"{type(exc).__name__}: {exc}"
            fail["now"] = False
            for m in mods.values():
                m.zero_grad()
            sched.step(*((x,) if rank == 0 else ()), **args)
            again.step(*((x,) if rank == 0 else ()), **args)
            assert all(torch.equal(mods[s].weight.grad, fresh[s].weight.grad) for s in mods)
            return "ok", first
        elif case == "builder_cycle_freed":
            # a builder that reaches the schedule that holds it: a cycle Python can collect
            import gc
            import weakref

            holder = {}
            stage = PipelineStage(nn.Linear(WIDTH, WIDTH), rank, world, dw_builder=lambda: holder["sched"] and None)
            holder["sched"] = Schedule1F1B(stage, 4, loss_fn=nn.MSELoss())
            alive = weakref.ref(holder["sched"].pipeline)
            del holder, stage
            gc.collect()
            assert alive() is None, gc.get_referrers(alive())
        elif case == "kwargs_on_later_rank":
            # pc.Pipeline's default gives keyword arguments to first stages only: elsewhere they are refused
            pipe = pc.Pipeline(pc.PipelineStage(nn.Linear(WIDTH, WIDTH), rank, world), "1f1b", 4, loss_fn=nn.MSELoss())
            pipe.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None,
                      **({"scale": torch.ones(8, 1)} if rank == 1 else {}))
        elif case == "keyword_step":
            # a newer torch's (and TorchTitan's) step(arg_mbs=, kwarg_mbs=, target_mbs=): microbatches the caller
            # split, the same gradients and losses as _step_microbatches over them, bit for bit
            # a newer torch's (and TorchTitan's) step(arg_mbs=, kwarg_mbs=, target_mbs=) and eval(...) over the
            # microbatches a batch splits into: the batch form's gradients, losses and eval losses, bit for bit
            last = rank == world - 1
            runs = []
            for form in ("keyword", "batch"):
                torch.manual_seed(1)
                mod = nn.Linear(WIDTH, WIDTH)
                sched = Schedule1F1B(PipelineStage(mod, rank, world), 4, loss_fn=nn.MSELoss())
                losses, eval_losses = ([], []) if last else (None, None)
                if form == "keyword":
                    mbs = {"arg_mbs": [(c,) for c in x.chunk(4)] if rank == 0 else None,
                           "kwarg_mbs": [{} for _ in range(4)],  # TorchTitan passes them on every rank
                           "target_mbs": list(y.chunk(4)) if last else None}
                    out = sched.step(**mbs, losses=losses, return_outputs=False)
                    assert out is None, out
                    outputs = sched.eval(**mbs, losses=eval_losses)
                    outputs = torch.cat(outputs) if last else outputs
                else:
                    batch = {"target": y if last else None}
                    sched.step(*((x,) if rank == 0 else ()), **batch, losses=losses, return_outputs=False)
                    outputs = sched.eval(*((x,) if rank == 0 else ()), **batch, losses=eval_losses)
                runs.append((mod.weight.grad.clone(), [float(v) for v in losses or []],
                             [float(v) for v in eval_losses or []], outputs))
            (g, l, e, o), (g2, l2, e2, o2) = runs
            assert torch.equal(g, g2) and l == l2 and e == e2, runs
            assert (o is None and o2 is None) or torch.equal(o, o2), (o, o2)
            assert not last or (len(l) == 4 and len(e) == 4), runs
            try:
                sched.step(x, arg_mbs=[(x,)])
                raise AssertionError("a batch and its microbatches accepted together")
            except TypeError as exc:
                assert "not both" in str(exc), exc
        elif case == "submod_and_get_mesh":
            # torch's get_mesh= is taken; submod re-points the stage until a schedule holds it (TorchTitan sets
            # it after wrapping each stage's module)
            called = []
            stage = PipelineStage(nn.Linear(WIDTH, WIDTH), rank, world, get_mesh=lambda *a: called.append(a))
            wrapped = nn.Sequential(nn.Linear(WIDTH, WIDTH))
            stage.submod = wrapped
            assert stage.submod is wrapped and stage.module is wrapped
            sched = Schedule1F1B(stage, 4, loss_fn=nn.MSELoss())
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
            assert wrapped[0].weight.grad is not None and not called
            try:
                stage.submod = nn.Linear(WIDTH, WIDTH)
                raise AssertionError("submod re-pointed under a schedule")
            except RuntimeError as exc:
                assert "set submod before building the schedule" in str(exc), exc
            try:
                PipelineStage(nn.Linear(WIDTH, WIDTH), rank, world, get_mesh=3)
                raise AssertionError("a get_mesh that is no callable accepted")
            except TypeError as exc:
                assert "get_mesh must be a callable" in str(exc), exc
        elif case == "dtensor_boundary":
            # a stage returns a DTensor (tensor-parallel activations) to a stage with no mesh of its dimensions
            # and no get_mesh: refused with the fix
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Replicate

            mesh = init_device_mesh("cpu", (world,))

            class ToDTensor(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.lin = nn.Linear(WIDTH, WIDTH)

                def forward(self, h):
                    return DTensor.from_local(self.lin(h), mesh, [Replicate()], run_check=False)

            module = ToDTensor() if rank == 0 else nn.Linear(WIDTH, WIDTH)
            sched = Schedule1F1B(PipelineStage(module, rank, world), 4, loss_fn=nn.MSELoss())
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        elif case == "options":
            # pipecore's own options pass through; torch's defer_pp_recv posts each receive at its action
            for bad, words in (({"group": dist.group.WORLD}, "pass group= to PipelineStage"),
                               ({"timeuot": 3}, "unexpected keyword arguments ['timeuot']")):
                try:
                    ScheduleInterleaved1F1B([PipelineStage(nn.Linear(WIDTH, WIDTH), s, 2 * world)
                                             for s in (rank, rank + world)], 4, **bad)
                    raise AssertionError(f"{bad} accepted")
                except TypeError as exc:
                    assert words in str(exc), exc
            stages = [PipelineStage(nn.Linear(WIDTH, WIDTH), s, 2 * world) for s in (rank, rank + world)]
            sched = ScheduleInterleaved1F1B(stages, 4, loss_fn=nn.MSELoss(), trace=True, defer_pp_recv=True)
            # (and torch 2.15's FSDP2 residency defaults: 3 stages unsharded, all fetched ahead)
            assert sched._pipeline_options == {"trace": True, "recv_window": 0, "max_active_stages": 3,
                                               "unshard_lookahead": 3}, sched._pipeline_options
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
            names = [e["name"] for e in sched.pipeline.trace()]
            assert f"PP:{rank}F0" in names, names
            assert pc.clip_grad_norm_(sched, 1.0) > 0
            sched.scale_grads = False  # torch reads it at every step
            assert sched.pipeline.scale_grads is False
        return "ok", ""
    except Exception as exc:
        return type(exc).__name__, str(exc)


class SplitByMarker(nn.Module):
    """A model cut by torch's pipe_split() marker, for torch's tracing front end."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        from torch.distributed.pipelining import pipe_split

        x = torch.relu(self.a(x))
        pipe_split()
        return self.b(x)


def traced_pipeline(rank, world, api):
    """torch's pipeline() tracer and Pipe.build_stage (re-exported by pipecore.compat) feeding a schedule
    class: torch's traced stage objects are converted."""
    if api == "torch":
        from torch.distributed.pipelining import ScheduleGPipe, pipeline
    else:
        from pipecore.compat import ScheduleGPipe, pipeline
    torch.manual_seed(5)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    stage = pipeline(SplitByMarker(), mb_args=(x[:2],)).build_stage(rank, torch.device("cpu"))
    losses = []
    ScheduleGPipe(stage, 4, loss_fn=nn.MSELoss()).step(*((x,) if rank == 0 else ()),
                                                       target=y if rank == world - 1 else None, losses=losses)
    return [float(v.detach()) for v in losses], {n: p.grad.clone() for n, p in stage.submod.named_parameters()}


def dw_builder_data_parallel(rank, world):
    """dp=2 x pp=2 with dw_builder stages (1F1B and ZBV): each replica steps its half of the batch;
    every gradient equals one process's on the whole batch. Returns the largest relative error."""
    import pipecore as pc

    mesh = pc.init_mesh(dp=2, pp=2)
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    pp_rank, dp_rank = dist.get_rank(pp), dist.get_rank(dp)
    worst = 0.0
    for name, ids in (("1f1b", (pp_rank,)), ("zbv", (pp_rank, 3 - pp_rank))):
        n_stages = 2 * len(ids)
        mods = {s: DwLinear(100 + s) for s in ids}
        stages = [pc.PipelineStage(mods[s], s, n_stages, group=pp, dw_builder=mods[s].dw_builder) for s in ids]
        pipe = pc.Pipeline(stages, name, 4, loss_fn=nn.MSELoss(), dp_group=dp)
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)
        half = slice(8 * dp_rank, 8 * dp_rank + 8)
        pipe.step(*((x[half],) if pipe.has_first else ()), target=y[half] if pipe.has_last else None)
        ref = [DwLinear(100 + s) for s in range(n_stages)]
        h = x
        for mod in ref:
            h = mod(h)
        nn.functional.mse_loss(h, y).backward()
        for mod in ref:
            mod.dw_builder()()
        for s in ids:
            for (n, p), q in zip(mods[s].named_parameters(), ref[s].parameters()):
                worst = max(worst, difference(p.grad, q.grad))
    return worst


def fsdp2_stages(rank, world, schedule_name, steps=2, m=4, options=None):
    """A TorchTitan-style loop with FSDP2 stage modules (dp=2 x pp=world/2), written against torch's
    names and run as it is and with the imports switched to pipecore.compat (no dp_group anywhere:
    the stages' FSDP2 mesh says it). Each side's full gradients per step, per stage."""
    import importlib

    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    from wrapped_stage_cases import WIDTH as W, _full, _mesh, stage_modules

    dp, pp = 2, world // 2
    mesh = _mesh(dp, pp)
    replica, position = divmod(rank, pp)
    results = {}
    for api in ("torch", "pipecore"):
        package = "torch.distributed.pipelining" if api == "torch" else "pipecore.compat"
        PipelineStage = importlib.import_module(package).PipelineStage
        get_schedule_class = importlib.import_module(f"{package}.schedules").get_schedule_class
        cls = get_schedule_class(schedule_name)
        per_rank = 1 if schedule_name in ("1F1B", "GPipe") else 2
        n = pp * per_rank
        model = stage_modules(n)
        ids = [position + k * pp for k in range(per_rank)]
        modules = {s: fully_shard(copy.deepcopy(model[s]), mesh=mesh["dp"]) for s in ids}
        stages = [PipelineStage(modules[s], s, n, torch.device("cpu"), group=mesh.get_group("pp")) for s in ids]
        schedule = cls(stages[0] if per_rank == 1 else stages, n_microbatches=m, loss_fn=F.mse_loss, **(options or {}))
        opt = torch.optim.SGD([p for mod in modules.values() for p in mod.parameters()], lr=0.1)
        grads = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            X, Y = torch.randn(dp * m * 2, W, generator=g), torch.randn(dp * m * 2, W, generator=g)
            x, y = X.chunk(dp)[replica], Y.chunk(dp)[replica]
            first, last = 0 in ids, n - 1 in ids
            schedule.step(*((x,) if first else ()), target=y if last else None)
            grads.append({s: [_full(p.grad).clone() for p in modules[s].parameters()] for s in ids})
            opt.step()
            opt.zero_grad()
        results[api] = grads
        dist.barrier()
    worst = 0.0
    for a, b in zip(results["torch"], results["pipecore"]):
        for s in a:
            worst = max([worst] + [difference(q, p) for p, q in zip(a[s], b[s])])
    return worst
