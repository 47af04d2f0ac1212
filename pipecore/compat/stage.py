"""torch.distributed.pipelining.stage's `PipelineStage`: pipecore's stage, which takes torch's
constructor arguments."""

from pipecore.stage.pipeline_stage import PipelineStage

__all__ = ["PipelineStage"]

from pipecore.compat._fallback import torch_fallback  # noqa: E402

__getattr__ = torch_fallback("torch.distributed.pipelining.stage", __name__)
