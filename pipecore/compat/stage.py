"""torch.distributed.pipelining.stage's `PipelineStage`: pipecore's stage, which takes torch's
constructor arguments."""

from pipecore.stage.pipeline_stage import PipelineStage

__all__ = ["PipelineStage"]
