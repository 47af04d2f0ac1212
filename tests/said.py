"""An error as a user reads it in a traceback: its message, then each cause's ("caused by ..."), as
pipecore raises a backend's text (gloo's, NCCL's, the CPU model of NCCL's) once, as the cause."""


def said(exc: BaseException) -> str:
    text, cause = str(exc), exc.__cause__
    while cause is not None:
        text += f" (caused by {type(cause).__name__}: {cause})"
        cause = cause.__cause__
    return text
