"""The one error type of the schedule layer."""


class ScheduleError(ValueError):
    """A schedule (or one of its actions, or a CSV cell) is malformed or cannot run.

    The message names the rank, the step and the action where that applies, followed by the
    timeline around the problem.
    """
