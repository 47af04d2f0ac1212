"""The schedule layer: actions, schedules, builders, lowering, validation, simulation, CSV and
text timelines. Pure Python: importing it does not import torch."""

from .action import Action, Kind
from .builders import SCHEDULES, build_schedule, canonical_name, describe
from .errors import ScheduleError
from .schedule import Schedule
from .simulate import SimResult
from .topology import Topology

__all__ = ["Action", "Kind", "Schedule", "ScheduleError", "SimResult", "Topology", "SCHEDULES",
           "build_schedule", "canonical_name", "describe"]
