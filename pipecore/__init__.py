"""pipecore: a performance-first executor for pipeline-parallel training in PyTorch."""

from .schedule import (SCHEDULES, Action, Kind, Schedule, ScheduleError, SimResult, Topology,
                       build_schedule)

__version__ = "0.1.0"

__all__ = ["Action", "Kind", "Schedule", "ScheduleError", "SimResult", "Topology", "SCHEDULES",
           "build_schedule", "__version__"]
