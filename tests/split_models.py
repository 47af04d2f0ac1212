"""Stage modules whose backward a naive I/W split runs twice, and a case that trains them under a
pipeline against one process: gradients, `main_grad`, and how often each Function, hook and
checkpoint recomputation ran.

Each kind is a block used in every stage (the last stage adds a head):
- grad_function: DeepSeek's DualPipe example Function, which adds its weight gradient into
  `weight.grad` inside backward;
- main_grad_function: a Megatron-style fused linear that accumulates into `weight.main_grad`;
- deferred_function: the same work handed to pipecore.defer_weight_grad (splits cleanly);
- tensor_hooks: a scaling hook on a Linear's output (a split node), retain_grad, and hooks on a
  parameter (a scaling tensor hook and a post-accumulate hook);
- checkpoint / reentrant_checkpoint: torch.utils.checkpoint around two Linears;
- compiled: a torch.compile'd block (aot_eager: AOTAutograd's backward, as inductor's, donates
  buffers and runs once);
- shared_weight / stacked_experts: a parameter under two split points (a Linear applied twice;
  experts stacked in one parameter and indexed).
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pipecore as pc

WIDTH, CLASSES = 8, 3
COUNTS: Counter = Counter()  # per process: how often each piece of user code ran


def _mm_weight_grad(grad_out, x):
    return grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class _LinearFunc(torch.autograd.Function):
    """x @ weight.t(); subclasses differ in what their backward does with the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()


class GradLinearFunc(_LinearFunc):
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        COUNTS["function backward"] += 1
        grad_w = _mm_weight_grad(grad_out, x)
        if weight.grad is None:
            weight.grad = grad_w
        else:
            weight.grad += grad_w
        return grad_out @ weight, None


class MainGradLinearFunc(_LinearFunc):
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        COUNTS["function backward"] += 1
        weight.main_grad.add_(_mm_weight_grad(grad_out, x))
        return grad_out @ weight, None


class DeferredLinearFunc(_LinearFunc):
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        COUNTS["function backward"] += 1

        def weight_grad():
            COUNTS["deferred closure"] += 1
            weight.main_grad.add_(_mm_weight_grad(grad_out, x))

        pc.defer_weight_grad(weight_grad)
        return grad_out @ weight, None


class FunctionBlock(nn.Module):
    def __init__(self, fn, main_grad):
        super().__init__()
        self.fn = fn
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH ** 0.5)
        self.bias = nn.Parameter(torch.zeros(WIDTH))  # an ordinary parameter beside the Function's
        if main_grad:
            self.weight.main_grad = torch.zeros(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.fn.apply(x, self.weight) + self.bias)


class HookedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.fc.weight.register_hook(self._weight_hook)
        self.out.weight.register_post_accumulate_grad_hook(self._post_accumulate)

    @staticmethod
    def _weight_hook(grad):
        COUNTS["parameter hook"] += 1
        return grad * 2.0

    @staticmethod
    def _post_accumulate(param):
        COUNTS["post-accumulate hook"] += 1

    @staticmethod
    def _output_hook(grad):
        COUNTS["tensor hook"] += 1
        return grad * 0.5

    def forward(self, x):
        h = self.fc(x)  # its grad_fn (addmm) is where I and W split
        if h.requires_grad:
            h.register_hook(self._output_hook)
            h.retain_grad()
        return self.out(torch.tanh(h))


class CheckpointBlock(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.pre = nn.Linear(WIDTH, WIDTH)  # the checkpoint's input needs a gradient on the first stage too
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.reentrant = reentrant

    def region(self, x):
        if not x.is_meta:
            COUNTS["checkpointed forward"] += 1
        return self.b(torch.tanh(self.a(x)))

    def forward(self, x):
        return torch.tanh(checkpoint(self.region, torch.tanh(self.pre(x)), use_reentrant=self.reentrant))


class CompiledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.block = torch.compile(block, backend="aot_eager")
        self.after = nn.Linear(WIDTH, WIDTH)  # an eager split point beside the compiled graph

    def forward(self, x):
        return torch.tanh(self.after(self.block(x)))


class SharedWeightBlock(nn.Module):
    """ALBERT-style: one Linear applied twice (its parameters under two split points), beside an
    ordinary Linear whose weight gradient still waits for W."""

    def __init__(self):
        super().__init__()
        self.shared, self.other = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.other(torch.tanh(self.shared(torch.tanh(self.shared(x)))))  # residual: no vanishing


class StackedExpertsBlock(nn.Module):
    """Two experts' weights stacked in one parameter and indexed per expert (grouped-GEMM layout)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.Parameter(torch.randn(2, WIDTH, WIDTH) / WIDTH ** 0.5)
        self.gate = nn.Linear(WIDTH, 2, bias=False)  # a softmax-gate bias gradient is a cancellation

    def forward(self, x):
        p = torch.softmax(self.gate(x), -1)
        return torch.tanh(p[..., :1] * (x @ self.experts[0]) + p[..., 1:] * (x @ self.experts[1]))


KINDS = {  # kind -> (block factory, the fallback it must report: (node, why) or None)
    "grad_function": (lambda: FunctionBlock(GradLinearFunc, False), ("GradLinearFuncBackward", "python_function")),
    "main_grad_function": (lambda: FunctionBlock(MainGradLinearFunc, True),
                           ("MainGradLinearFuncBackward", "python_function")),
    "deferred_function": (lambda: FunctionBlock(DeferredLinearFunc, True), None),
    "tensor_hooks": (HookedBlock, ("AddmmBackward0", "hooks")),
    "checkpoint": (lambda: CheckpointBlock(False), ("AddmmBackward0", "saved_tensor_hooks")),
    "reentrant_checkpoint": (lambda: CheckpointBlock(True), ("CheckpointFunctionBackward", "reentrant_checkpoint")),
    "compiled": (CompiledBlock, ("CompiledFunctionBackward", "compiled_graph")),
    "shared_weight": (SharedWeightBlock, ("parameter shared.weight (shape [8, 8])", "shared_parameter")),
    "stacked_experts": (StackedExpertsBlock, ("parameter experts (shape [2, 8, 8])", "shared_parameter")),
}


def make_model(kind: str, num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    block = KINDS[kind][0]
    stages = [block() for _ in range(num_stages)]
    stages[-1] = nn.Sequential(stages[-1], nn.Linear(WIDTH, CLASSES))
    return stages


def _main_grads(module):
    return {n: p.main_grad.clone() for n, p in module.named_parameters() if hasattr(p, "main_grad")}


def train_split_model(rank, world, name, kind, m):
    """One step of `kind` under `name` against one process. Checks every .grad here and returns what
    needs all ranks: main_grad per (model stage, parameter), how often user code ran on this rank
    (and in the reference, which runs the whole model), and this rank's fallbacks."""
    sched = pc.build_schedule(name, world, m, 2)
    topo = sched.topology
    n_model = world if topo.style == "dualpipe" else topo.num_stages
    # built twice from one seed (hooks and compiled blocks do not survive a deepcopy); a rank never
    # holds two copies of one model stage, dualpipe's mirrors included
    model, ref = make_model(kind, n_model), make_model(kind, n_model)
    mine = [pc.PipelineStage(model[topo.model_stage[s]], s, sched.num_stages) for s in sched.rank_stages(rank)]
    loss_fn = nn.CrossEntropyLoss()
    pipe = pc.Pipeline(mine, sched, m, loss_fn=loss_fn, timeout=60)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(3 * m + 1, WIDTH, generator=g), torch.randint(0, CLASSES, (3 * m + 1,), generator=g)
    COUNTS.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
        pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)  # warns once
    counts = dict(COUNTS)
    for _ in range(2):
        loss_fn(_reference_forward(ref, x), y).backward()
    # how often user code runs in single-process training of the same microbatches
    COUNTS.clear()
    per_microbatch = make_model(kind, n_model)
    for _ in range(2):
        for xc, yc in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
            loss_fn(_reference_forward(per_microbatch, xc), yc).backward()
    ref_counts = dict(COUNTS)
    for s in mine:
        for (n, p), q in zip(s.module.named_parameters(), ref[topo.model_stage[s.stage_index]].parameters()):
            _assert_close(p.grad, q.grad, f"rank {rank} stage {s.stage_index} {n}")
    warned = [str(w.message) for w in caught if "pipecore: stage" in str(w.message)]
    return {
        "counts": counts,
        "ref_counts": ref_counts,
        "main_grads": {(topo.model_stage[s.stage_index], n): t for s in mine for n, t in _main_grads(s.module).items()},
        "ref_main_grads": {(i, n): t for i, st in enumerate(ref) for n, t in _main_grads(st).items()},
        "fallbacks": pipe.split_backward_fallbacks,
        "warnings": warned,
        # stages here whose I has inputs to differentiate (a first stage's I has no split points)
        "split_stages": sorted({a.stage for a in sched.lower().actions[rank]
                                if a.kind is pc.Kind.I and topo.prev_stage[a.stage] >= 0}),
    }


def _reference_forward(stages, x):
    for st in stages:
        x = st(x)
    return x


def _assert_close(got, want, what, rtol=1e-6):
    if want is None:
        assert got is None or torch.count_nonzero(got) == 0, f"{what}: expected no gradient"
        return
    assert got is not None, f"{what}: gradient missing"
    err = (got - want).abs().max().item()
    assert err <= rtol * want.abs().max().item() + 1e-12, f"{what}: max abs error {err:.3e}"


def shared_parameter_falls_back_alone(rank, world):
    """Stage 1 (inputs that need a gradient) holds a Linear used twice beside another Linear: the
    shared Linear's weight gradients are computed at I, the other's still wait for W; all equal a
    full backward."""
    torch.manual_seed(0)
    first, block = nn.Linear(WIDTH, WIDTH), SharedWeightBlock()
    ref = [nn.Linear(WIDTH, WIDTH), SharedWeightBlock()]
    ref[0].load_state_dict(first.state_dict())
    ref[1].load_state_dict(block.state_dict())
    sched = pc.Schedule([["0F0", "1F0", "1I0", "0F1", "1F1", "1W0", "1I1", "1W1", "0B0", "0B1"]])
    seen_at_f = []
    block.register_forward_pre_hook(lambda mod, args: seen_at_f.append(
        {n: p.grad is not None for n, p in mod.named_parameters()}))
    pipe = pc.Pipeline([pc.PipelineStage(first, 0, 2), pc.PipelineStage(block, 1, 2)], sched, 2,
                       loss_fn=lambda out: out.pow(2).mean())
    x = torch.randn(6, WIDTH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.step(x)
    # 1F1 runs after 1I0, before 1W0
    assert seen_at_f[1] == {"shared.weight": True, "shared.bias": True, "other.weight": False, "other.bias": False}, \
        seen_at_f
    ref[1](ref[0](x)).pow(2).mean().backward()
    for mod, want in zip((first, block), ref):
        for (n, p), q in zip(mod.named_parameters(), want.parameters()):
            _assert_close(p.grad, q.grad, n)
    # 1I1 and 1W1 are adjacent and stage 0 is on this rank: merged into one B, not split
    assert pipe.split_backward_fallbacks == {1: {("parameter shared.weight (shape [8, 8])", "shared_parameter"): 1}}
    messages = [str(w.message) for w in caught if "pipecore" in str(w.message)]
    assert len(messages) == 1 and "parameter shared.weight (shape [8, 8])" in messages[0], messages
    return True
