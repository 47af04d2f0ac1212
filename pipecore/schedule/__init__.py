"""The schedule layer: actions, schedules, builders, lowering, validation, simulation, CSV and
text timelines. Pure Python: importing it does not import torch."""

from pipecore.schedule.action import Action, Kind
from pipecore.schedule.builders import SCHEDULES, build_schedule, canonical_name, describe
from pipecore.schedule.errors import ScheduleError
from pipecore.schedule.schedule import Schedule
from pipecore.schedule.simulate import SimResult
from pipecore.schedule.topology import Topology

__all__ = ["Action", "Kind", "Schedule", "ScheduleError", "SimResult", "Topology", "SCHEDULES",
           "build_schedule", "canonical_name", "describe"]
