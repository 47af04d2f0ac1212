"""The I/W split of zero-bubble schedules, as users see it.

Under zbv, interleaved_zb, dualpipe and dualpipev a stage's backward runs in two halves: I computes
the gradients of the stage's inputs (sent to the previous stage at once), W the weight gradients,
later, where the schedule has room. pipecore finds the split points in the autograd graph; every
backward node still runs exactly once per microbatch. A node that cannot be split (a Python
autograd Function, a node with hooks or with hooked saved tensors, a compiled graph, the branches of
a parameter used twice) runs once at I, weight gradients included; that costs the schedule part of its bubble, so pipecore warns once per
stage and node and counts it (`Pipeline.split_backward_fallbacks`).

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

from collections.abc import Callable

_WHY = {
    "python_function": "is a Python autograd Function: it computes all its gradients in one backward call, "
                       "which runs once, at I. Hand its weight-gradient work to pipecore.defer_weight_grad(fn) "
                       "inside its backward to move it to W",
    "hooks": "has autograd hooks (a tensor hook, retain_grad, or a node hook), which must run once: it runs once, at "
             "I, weight gradient included. Register the hook on another tensor (the stage's output, a parameter) "
             "to keep the split",
    "saved_tensor_hooks": "saved tensors with hooks (activation checkpointing or offloading): unpacking them again "
                          "at W would recompute the checkpointed region a second time, so its weight gradient is "
                          "computed once, at I",
    "compiled_graph": "is a torch.compile graph, whose backward runs once and refuses a retained graph: the stage's "
                      "weight gradients are computed at I",
    "reentrant_checkpoint": "is a reentrant activation checkpoint (use_reentrant=True), which refuses a split "
                            "backward: the stage runs its whole backward at I. use_reentrant=False keeps the split",
    "shared_parameter": "is used at two split points (a weight used twice, stacked weights indexed per expert): "
                        "the branches that use it compute their weight gradients at I, where each contribution is "
                        "counted exactly once; the stage's other weight gradients still wait for W",
}


def defer_weight_grad(fn: Callable[[], object]) -> None:
    """Run `fn()` -- an autograd Function's weight-gradient work -- at this microbatch's W action
    when called from a backward that pipecore runs as the input half (I) of a split backward;
    anywhere else (a full backward, single-process training, outside any backward) run it now.

    `fn` must compute and accumulate the weight gradients itself (`weight.grad`, `weight.main_grad`);
    it runs after the I of its microbatch and before the step ends, with whatever the closure holds
    alive until then."""
    from . import _C

    _C.defer_weight_grad(fn)


def fallback_message(stage_index: int, why: str, nodes: list[str]) -> str:
    """The one-time warning for the nodes of a stage whose weight gradients ran at I instead of W."""
    names = ", ".join(nodes)
    if why == "saved_tensor_hooks":
        text = f"{names} {'have' if len(nodes) > 1 else 'has'} {_WHY[why]}"
    elif why == "shared_parameter":
        text = f"{names} {_WHY[why]}"
    else:
        text = f"{names} {_WHY.get(why, why)}"
    return f"pipecore: stage {stage_index}: {text}. The schedule's W no longer fills its bubble with that work."


def name_parameter(module, description: str) -> str:
    """The executor's "parameter of shape [4, 16] #<TensorImpl address>" as "parameter fc.weight
    (shape [4, 16])", named among `module`'s parameters (`Tensor._cdata` is that address)."""
    head, _, address = description.rpartition(" #")
    shape = head.removeprefix("parameter of shape ")
    for name, p in module.named_parameters():
        if address.isdigit() and p._cdata == int(address):
            return f"parameter {name} (shape {shape})"
    return head or description
