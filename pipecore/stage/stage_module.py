"""`StageModule`: what `pc.partition` makes of each stage, and what `PipelineStage` reads its ties from.

It lives apart from the partitioning that builds it so that `PipelineStage`, which only asks a module
whether it is one, does not depend on partitioning (and on the Hugging Face support partitioning
holds)."""

from __future__ import annotations

from torch import nn

from pipecore.stage.boundary import as_call


class StageModule(nn.Sequential):
    """An nn.Sequential whose layers may take several arguments: each layer's output feeds the
    next as a Pipeline boundary does (tuple/list -> positional args, dict -> keyword args).

    `tied` ({key: the parameter's name in this stage}) names the parameters this stage shares with
    other stages of the same `partition` call; `PipelineStage` declares them as tied weights unless
    given `tied=` (which then says all of this stage's ties)."""

    tied: dict[str, str]

    def __init__(self, *args):
        super().__init__(*args)
        self.tied = {}

    def forward(self, *args, **kwargs):
        if not len(self):
            raise RuntimeError("this StageModule holds no layers: there is nothing to run")
        for layer in self:
            out = layer(*args, **kwargs)
            args, kwargs = as_call(out)
        return out
