"""`pipecore._C`, the executor, and the constants it defines (read from it, never copied)."""

from __future__ import annotations

try:
    import pipecore._C as C
except ImportError as exc:  # pragma: no cover - a checkout whose extension was never built
    raise ImportError(f"pipecore's C++ extension (pipecore._C) is not built or does not load ({exc}). In a checkout run "
                      "`make install`; otherwise `pip install --no-build-isolation .` (docs/install.md)") from exc

OPCODES: dict[str, int] = dict(C.OPCODES)  # instruction opcodes (csrc/program.h: Op)
INSTRUCTION_FIELDS: int = C.INSTRUCTION_FIELDS  # integers per instruction (csrc/program.h)
STAGE_EVENTS: dict[str, int] = dict(C.STAGE_EVENTS)  # events told to DDP/FSDP2 stages
MESSAGE_STATUS: dict[str, int] = dict(C.MESSAGE_STATUS)  # what a message says instead of data (message_status.h)
SPEC_ANSWERS: dict[str, int] = dict(C.SPEC_ANSWERS)  # discovery's answers to the executor (csrc/executor.h)
OVERLAP_MODES: dict[str, int] = dict(C.OVERLAP_MODES)  # how OVERLAP_F_B halves run (csrc/overlap.h)
DEFAULT_RECV_WINDOW: int = C.DEFAULT_RECV_WINDOW  # receives posted ahead of the action that needs them
DEFAULT_SEND_BUDGET: int = C.DEFAULT_SEND_BUDGET  # bytes of sends in flight to one peer
CommError, PeerAbort, PeerReplan = C.CommError, C.PeerAbort, C.PeerReplan
