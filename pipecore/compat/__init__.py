"""torch.distributed.pipelining's names, run by pipecore: a training loop written against torch's
pipelining switches to pipecore by changing its imports

    from torch.distributed.pipelining import PipelineStage            ->  from pipecore.compat import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
                                                                      ->  from pipecore.compat.schedules import ...

or, for code the user does not edit (TorchTitan), by one line in the launcher, before it is imported:

    pipecore.compat.patch_torch_pipelining()

`PipelineStage` is pipecore's stage (torch's constructor arguments, `get_mesh=` included, `.submod`
settable, `.is_first`, `.is_last`); the schedule classes (pipecore/compat/schedules.py) take torch's
constructor arguments and also accept torch's own stage objects. Tracing front ends (`pipeline`,
`pipe_split`, `SplitPoint`, `Pipe`), the microbatch specs and any other name pipecore does not run
are torch's own (pipecore/compat/_fallback.py).
"""

import sys

from torch.distributed.pipelining import Pipe, SplitPoint, pipe_split, pipeline
from torch.distributed.pipelining.microbatch import TensorChunkSpec

from pipecore.compat._fallback import torch_fallback
from pipecore.stage.pipeline_stage import PipelineStage, PipelineStageInfo
from pipecore.compat.schedules import (PipelineScheduleMulti, PipelineScheduleSingle, Schedule1F1B, ScheduleDualPipe,
                        ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                        ScheduleLoopedBFS, ScheduleZBVZeroBubble, get_schedule_class)

__getattr__ = torch_fallback("torch.distributed.pipelining", __name__)

_ALIASED = ("", ".schedules", ".stage", ".microbatch")  # torch's modules and pipecore's of the same name


def patch_torch_pipelining() -> None:
    """Makes `torch.distributed.pipelining` and its `.schedules`, `.stage` and `.microbatch` resolve to
    pipecore.compat's modules for this process, so that code importing torch's (TorchTitan's
    pipeline_llm, its schedule builder) runs on pipecore unedited. Call it before that code is
    imported: a module that already imported torch's classes keeps them. Idempotent."""
    import importlib
    import pkgutil

    import torch.distributed
    import torch.distributed.pipelining as torchs

    # torch's other submodules first, under their own names: once the package's name is pipecore's,
    # an import of one not yet loaded would look in pipecore/compat/
    for info in pkgutil.iter_modules(torchs.__path__):
        importlib.import_module(f"torch.distributed.pipelining.{info.name}")
    ours = {suffix: importlib.import_module(__name__ + suffix) for suffix in _ALIASED}  # each holds torch's own
    for suffix, module in ours.items():
        sys.modules["torch.distributed.pipelining" + suffix] = module
    torch.distributed.pipelining = ours[""]


__all__ = ["patch_torch_pipelining", "build_stage", "Pipe", "pipe_split", "SplitPoint", "pipeline", "PipelineStage",
           "TensorChunkSpec", "PipelineStageInfo", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
           "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "ScheduleDualPipe",
           "PipelineScheduleSingle", "PipelineScheduleMulti", "get_schedule_class"]
