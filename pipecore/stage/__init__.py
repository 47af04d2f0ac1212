"""Stages: the user's modules as pipeline stages, a model split into stages, batches split into
microbatches, and the wire format of what crosses a stage boundary."""

from pipecore.stage.pipeline_stage import PipelineStage

__all__ = ["PipelineStage"]
