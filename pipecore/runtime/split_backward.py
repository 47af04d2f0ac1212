"""The I/W split of zero-bubble schedules, as users see it.

Under zbv, interleaved_zb, dualpipe and dualpipev a stage's backward runs in two halves: I computes
the gradients of the stage's inputs (sent to the previous stage at once), W the weight gradients,
later, where the schedule has room. pipecore finds the split points in the autograd graph. No user
code runs twice: torch's generated nodes at a split point are asked for the input gradient at I
and for the weight gradient at W (disjoint outputs); every other node runs once. A node that cannot
be split (a Python or C++ autograd Function, a node with hooks or with hooked saved tensors, a
compiled graph) runs once at I, weight gradients included; that costs the schedule part of its
bubble, so pipecore warns once per stage and reason and counts it
(`Pipeline.split_backward_fallbacks`).

Fused Functions keep their weight gradient at W by handing that work to `defer_weight_grad` in their
backward, as DeepSeek's DualPipe does with its WeightGradStore:

    class LinearFunc(torch.autograd.Function):
        @staticmethod
        def backward(ctx, grad_out):
            x, weight = ctx.saved_tensors
            def weight_grad():
                weight.main_grad.add_(grad_out.flatten(0, -2).t() @ x.flatten(0, -2))
            pipecore.defer_weight_grad(weight_grad)
            return grad_out @ weight, None
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

_WHY = {  # the executor's reasons (csrc/backward.h, FallbackReason) and what each means
    "python_function": "a Python autograd Function: it computes all its gradients in one backward call, which "
                       "runs once, at I. Hand its weight-gradient work to pipecore.defer_weight_grad(fn) inside its "
                       "backward to move it to W",
    "custom_node": "not one of torch's generated backward nodes (a C++ autograd Function, an extension's node, "
                   "CopySlices): its backward may compute every gradient each time it runs, so it runs once, at I",
    "hooks": "a node with autograd hooks (a tensor hook, retain_grad, or a node hook), which must run once: it runs "
             "once, at I, weight gradient included. A hook on a parameter, or on a tensor that is not a split "
             "point, keeps the split",
    "saved_tensor_hooks": "a node whose saved tensors have hooks (activation checkpointing, offloading): unpacking "
                          "them again at W would recompute a checkpointed region or reload an offloaded tensor a "
                          "second time, so its weight gradient is computed once, at I",
    "compiled_graph": "a torch.compile graph, whose backward runs once and refuses a retained graph: the stage's "
                      "weight gradients are computed at I",
    "reentrant_checkpoint": "a reentrant activation checkpoint (use_reentrant=True), which refuses a split "
                            "backward: the stage runs its whole backward at I. use_reentrant=False keeps the split",
    "shared_parameter": "used by a branch whose weight gradient is computed at I: every branch that uses it "
                        "computes its contribution there too, so that each is counted exactly once",
}


def defer_weight_grad(fn: Callable[[], object]) -> None:
    """Run `fn()` -- an autograd Function's weight-gradient work -- at this microbatch's W action
    when called from a backward that pipecore runs as the input half (I) of a split backward;
    anywhere else (a full backward, single-process training, outside any backward) run it now.

    `fn` must compute and accumulate the weight gradients itself (`weight.grad`, `weight.main_grad`);
    it runs after the I of its microbatch and before the step ends, with whatever the closure holds
    alive until then."""
    import pipecore._C as _C

    _C.defer_weight_grad(fn)


def fallback_message(stage_index: int, why: str, nodes: list[str]) -> str:
    """The one-time warning for the nodes of a stage whose weight gradients ran at I instead of W."""
    return (f"pipecore: stage {stage_index}: {', '.join(nodes)}: {_WHY.get(why, why)}. The schedule's W no longer "
            f"fills its bubble with that work.")


def name_parameter(module, impl_address: int, description: str) -> str:
    """The parameter of `module` whose TensorImpl is at `impl_address` (Tensor._cdata), as
    "parameter fc.weight (shape [4, 16])"; `description` if none is."""
    for name, p in module.named_parameters():
        if p._cdata == impl_address:
            return f"parameter {name} (shape {list(p.shape)})"
    return description


def fallbacks(executor, stages: list) -> dict[int, dict[tuple[str, str], int]]:
    """Per stage index: {(node or parameter named, why): microbatches} that the executor counted."""
    return {stages[local].stage_index: {_named(stages[local], key): n for key, n in stats.items()}
            for local, stats in enumerate(executor.split_fallbacks()) if stats}


def warn_new_fallbacks(executor, stages: list, warned: set, *, stacklevel: int) -> None:
    """One warning per stage and reason for the nodes not warned about yet (`warned` remembers them);
    `stacklevel` names the caller of step() from here."""
    new: dict[tuple[int, str], list[str]] = {}  # (stage, why) -> nodes not warned about yet
    for local, stats in enumerate(executor.split_fallbacks()):
        stage_index = stages[local].stage_index
        for key in stats:
            if (stage_index, key) not in warned:
                warned.add((stage_index, key))
                node, why = _named(stages[local], key)
                new.setdefault((stage_index, why), []).append(node)
    for (stage_index, why), nodes in new.items():
        warnings.warn(fallback_message(stage_index, why, sorted(nodes)), stacklevel=stacklevel)


def _named(stage, key: tuple[str, str, int]) -> tuple[str, str]:
    node, why, param = key
    return (name_parameter(stage.module, param, node) if param else node), why
