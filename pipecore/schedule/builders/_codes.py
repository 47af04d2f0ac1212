"""Shared helpers for builders: action codes without building Action objects."""

from pipecore.schedule.action import MB_SHIFT, STAGE_SHIFT, SUB_SHIFT, Kind

F, I, W, B = int(Kind.F), int(Kind.I), int(Kind.W), int(Kind.B)
OVERLAP = int(Kind.OVERLAP_F_B)


def code(stage: int, kind: int, mb: int) -> int:
    return kind | (stage << STAGE_SHIFT) | ((mb + 1) << MB_SHIFT)


def overlap(forward: int, backward: int) -> int:
    """OVERLAP_F_B container of two action codes."""
    return OVERLAP | (forward << STAGE_SHIFT) | (backward << (STAGE_SHIFT + SUB_SHIFT))


def mb_of(c: int) -> int:
    return (c >> MB_SHIFT) - 1
