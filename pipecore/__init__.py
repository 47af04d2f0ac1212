"""pipecore: a performance-first executor for pipeline-parallel training in PyTorch.

The schedule layer (`pipecore.schedule`) is pure Python; the runtime names (`Pipeline`,
`PipelineStage`) import torch on first use. `pipecore.compat` holds torch.distributed.pipelining's
names (its schedule classes are also here, at the top level).
"""

from pipecore.errors import CommunicationError, InputError, PeerFailedError, PipelineError
from pipecore.schedule import (SCHEDULES, Action, Kind, Schedule, ScheduleError, SimResult, Topology,
                       build_schedule)

from pipecore.version import __version__

# torch.distributed.pipelining's schedule names (pipecore.compat), also here at the top level
_COMPAT = ["get_schedule_class", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
           "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "ScheduleDualPipe"]

__all__ = ["Action", "Kind", "Schedule", "ScheduleError", "InputError", "PipelineError", "PeerFailedError",
           "CommunicationError", "SimResult", "Topology", "SCHEDULES",
           "build_schedule", "Pipeline", "PipelineStage", "defer_weight_grad", "partition", "clip_grad_norm_",
           "save_checkpoint", "load_checkpoint", "init_mesh", "overlap_handoff", "OverlappedPair", *_COMPAT,
           "__version__"]

_LAZY = {"Pipeline": ("runtime.pipeline", "Pipeline"), "PipelineStage": ("stage.pipeline_stage", "PipelineStage"),
         "defer_weight_grad": ("runtime.split_backward", "defer_weight_grad"),
         "microbatch": ("stage.microbatch", None), "partition": ("stage.partitioning", "partition"),
         "clip_grad_norm_": ("training.clipping", "clip_grad_norm_"),
         "save_checkpoint": ("training.checkpoint", "save_checkpoint"),
         "load_checkpoint": ("training.checkpoint", "load_checkpoint"), "init_mesh": ("training.mesh", "init_mesh"),
         "overlap_handoff": ("runtime.overlap", "overlap_handoff"),
         "OverlappedPair": ("runtime.overlap", "OverlappedPair"),
         "compat": ("compat", None), "hf": ("stage.hf", None), **{name: ("compat.schedules", name) for name in _COMPAT}}


def __dir__():
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        mod = importlib.import_module(f".{module}", __name__)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pipecore' has no attribute {name!r}")
