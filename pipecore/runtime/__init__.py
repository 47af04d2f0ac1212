"""The runtime: `Pipeline` (configuration and `step()`) and the modules it runs a step with."""

from pipecore.runtime.pipeline import Pipeline

__all__ = ["Pipeline"]
