"""torch.distributed.pipelining.stage's `PipelineStage`: pipecore's stage, which takes torch's
constructor arguments; `PipelineStageInfo` (torch 2.15's, or pipecore's on an older torch) is what
its `register_forward_context` factories receive."""

from pipecore.stage.pipeline_stage import PipelineStage, PipelineStageInfo

__all__ = ["PipelineStage", "PipelineStageInfo"]

from pipecore.compat._fallback import torch_fallback  # noqa: E402

__getattr__ = torch_fallback("torch.distributed.pipelining.stage", __name__)
