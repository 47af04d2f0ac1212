"""Cases run on every rank: the first step of a batch shape follows what the model really does
(values, autocast, FSDP2, torch.compile, RNG and module state), and configuration slips fail at once."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn

import pipecore as pc
from models import NEVER, make_batch, pipeline_step
from pipecore.stage.boundary import as_call
from exactness import assert_matches, default_dtype, rounding_bound
from reliability_cases import _outcome

WIDTH, CLASSES = 16, 5


class CountingStage(nn.Module):
    """Returns non-tensor values beside its activations: a count of its forwards, a float and a
    bool that change with it, and None; the next stage's output depends on all of them."""

    def __init__(self, last: bool, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(WIDTH, CLASSES if last else WIDTH)
        self.last = last
        self.calls = 0

    def forward(self, h, count=0, extra=None):
        self.calls += 1
        if extra is not None:
            assert extra["none"] is None
            h = h * extra["scale"] + (1.0 if extra["odd"] else 0.0)
        h = self.fc(torch.tanh(h)) * (1.0 + 0.01 * count)
        if self.last:
            return h
        return h, count + self.calls, {"scale": 1.0 + 0.1 * self.calls, "odd": self.calls % 2 == 1, "none": None}


class DropoutStage(nn.Module):
    """Dropout (RNG), batch norm (running statistics) and a forward counter (Python state)."""

    def __init__(self, last: bool, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.fc = nn.Linear(WIDTH, CLASSES if last else WIDTH)
        self.drop = nn.Dropout(0.3)
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        return self.fc(self.drop(torch.relu(self.norm(h))))


class AutocastStage(nn.Module):
    def __init__(self, last: bool, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, CLASSES if last else WIDTH)

    def forward(self, h):
        return self.fc2(torch.relu(self.fc1(h)))  # bf16 under CPU autocast


def _stages(cls, n):
    return [cls(i == n - 1, seed=100 + i) for i in range(n)]


def _per_microbatch_reference(ref, x, y, m, loss_fn=nn.CrossEntropyLoss(), rng_states=None):
    """Single-process training of the same stages, one microbatch after another (each loss weighted
    by its share of the rows, as Pipeline.step scales). `rng_states[i]`: stage i draws from its own
    RNG stream (as on its own rank)."""
    losses = []
    for xc, yc in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
        args, kwargs = (xc,), {}
        for i, stage in enumerate(ref):
            if rng_states is not None:
                torch.set_rng_state(rng_states[i])
            out = stage(*args, **kwargs)
            if rng_states is not None:
                rng_states[i] = torch.get_rng_state()
            args, kwargs = as_call(out)
        loss = loss_fn(out, yc)
        (loss * (len(yc) / len(y))).backward()
        losses.append(loss.detach())
    return losses


def _compare(pipe, ref, losses, ref_losses, what, bound=None):
    topo = pipe.schedule.topology
    for s in pipe.stages:
        for (n, p), q in zip(s.module.named_parameters(), ref[topo.model_stage[s.stage_index]].parameters()):
            assert_matches(p.grad, q.grad, f"{what} stage {s.stage_index} {n}", bound)
    if pipe.has_last:
        for mb, (a, b) in enumerate(zip(losses, ref_losses)):
            assert_matches(a, b, f"{what} loss of microbatch {mb}", bound)


def values_reach_the_next_stage(rank, world, name, V, m):
    """Ints, floats, bools and None returned by a stage reach the next one as returned, per
    microbatch and per step (the counts grow every forward); training equals one process."""
    sched = pc.build_schedule(name, world, m, V)
    model = _stages(CountingStage, sched.num_stages)
    ref = copy.deepcopy(model)
    mine = [pc.PipelineStage(copy.deepcopy(model[s]), s, sched.num_stages) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(mine, sched, m, loss_fn=nn.CrossEntropyLoss(), timeout=60)
    for step in range(3):
        x, y = make_batch(2 * m, seed=step)
        losses: list = []
        pipeline_step(pipe, x, y, losses=losses)
        ref_losses = _per_microbatch_reference(ref, x, y, m)
        _compare(pipe, ref, losses, ref_losses, f"rank {rank} step {step}")
        for p in [p for s in mine for p in s.module.parameters()] + [p for s in ref for p in s.parameters()]:
            p.grad = None
    return [s.module.calls for s in mine]


def autocast_bf16(rank, world, name, V, m):
    """Stages whose outputs are bf16 under torch.autocast("cpu", torch.bfloat16) train as one process
    under the same autocast does, one microbatch after another: fp32 weights, as autocast needs (it
    leaves float64 alone). Each kernel sees the shapes it sees in the pipeline, so bf16 rounds alike;
    what is left is fp32's sum of the m microbatches' gradients in the schedule's order."""
    sched = pc.build_schedule(name, world, m, V)
    with default_dtype(torch.float32):
        model = _stages(AutocastStage, sched.num_stages)
        x, y = make_batch(2 * m)
    ref = copy.deepcopy(model)
    mine = [pc.PipelineStage(copy.deepcopy(model[s]), s, sched.num_stages) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(mine, sched, m, loss_fn=nn.CrossEntropyLoss(), timeout=60)
    losses: list = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipeline_step(pipe, x, y, losses=losses)
        ref_losses = _per_microbatch_reference(ref, x, y, m)
    _compare(pipe, ref, losses, ref_losses, f"rank {rank}", rounding_bound(torch.float32, m))
    sent = {str(b.tensors[0].dtype) for p in pipe.plans.kept() for st in p.values() for b in st.outputs.values()}
    return sorted(sent), None if out is None else str(out.dtype)


def state_and_rng(rank, world, name, m):
    """The first step runs every forward once: dropout masks drawn from each rank's RNG as single-process
    training of the same stages draws them, batch-norm statistics and a Python forward counter moved
    once per microbatch."""
    sched = pc.build_schedule(name, world, m)
    model = _stages(DropoutStage, world)
    ref = copy.deepcopy(model)
    mine = [pc.PipelineStage(copy.deepcopy(model[rank]), rank, world)]
    pipe = pc.Pipeline(mine, sched, m, loss_fn=nn.CrossEntropyLoss(), timeout=60)
    rng = [torch.manual_seed(1000 + r).get_state() for r in range(world)]  # rank r's stream
    torch.manual_seed(1000 + rank)
    x, y = make_batch(4 * m)
    losses: list = []
    pipeline_step(pipe, x, y, losses=losses)
    after = torch.get_rng_state()
    ref_losses = _per_microbatch_reference(ref, x, y, m, rng_states=rng)
    _compare(pipe, ref, losses, ref_losses, f"rank {rank}")
    mod, ref_mod = mine[0].module, ref[rank]
    torch.testing.assert_close(mod.norm.running_mean, ref_mod.norm.running_mean, rtol=0, atol=0)
    assert int(mod.norm.num_batches_tracked) == m, int(mod.norm.num_batches_tracked)
    assert torch.equal(after, rng[rank]), "the step drew another amount of random numbers"
    return mod.calls


def fsdp2_stages(rank, world, m):
    """Each stage is an FSDP2 module (fully_shard over a one-rank mesh): its parameters are DTensors,
    unsharded by FSDP's own hooks in the step's forwards; training equals one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    sched = pc.build_schedule("1f1b", world, m)
    model = _stages(AutocastStage, world)
    ref = copy.deepcopy(model)
    module = copy.deepcopy(model[rank])
    fully_shard(module, mesh=mesh["dp"])
    pipe = pc.Pipeline([pc.PipelineStage(module, rank, world)], sched, m, loss_fn=nn.CrossEntropyLoss(), timeout=60)
    x, y = make_batch(2 * m)
    losses: list = []
    pipeline_step(pipe, x, y, losses=losses)
    ref_losses = _per_microbatch_reference(ref, x, y, m)
    for (n, p), q in zip(module.named_parameters(), ref[rank].parameters()):
        assert type(p).__name__ == "DTensor", (n, type(p))
        assert_matches(p.grad.full_tensor(), q.grad, f"rank {rank} {n}")
    if pipe.has_last:
        for a, b in zip(losses, ref_losses):
            assert_matches(a, b, f"rank {rank} loss")
    return True


def compiled_stage(rank, world, m, workdir):
    """A stage that calls a torch.compile'd block: compiled on the step's real tensors only (never
    on meta tensors), no files left in the working directory, training equal to one process."""
    import torch._dynamo

    torch._dynamo.reset()
    seen: list[str] = []

    def recording_backend(gm, example_inputs):
        seen.extend(sorted({str(t.device) for t in example_inputs if isinstance(t, torch.Tensor)}))
        return gm.forward

    class Compiled(nn.Module):
        def __init__(self, last, seed):
            super().__init__()
            self.block = AutocastStage(last, seed)
            self.fast = torch.compile(self.block, backend=recording_backend)

        def forward(self, h):
            return self.fast(h)

    sched = pc.build_schedule("1f1b", world, m)
    model = _stages(AutocastStage, world)
    ref = copy.deepcopy(model)
    module = Compiled(rank == world - 1, 100 + rank)
    module.block.load_state_dict(model[rank].state_dict())
    pipe = pc.Pipeline([pc.PipelineStage(module, rank, world)], sched, m, loss_fn=nn.CrossEntropyLoss(), timeout=60)
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        x, y = make_batch(2 * m)
        losses: list = []
        pipeline_step(pipe, x, y, losses=losses)
    finally:
        os.chdir(cwd)
    ref_losses = _per_microbatch_reference(ref, x, y, m)
    for (n, p), q in zip(module.block.named_parameters(), ref[rank].parameters()):
        assert_matches(p.grad, q.grad, f"rank {rank} {n}")
    if pipe.has_last:
        for a, b in zip(losses, ref_losses):
            assert_matches(a, b, f"rank {rank} loss")
    return sorted(set(seen))


# -- configuration slips: every rank fails at once with words that say what differs --------------------
def slipped_configuration(rank, world, slip):
    """Ranks built with different pipelines (`slip`), a stage returning None, ("mode") rank 1
    calling eval() where rank 0 calls step(), or ("computed_input") an input with a graph."""
    n, m, name, V = world, 4, "1f1b", 1
    if slip == "schedule" and rank == 1:
        name = "gpipe"
    if slip == "microbatches" and rank == 1:
        m = 8
    if slip == "stages":
        name, V = "interleaved_1f1b", (3 if rank == 1 else 2)
    sched = pc.build_schedule(name, world, m, V)
    n = sched.num_stages
    model = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)]

    class ReturnsNothing(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, h):
            self.inner(h)  # a forgotten `return`

    if slip == "none":
        model[0] = ReturnsNothing(model[0])
    x = torch.randn(2 * m, WIDTH)
    if slip == "computed_input":  # an embedding computed outside the pipeline, with its graph
        x = nn.Linear(WIDTH, WIDTH)(x)
    mine = [pc.PipelineStage(model[s], s, n) for s in sched.rank_stages(rank)]
    loss = lambda out, t: out.pow(2).mean()  # noqa: E731
    pipe = pc.Pipeline(mine, sched, m, loss_fn=loss, timeout=NEVER)  # what arrives was sent
    call = pipe.eval if slip == "mode" and rank == 1 else pipe.step
    run = lambda: call(*((x,) if pipe.has_first else ()), target=x if pipe.has_last else None)  # noqa: E731
    outcome = _outcome(run)
    again = _outcome(run) if slip not in ("none", "computed_input") else None  # a misbuilt Pipeline says so at every step
    dist.barrier()
    return outcome, again


