"""torch.distributed.pipelining's names, run by pipecore: a training loop written against torch's
pipelining switches to pipecore by changing its imports

    from torch.distributed.pipelining import PipelineStage            ->  from pipecore.compat import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
                                                                      ->  from pipecore.compat.schedules import ...

`PipelineStage` is pipecore's stage (torch's constructor arguments, `.submod`, `.is_first`,
`.is_last`); the schedule classes (pipecore/compat/schedules.py) take torch's constructor
arguments and also accept torch's own stage objects. Tracing front ends (`pipeline`, `pipe_split`,
`SplitPoint`, `Pipe`) and the microbatch specs are torch's own, re-exported.
"""

from torch.distributed.pipelining import Pipe, SplitPoint, pipe_split, pipeline
from torch.distributed.pipelining.microbatch import TensorChunkSpec

from pipecore.stage.pipeline_stage import PipelineStage
from pipecore.compat.schedules import (PipelineScheduleMulti, PipelineScheduleSingle, Schedule1F1B, ScheduleDualPipe,
                        ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                        ScheduleLoopedBFS, ScheduleZBVZeroBubble, get_schedule_class)

__all__ = ["Pipe", "pipe_split", "SplitPoint", "pipeline", "PipelineStage", "TensorChunkSpec", "Schedule1F1B",
           "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
           "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "ScheduleDualPipe", "PipelineScheduleSingle",
           "PipelineScheduleMulti", "get_schedule_class"]
