"""DTensors inside stages (tensor parallelism's buffers and parameters, as TorchTitan's llama3 holds its
rope cache), run on gloo ranks against one process (tests/test_dtensor.py).

DTensor's `torch.equal` reduces every rank's answer over the default group (an all-reduce in DTensor's
dispatch): any helper of pipecore's that compared such tensors entered one collective per tensor, and
pipeline ranks holding different numbers of them (an uneven split) entered different numbers: the ranks
failed or hung."""

from __future__ import annotations

import torch
from torch import nn

import pipecore as pc
from exactness import assert_matches
from models import make_batch

WIDTH, CLASSES = 16, 5


class BufferedBlock(nn.Module):
    """A residual block whose scale is a buffer (a DTensor replicated over `mesh`, or a plain tensor
    without one) and which counts its forwards in another (as batch norm counts its batches)."""

    def __init__(self, seed: int, mesh=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5)
            self.lin.bias.copy_(torch.randn(WIDTH, generator=g) / 10)
        scale, count = 1 + torch.rand(WIDTH, generator=g), torch.zeros(())
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate

            scale, count = (DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in (scale, count))
        self.register_buffer("scale", scale)
        self.register_buffer("count", count)

    def forward(self, x):
        with torch.no_grad():
            self.count.add_(1)
        scale = self.scale.to_local() if hasattr(self.scale, "to_local") else self.scale
        return x + torch.tanh(self.lin(x)) * scale


def staged_model(stage_blocks: list[int], block) -> list[nn.Module]:
    """One nn.Sequential per model stage, stage s holding stage_blocks[s] blocks `block(seed)` (seeds 0, 1,
    ... in model order); the last ends in a head."""
    stages, seed = [], 0
    for s, count in enumerate(stage_blocks):
        layers: list[nn.Module] = []
        for _ in range(count):
            layers.append(block(seed))
            seed += 1
        if s == len(stage_blocks) - 1:
            head = nn.Linear(WIDTH, CLASSES)
            with torch.no_grad():
                g = torch.Generator().manual_seed(1000)
                head.weight.copy_(torch.randn(CLASSES, WIDTH, generator=g) / WIDTH ** 0.5)
                head.bias.zero_()
            layers.append(head)
        stages.append(nn.Sequential(*layers))
    return stages


def dtensor_buffers_in_uneven_stages(rank, world, name, stage_blocks, rows=(8, 12, 12)):
    """Schedule `name` over stages holding different numbers of DTensor buffers, a step per entry of
    `rows`: every gradient and loss as one process computes them (float64), and each forward counted once
    per microbatch (a step whose batch changed shape runs again: the counts its first pass added are put
    back)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    sched = pc.build_schedule(name, world, 4, len(stage_blocks) // world)
    assert sched.num_stages == len(stage_blocks)
    model = staged_model(stage_blocks, lambda seed: BufferedBlock(seed, mesh))
    ref = staged_model(stage_blocks, BufferedBlock)
    mine = [pc.PipelineStage(model[s], s, sched.num_stages) for s in sched.rank_stages(rank)]
    loss_fn = nn.CrossEntropyLoss()
    pipe = pc.Pipeline(mine, sched, 4, loss_fn=loss_fn, timeout=60)
    worst = 0.0
    for step, n in enumerate(rows):
        x, y = make_batch(n, WIDTH, CLASSES, seed=step + 1)
        losses: list = []
        pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None, losses=losses)
        value = x
        for stage in ref:
            value = stage(value)
        loss_fn(value, y).backward()
        for s in mine:
            for (n, p), (_, q) in zip(s.module.named_parameters(), ref[s.stage_index].named_parameters()):
                worst = max(worst, assert_matches(p.grad, q.grad, f"rank {rank} stage {s.stage_index} {n} step {step}"))
                p.grad, q.grad = None, None
        if pipe.has_last:
            assert_matches(torch.stack(losses).mean(), loss_fn(value, y).detach(), f"rank {rank} loss step {step}")
    counts = {int(b.count.to_local()) for s in mine for b in s.module if isinstance(b, BufferedBlock)}
    assert counts == {4 * len(rows)}, counts  # 4 microbatches a step, each forward once
    return worst


def dtensor_buffer_rebound_is_put_back(rank, world):
    """A step that does not count and rebound DTensor buffers, one to another shape, one to another layout
    of the same local shape: the saved ones come back as DTensors of their layouts, with their values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from pipecore.runtime.rollback import Rollback

    mesh = init_device_mesh("cpu", (world,))
    block = BufferedBlock(0, mesh)
    block.register_buffer("rows", DTensor.from_local(torch.arange(3.0) + 3 * rank, mesh, [Shard(0)], run_check=False))
    before = {n: (b.to_local().clone(), b.placements, b.shape) for n, b in block.named_buffers()}
    rollback = Rollback([block], [torch.device("cpu")])
    rollback.arm(learn=True)
    rollback.before_forward()
    block.count.add_(5)  # changed in place
    block.rows = DTensor.from_local(torch.zeros(2), mesh, [Replicate()], run_check=False)  # rebound: other shape
    block.scale = DTensor.from_local(torch.zeros(WIDTH), mesh, [Shard(0)], run_check=False)  # other layout
    rollback.restore()
    for n, b in block.named_buffers():
        local, placements, shape = before[n]
        assert isinstance(b, DTensor) and b.placements == placements and b.shape == shape, (n, b)
        assert torch.equal(b.to_local(), local), (n, b.to_local(), local)
    return True


class TPBlock(nn.Module):
    """A residual MLP block, tensor-parallel when given a mesh: its first Linear column-wise, its second
    row-wise (Megatron's split, torch's ColwiseParallel/RowwiseParallel), so its weights' gradients are
    DTensors sharded over the TP mesh and what it returns is a plain tensor."""

    def __init__(self, seed: int, tp_mesh=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        with torch.no_grad():
            for lin in (self.up, self.down):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.in_features ** 0.5)
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) / 10)
        if tp_mesh is not None:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def clipped_tensor_parallel_gradients(rank, world, name, stage_blocks, max_norm_ratio=0.5):
    """TP=2 x PP=world/2: pc.clip_grad_norm_ over stages whose weights are TP-sharded DTensors returns one
    process's norm on every rank and scales every gradient as one process's clipping does."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pp", "tp"))
    pp_group, pp_rank = mesh["pp"].get_group(), mesh["pp"].get_local_rank()
    sched = pc.build_schedule(name, world // 2, 4, len(stage_blocks) // (world // 2))
    model = staged_model(stage_blocks, lambda seed: TPBlock(seed, mesh["tp"]))
    ref = staged_model(stage_blocks, TPBlock)
    mine = [pc.PipelineStage(model[s], s, sched.num_stages, group=pp_group) for s in sched.rank_stages(pp_rank)]
    loss_fn = nn.CrossEntropyLoss()
    pipe = pc.Pipeline(mine, sched, 4, loss_fn=loss_fn, group=pp_group, timeout=60)
    x, y = make_batch(8, WIDTH, CLASSES, seed=1)
    pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
    value = x
    for stage in ref:
        value = stage(value)
    loss_fn(value, y).backward()
    ref_params = [p for stage in ref for p in stage.parameters()]
    whole = torch.nn.utils.get_total_norm([p.grad for p in ref_params])
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm_ratio * float(whole))
    norm = pc.clip_grad_norm_(pipe, max_norm_ratio * float(whole))
    assert_matches(torch.as_tensor(norm).reshape(()), ref_norm, f"rank {rank}: the gradients' norm")
    for s in mine:
        for (n, p), (_, q) in zip(s.module.named_parameters(), ref[s.stage_index].named_parameters()):
            got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            assert_matches(got, q.grad, f"rank {rank} stage {s.stage_index} {n} after clipping")
    return float(norm)


def sharded_gradient_norms(rank, world):
    """The global norm's share that clipping computes (`stages_norm_part`) for gradients of every layout a
    tensor-parallel or FSDP2 stage gives, on a dp=2 x tp=2 mesh, against the norm of the whole tensors:
    TP-sharded (Shard(0), Shard(1), uneven, a shard of no entries), replicated on one mesh dimension and
    sharded on the other, FSDP2 over TP (fully_shard of a ColwiseParallel Linear: _StridedShard, which is no
    Shard), and Partial (unreduced sums). Norms 2, 1 and inf."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from pipecore.executor.comm import Comm
    from pipecore.training.clipping import stages_norm_part

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(6, 4, generator=g), torch.randn(5, 3, generator=g), torch.randn(3, generator=g),
            torch.randn(1, generator=g), torch.randn(4, 6, generator=g)]
    grads = [distribute_tensor(full[0], mesh["tp"], [Shard(0)]), distribute_tensor(full[1], mesh["tp"], [Shard(1)]),
             distribute_tensor(full[2], mesh["tp"], [Shard(0)]),  # uneven: 2 and 1 entries
             distribute_tensor(full[3], mesh["tp"], [Shard(0)]),  # one rank holds no entry
             distribute_tensor(full[4], mesh, [Replicate(), Shard(1)])]
    lin = nn.Linear(4, 8)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8, 4, generator=g))
        full.append(lin.weight.detach().clone())
    parallelize_module(lin, mesh["tp"], ColwiseParallel())
    fully_shard(lin, mesh=mesh["dp"])
    strided = lin.weight.detach()
    assert not any(p.is_replicate() or p.is_shard() for p in strided.placements[:1]), strided.placements
    grads.append(strided)
    partial_full = torch.randn(2, 3, generator=g)
    full.append(partial_full)  # the sum of the ranks' parts below
    tp_rank = mesh["tp"].get_local_rank()
    part = partial_full * (0.25 if tp_rank == 0 else 0.75)
    grads.append(DTensor.from_local(part, mesh["tp"], [Partial()], run_check=False))
    comm = Comm(torch.distributed.group.WORLD, 60.0, torch.device("cpu"))
    worst = 0.0
    for norm_type in (2.0, 1.0, float("inf")):
        got = stages_norm_part(grads, norm_type, comm)
        norms = torch.stack([torch.linalg.vector_norm(t.double(), norm_type) for t in full])
        want = norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()
        worst = max(worst, assert_matches(got, want, f"rank {rank}: the norm's share of order {norm_type}"))
    return worst


class DTensorBlock(nn.Module):
    """A residual MLP block whose input and output are DTensors on the TP mesh, laid out as `layout`
    (Replicate, or Shard(0): sequence parallel's split of the rows), as TorchTitan's DTensor TP backends
    hand activations from block to block: what crosses a stage boundary is a DTensor. Without a mesh, the
    same arithmetic on plain tensors (one process's reference)."""

    def __init__(self, seed: int, tp_mesh=None, layout: str = "replicate"):
        super().__init__()
        self.inner = TPBlock(seed)
        self.tp_mesh, self.layout = tp_mesh, layout
        if tp_mesh is not None:
            from torch.distributed.tensor import Replicate, Shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            between = Shard(0) if layout == "shard" else Replicate()
            parallelize_module(self.inner, tp_mesh, {
                "up": ColwiseParallel(input_layouts=between, use_local_output=False),
                "down": RowwiseParallel(output_layouts=between, use_local_output=False)})

    def forward(self, x):
        if self.tp_mesh is None:
            return self.inner(x)
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not isinstance(x, DTensor):  # the first block: the batch as every TP rank has it
            x = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
            if self.layout == "shard":
                x = x.redistribute(self.tp_mesh, [Shard(0)])
        return self.inner(x)


class FullHead(nn.Module):
    """The head of a DTensor model: its input gathered into a plain tensor first."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, x):
        return self.head(x.full_tensor() if hasattr(x, "full_tensor") else x)


def dtensor_activations_cross_stages(rank, world, name, stage_blocks, layout, messages="default", tie=False):
    """TP=2 x PP=world/2: stages hand DTensor activations (`layout`) to each other; the losses and every
    gradient (gathered) match one process, on two batch shapes (the second learnt in its first step).
    `messages`: how they travel (pipeline_cases.set_messages; "device": the NCCL path's protocol on its CPU
    model). `tie`: the first and the last stage's first blocks share their column-parallel weight (a
    DTensor sharded over the TP mesh), one Parameter in the reference."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline_cases import set_messages

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pp", "tp"))
    pp_group, pp_rank = mesh["pp"].get_group(), mesh["pp"].get_local_rank()
    R = world // 2
    sched = pc.build_schedule(name, R, 4, len(stage_blocks) // R)
    model = staged_model(stage_blocks, lambda seed: DTensorBlock(seed, mesh["tp"], layout))
    model[-1][-1] = FullHead(model[-1][-1])
    ref = staged_model(stage_blocks, DTensorBlock)
    last = len(stage_blocks) - 1
    if tie:
        ref[last][0].inner.up.weight = ref[0][0].inner.up.weight
    ties = {0: {"up": model[0][0].inner.up.weight}, last: {"up": model[last][0].inner.up.weight}} if tie else {}
    mine = [pc.PipelineStage(model[s], s, sched.num_stages, group=pp_group, tied=ties.get(s, {}))
            for s in sched.rank_stages(pp_rank)]
    loss_fn = nn.CrossEntropyLoss()
    pipe = pc.Pipeline(mine, sched, 4, loss_fn=loss_fn, group=pp_group, timeout=60)
    set_messages(pipe, messages)
    worst = 0.0
    for rows in (8, 16, 8):
        x, y = make_batch(rows, WIDTH, CLASSES, seed=rows)
        for s in mine:
            s.module.zero_grad(set_to_none=True)
        for r in ref:
            r.zero_grad(set_to_none=True)
        losses = []
        pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None, losses=losses)
        value = x
        for stage in ref:
            value = stage(value)
        loss = loss_fn(value, y)
        loss.backward()
        if pipe.has_last:
            assert_matches(sum(losses) / len(losses), loss, f"rank {rank}: the loss of {rows} rows")
        for s in mine:
            for (n, p), (_, q) in zip(s.module.named_parameters(), ref[s.stage_index].named_parameters()):
                got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                worst = max(worst, assert_matches(got, q.grad, f"rank {rank} stage {s.stage_index} {n}, {rows} rows") or 0.0)
    return worst


def dtensor_to_a_stage_without_its_mesh(rank, world):
    """TP=2 x PP=2: stage 0 returns a DTensor, stage 1 (a plain Linear, no get_mesh) has no TP mesh. Each
    rank's error: (its type, its text with its notes)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp_group, pp_rank = mesh["pp"].get_group(), mesh["pp"].get_local_rank()
    module = DTensorBlock(0, mesh["tp"]) if pp_rank == 0 else nn.Sequential(FullHead(nn.Linear(WIDTH, CLASSES)))
    pipe = pc.Pipeline([pc.PipelineStage(module, pp_rank, 2, group=pp_group)], "1f1b", 2, loss_fn=nn.CrossEntropyLoss(),
                       group=pp_group, timeout=60)
    x, y = make_batch(4, WIDTH, CLASSES, seed=1)
    try:
        pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
    except Exception as exc:  # noqa: BLE001 - what each rank says
        return type(exc).__name__, "\n".join([str(exc), *getattr(exc, "__notes__", [])])
    return "ok", ""


def dtensor_microbatches_of_their_own_shapes(rank, world, name, stage_blocks, rows):
    """TP=2 x PP=2, sequence-parallel activations (Shard(0) over the TP mesh), step_microbatches with
    microbatches of `rows` rows each (new at every step: their shapes travel in the messages), two steps:
    every gradient matches one process's (each microbatch's loss weighted by its share of the rows, as
    the pipeline weighs it). An odd row count cannot be split evenly over the TP mesh: refused."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pp", "tp"))
    pp_group, pp_rank = mesh["pp"].get_group(), mesh["pp"].get_local_rank()
    R = world // 2
    sched = pc.build_schedule(name, R, len(rows[0]), len(stage_blocks) // R)
    model = staged_model(stage_blocks, lambda seed: DTensorBlock(seed, mesh["tp"], "shard"))
    model[-1][-1] = FullHead(model[-1][-1])
    ref = staged_model(stage_blocks, DTensorBlock)
    mine = [pc.PipelineStage(model[s], s, sched.num_stages, group=pp_group) for s in sched.rank_stages(pp_rank)]
    loss_fn = nn.CrossEntropyLoss()
    pipe = pc.Pipeline(mine, sched, len(rows[0]), loss_fn=loss_fn, group=pp_group, timeout=60)
    for step, sizes in enumerate(rows):
        x, y = make_batch(sum(sizes), WIDTH, CLASSES, seed=step)
        xs, ys = list(x.split(sizes)), list(y.split(sizes))
        for s in mine:
            s.module.zero_grad(set_to_none=True)
        for r in ref:
            r.zero_grad(set_to_none=True)
        try:
            pipe.step_microbatches([(t,) for t in xs] if pipe.has_first else None,
                                   target_mbs=ys if pipe.has_last else None)
        except (pc.InputError, pc.PeerFailedError) as exc:
            return f"step {step}: {type(exc).__name__}: {exc}"
        total = sum(sizes)
        for xm, ym in zip(xs, ys):
            value = xm
            for stage in ref:
                value = stage(value)
            (loss_fn(value, ym) * (len(ym) / total)).backward()
        for s in mine:
            for (n, p), (_, q) in zip(s.module.named_parameters(), ref[s.stage_index].named_parameters()):
                got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                assert_matches(got, q.grad, f"rank {rank} stage {s.stage_index} {n}, step {step}")
    return "ok"


def tensor_parallel_checkpoint_is_refused(rank, world, path):
    """TP=2 x PP=2: pc.save_checkpoint and load_checkpoint of stages whose parameters are sharded over the
    TP mesh (ranks of the other pipeline too) are refused on every rank, nothing written. Each rank's
    (type, text) of both."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp_group, pp_rank = mesh["pp"].get_group(), mesh["pp"].get_local_rank()
    model = staged_model([1, 1], lambda seed: DTensorBlock(seed, mesh["tp"]))
    model[-1][-1] = FullHead(model[-1][-1])
    pipe = pc.Pipeline([pc.PipelineStage(model[pp_rank], pp_rank, 2, group=pp_group)], "1f1b", 2,
                       loss_fn=nn.CrossEntropyLoss(), group=pp_group, timeout=60)
    said = []
    for call in (pc.save_checkpoint, pc.load_checkpoint):
        try:
            call(path, pipe)
            said.append(("ok", ""))
        except Exception as exc:  # noqa: BLE001 - what each rank says
            said.append((type(exc).__name__, str(exc)))
    return said, os.path.exists(path) and bool(os.listdir(path))
