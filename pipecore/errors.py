"""Errors of a pipeline step, beyond the schedule layer's ScheduleError."""


class PipelineError(RuntimeError):
    """A step could not complete."""


class PeerFailedError(PipelineError):
    """Another rank's step failed; this rank ran its part of the step to the end without compute.
    The Pipeline (and its group) stays usable: fix the cause and step again."""


class CommunicationError(PipelineError):
    """A wait timed out or a peer's connection broke (a rank hung or died). The process group is no
    longer trustworthy: rebuild it (and the Pipeline) before the next step."""


class InputError(ValueError):
    """Bad input found before any communication of the step."""
