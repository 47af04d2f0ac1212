"""`PipelineStage`: one stage of the model, held by this rank."""

from __future__ import annotations

import torch
from torch import nn


class PipelineStage:
    """Wraps `module` as stage `stage_index` of `num_stages`.

    The module's forward takes what the previous stage returned (a tuple is unpacked into
    positional arguments, a dict into keyword arguments) or, for the first stage, the arguments
    given to `Pipeline.step`. It may return a tensor, or a tuple/list/dict of tensors and other
    values; several tensors per boundary travel as one message, non-tensor values and integer
    tensors pass through, tensors that need no gradient get none.
    For `dualpipe`, stage R+j holds a copy of model stage j (see `Schedule.topology.model_stage`).
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, device: torch.device | str | None = None):
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

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, {type(self.module).__name__}, {self.device})"
