"""`PipelineStage`: one stage of the model, held by this rank."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .plan import describe, tensor_leaves


class PipelineStage:
    """Wraps `module` as stage `stage_index` of `num_stages`.

    The module's forward takes what the previous stage returned (a tuple is unpacked into
    positional arguments, a dict into keyword arguments) or, for the first stage, the arguments
    given to `Pipeline.step`. It may return a tensor, or a tuple/list/dict of tensors and other
    values; several tensors per boundary travel as one message, other values (ints, floats, bools,
    None, small picklable objects) travel with them and reach the next stage as returned, integer
    tensors pass through, tensors that need no gradient get none.
    For `dualpipe`, stage R+j holds a copy of model stage j (see `Schedule.topology.model_stage`).

    What crosses the boundaries is learnt from the forwards of the first step with each batch
    shape (pipecore/discovery.py): nothing runs the module beforehand. `input_args`/`output_args`
    are accepted as torch's PipelineStage takes them (examples of one microbatch's inputs and of what
    the module returns for them, real or meta; only shapes and dtypes count): a forward on inputs
    shaped like `input_args` that returns other shapes fails with an error that names both.
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, device: torch.device | str | None = None,
                 *, input_args: Any = None, output_args: Any = None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"PipelineStage needs an nn.Module, got {type(module).__name__}")
        for label, value in (("stage_index", stage_index), ("num_stages", num_stages)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{label} must be an int, got {value!r}")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in 0..num_stages-1 = 0..{num_stages - 1}, got {stage_index}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        if device is None:
            param = next(iter(module.parameters()), None)
            device = param.device if param is not None else torch.device("cpu")
        self.device = torch.device(device)
        if (input_args is None) != (output_args is None):
            raise ValueError("give both input_args (one microbatch's inputs) and output_args (what the stage returns "
                             "for them), or neither to have shapes found on the first step")
        self._given_in: list[tuple] | None = None
        self._given_out: Any = None
        if input_args is not None:
            args = input_args if isinstance(input_args, tuple) else (input_args,)
            self._given_in = _shapes(args, "input_args")
            self._given_out = describe(output_args)
            _shapes(output_args, "output_args")

    def declared_output(self, args_desc: Any, kwargs_desc: Any) -> Any | None:
        """The description of this stage's output declared by output_args, when these inputs are
        shaped like input_args; None: nothing declared for them."""
        if self._given_in is None or tensor_leaves(kwargs_desc):
            return None
        if [(m.shape, m.dtype) for m in tensor_leaves(args_desc)] != self._given_in:
            return None
        return self._given_out

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, {type(self.module).__name__}, {self.device})"


def _shapes(tree: Any, what: str) -> list[tuple]:
    leaves = [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]
    if not leaves:
        raise TypeError(f"{what} must be a tensor or hold tensors (examples of one microbatch), got {tree!r:.80}")
    return [(tuple(t.shape), t.dtype) for t in leaves]
