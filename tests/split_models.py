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
  experts stacked in one parameter and indexed), deferred together;
- cpp_function: a C++ autograd Function that accumulates into main_grad;
- parameter_hooks: hooks on a weight whose gradient a Function returns (accumulated at I);
- mixed_shared: a weight used by a Function and by a built-in matmul.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
import weakref
from collections import Counter

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pipecore as pc
from models import reference_forward
from exactness import assert_matches

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


class ReturnsGradLinearFunc(_LinearFunc):
    """The usual custom Function: returns its weight gradient."""

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        COUNTS["function backward"] += 1
        return grad_out @ weight, _mm_weight_grad(grad_out, x)


_CPP_FUNCTION = r"""
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>
// A fused linear written as a C++ autograd Function: accumulates its weight gradient into
// main_grad itself (a side effect) and counts its backward calls.
static int64_t backward_calls = 0;
struct CppMainGradLinear : public torch::autograd::Function<CppMainGradLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, at::Tensor weight,
                            at::Tensor main_grad) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["main_grad"] = main_grad;
    return x.matmul(weight.t());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    ++backward_calls;
    auto saved = ctx->get_saved_variables();
    ctx->saved_data["main_grad"].toTensor().add_(grad_out[0].t().matmul(saved[0]));
    return {grad_out[0].matmul(saved[1]), at::Tensor(), at::Tensor()};
  }
};
at::Tensor cpp_main_grad_linear(at::Tensor x, at::Tensor weight, at::Tensor main_grad) {
  return CppMainGradLinear::apply(x, weight, main_grad);
}
int64_t cpp_backward_calls() { return backward_calls; }
"""


def cpp_extension():
    """The C++ Function above, built once per machine (torch caches it) and loaded per process."""
    from jit_extension import load_extension

    return load_extension("pipecore_test_cpp_function", _CPP_FUNCTION, ["cpp_main_grad_linear", "cpp_backward_calls"])


class CppFunction:
    """The C++ Function with the Python Functions' interface (main_grad passed along)."""

    @staticmethod
    def apply(x, weight):
        return cpp_extension().cpp_main_grad_linear(x, weight, weight.main_grad)


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


class ParameterHooksBlock(nn.Module):
    """A Function that returns its weight gradient (computed at I), with a scaling tensor hook and a
    post-accumulate hook on that weight: they run once, where pipecore accumulates it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH ** 0.5)
        self.bias = nn.Parameter(torch.zeros(WIDTH))
        self.weight.register_hook(HookedBlock._weight_hook)
        self.weight.register_post_accumulate_grad_hook(HookedBlock._post_accumulate)

    def forward(self, x):
        return torch.tanh(ReturnsGradLinearFunc.apply(x, self.weight) + self.bias)


class MixedSharedBlock(nn.Module):
    """One weight used by a Function (computed at I) and by a built-in matmul: the matmul's weight
    gradient is computed at I as well, so that the two contributions meet once."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH ** 0.5)

    def forward(self, x):
        return torch.tanh(ReturnsGradLinearFunc.apply(x, self.weight) + 0.5 * torch.tanh(x) @ self.weight.t())


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


KINDS = {  # kind -> (block factory, the fallbacks it must report: {(node, why)})
    "grad_function": (lambda: FunctionBlock(GradLinearFunc, False), {("GradLinearFuncBackward", "python_function")}),
    "main_grad_function": (lambda: FunctionBlock(MainGradLinearFunc, True),
                           {("MainGradLinearFuncBackward", "python_function")}),
    "cpp_function": (lambda: FunctionBlock(CppFunction, True),
                     {("torch::autograd::CppNode<CppMainGradLinear>", "custom_node")}),
    "deferred_function": (lambda: FunctionBlock(DeferredLinearFunc, True), set()),
    "parameter_hooks": (ParameterHooksBlock, {("ReturnsGradLinearFuncBackward", "python_function")}),
    "tensor_hooks": (HookedBlock, {("AddmmBackward0", "hooks")}),
    "checkpoint": (lambda: CheckpointBlock(False), {("AddmmBackward0", "saved_tensor_hooks")}),
    "reentrant_checkpoint": (lambda: CheckpointBlock(True), {("CheckpointFunctionBackward", "reentrant_checkpoint")}),
    "compiled": (CompiledBlock, {("CompiledFunctionBackward", "compiled_graph")}),
    "shared_weight": (SharedWeightBlock, set()),  # shared parameters accumulate once at W
    "stacked_experts": (StackedExpertsBlock, set()),
    "mixed_shared": (MixedSharedBlock, {("ReturnsGradLinearFuncBackward", "python_function"),
                                        ("parameter weight (shape [8, 8])", "shared_parameter")}),
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
    with warnings.catch_warnings(record=True) as caught, _counting_cpp_calls(kind):
        warnings.simplefilter("always")
        pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
        pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)  # warns once
    counts = dict(COUNTS)
    for _ in range(2):
        loss_fn(reference_forward(ref, x), y).backward()
    # how often user code runs in single-process training of the same microbatches
    COUNTS.clear()
    per_microbatch = make_model(kind, n_model)
    with _counting_cpp_calls(kind):
        for _ in range(2):
            for xc, yc in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
                loss_fn(reference_forward(per_microbatch, xc), yc).backward()
    ref_counts = dict(COUNTS)
    for s in mine:
        for (n, p), q in zip(s.module.named_parameters(), ref[topo.model_stage[s.stage_index]].parameters()):
            assert_matches(p.grad, q.grad, f"rank {rank} stage {s.stage_index} {n}")
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


@contextlib.contextmanager
def _counting_cpp_calls(kind):
    """Adds the C++ Function's backward calls made inside the block to COUNTS."""
    before = cpp_extension().cpp_backward_calls() if kind == "cpp_function" else 0
    yield
    if kind == "cpp_function":
        COUNTS["C++ function backward"] += cpp_extension().cpp_backward_calls() - before


def _two_stages(factory, program):
    """Stage 0 (a Linear) and factory() as stage 1 on this one rank, running `program` (so stage 1's
    inputs need a gradient and its backward has split points); the reference is built alike."""
    torch.manual_seed(0)
    first, block = nn.Linear(WIDTH, WIDTH), factory()
    torch.manual_seed(0)
    ref = [nn.Linear(WIDTH, WIDTH), factory()]
    pipe = pc.Pipeline([pc.PipelineStage(first, 0, 2), pc.PipelineStage(block, 1, 2)], pc.Schedule([program]), 2,
                       loss_fn=lambda out: out.pow(2).mean())
    return first, block, ref, pipe


def _check_two_stages(first, block, ref, x):
    ref[1](ref[0](x)).pow(2).mean().backward()  # the pipeline's two microbatches weigh one half each
    for mod, want in zip((first, block), ref):
        for (n, p), q in zip(mod.named_parameters(), want.parameters()):
            assert_matches(p.grad, q.grad, n)


# 1I0 and 1W0 apart (1F1 in between); 1I1 and 1W1 adjacent with stage 0 local: run as one B
SPLIT_PROGRAM = ["0F0", "1F0", "1I0", "0F1", "1F1", "1W0", "1I1", "1W1", "0B0", "0B1"]


def shared_parameters_split_together(rank, world):
    """A Linear used twice beside another Linear: at 1F1 (after 1I0, before 1W0) no weight gradient
    exists yet; W accumulates the shared one once; nothing is reported."""
    first, block, ref, pipe = _two_stages(SharedWeightBlock, SPLIT_PROGRAM)
    seen_at_f = []
    block.register_forward_pre_hook(lambda mod, args: seen_at_f.append(
        sorted(n for n, p in mod.named_parameters() if p.grad is not None)))
    x = torch.randn(6, WIDTH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.step(x)
    assert seen_at_f[1] == [], seen_at_f
    _check_two_stages(first, block, ref, x)
    assert pipe.split_backward_fallbacks == {}
    assert not [w for w in caught if "pipecore" in str(w.message)]
    return True


def deferred_closures_run_at_w(rank, world):
    """defer_weight_grad inside 1I0 queues the closure: at 1F1 the Function's backward ran once and
    its closure not yet; both ran twice by the end (1B1 runs the closure at once)."""
    first, block, ref, pipe = _two_stages(lambda: FunctionBlock(DeferredLinearFunc, True), SPLIT_PROGRAM)
    seen_at_f = []
    block.register_forward_pre_hook(lambda mod, args: seen_at_f.append(dict(COUNTS)))
    COUNTS.clear()
    x = torch.randn(6, WIDTH)
    pipe.step(x)
    assert seen_at_f[1] == {"function backward": 1}, seen_at_f
    assert dict(COUNTS) == {"function backward": 2, "deferred closure": 2}, COUNTS
    _check_two_stages(first, block, ref, x)
    assert_matches(block.weight.main_grad, ref[1].weight.main_grad, "main_grad")
    return True


class _GeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.kept = []

    def forward(self, x):
        h = self.a(x)  # saved by GELU's backward only: needed by I, not by W
        g = nn.functional.gelu(h)  # saved by b's addmm: its weight gradient needs it at W
        if not x.is_meta:  # not the shapes planning runs
            self.kept.append((weakref.ref(h), weakref.ref(g)))
        return self.b(g)


def input_half_frees_what_w_does_not_need(rank, world):
    """After 1I0 the activations only I needed are freed; what W needs lives until 1W0."""
    first, block, ref, pipe = _two_stages(_GeluMLP, SPLIT_PROGRAM)
    alive_at_f = []
    block.register_forward_pre_hook(lambda mod, args: alive_at_f.append(
        [(h() is not None, g() is not None) for h, g in mod.kept]))
    x = torch.randn(6, WIDTH)
    pipe.step(x)
    assert alive_at_f[1] == [(False, True)], alive_at_f  # at 1F1: mb0's h freed by I, g kept for W
    assert [(h() is None, g() is None) for h, g in block.kept] == [(True, True), (True, True)]
    _check_two_stages(first, block, ref, x)
    return True


class _CheckpointFunction(torch.utils.checkpoint.CheckpointFunction):
    """A reentrant checkpoint under another name, as TransformerEngine and Megatron define theirs."""


class RenamedReentrantCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return _CheckpointFunction.apply(lambda t: self.b(torch.tanh(self.a(t))), True, x)


def renamed_reentrant_checkpoint_runs_whole(rank, world):
    """A reentrant checkpoint refuses a split backward whatever its Function is called: the stage
    runs its whole backward at I, reported."""
    first, block, ref, pipe = _two_stages(RenamedReentrantCheckpoint, SPLIT_PROGRAM)
    x = torch.randn(6, WIDTH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.step(x)
    _check_two_stages(first, block, ref, x)
    assert pipe.split_backward_fallbacks == {1: {("_CheckpointFunctionBackward", "reentrant_checkpoint"): 1}}
    return True


class _OffloadedBlock(nn.Module):
    """Saved tensors packed by hooks, as activation offloading does (save_on_cpu, Megatron's): each
    saved tensor must be unpacked exactly as often as in one process."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    @staticmethod
    def _pack(t):
        COUNTS["pack"] += 1
        return t.clone()

    @staticmethod
    def _unpack(t):
        COUNTS["unpack"] += 1
        return t

    def forward(self, x):
        if x.is_meta:  # the shapes planning runs
            return self.b(torch.tanh(self.a(x)))
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.b(torch.tanh(self.a(x)))


def offloaded_saved_tensors_unpack_once(rank, world):
    """Nodes whose saved tensors have hooks run once (at I): every unpack happens as often as in one
    process, gradients match, the fallback is reported."""
    first, block, ref, pipe = _two_stages(_OffloadedBlock, SPLIT_PROGRAM)
    x = torch.randn(6, WIDTH)
    COUNTS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.step(x)
    counts = dict(COUNTS)
    COUNTS.clear()
    for xc in torch.tensor_split(x, 2):
        ref[1](ref[0](xc)).pow(2).mean().backward()
    assert counts == dict(COUNTS), (counts, dict(COUNTS))
    for p in ref[0].parameters():
        p.grad = None
    for p in ref[1].parameters():
        p.grad = None
    _check_two_stages(first, block, ref, x)
    assert set(pipe.split_backward_fallbacks[1]) == {("AddmmBackward0", "saved_tensor_hooks")}
    return True
