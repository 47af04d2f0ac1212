"""Actions: one step of a pipeline schedule, in torch.distributed.pipelining's string form.

Every action also has an integer *code*: schedules keep their per-rank lists as codes (cheap to
build, lower and hand to the C++ executor) and turn them into `Action` objects only when asked.

Code layout (a Python int; < 2**52 for single actions):
    bits 0-3   kind
    bits 4-19  stage index (OVERLAP_F_B containers: 0)
    bits 20-51 microbatch + 1 (0 = no microbatch)
An OVERLAP_F_B container packs its sub-actions' codes at bit 4 + 52 * i.
"""

from __future__ import annotations

import re
from enum import IntEnum
from typing import NamedTuple

from pipecore.schedule.errors import ScheduleError

__all__ = ["Kind", "Action", "encode", "decode", "MAX_STAGES", "MAX_MICROBATCHES"]


class Kind(IntEnum):
    F = 0
    I = 1  # noqa: E741  (torch's name for backward-input)
    W = 2
    B = 3
    SEND_F = 4
    RECV_F = 5
    SEND_B = 6
    RECV_B = 7
    UNSHARD = 8
    RESHARD = 9
    REDUCE_GRAD = 10
    OVERLAP_F_B = 11
    # torch 2.15's explicit waits (a lowered schedule's): for the send of (stage, microbatch), and for
    # a stage's gradient reduction. pipecore's executor retires sends and reductions itself
    # (docs/schedules.md, "Waits"); its own programs hold none.
    WAIT_SEND_F = 12
    WAIT_SEND_B = 13
    WAIT_REDUCE_GRAD = 14

    def __str__(self) -> str:  # "F", "SEND_F", ... as in torch's strings
        return self.name

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return Kind.SEND_F <= self <= Kind.RECV_B

    @property
    def is_wait(self) -> bool:
        return self in _WAITS

    @property
    def has_microbatch(self) -> bool:
        """Does an action of this kind name a microbatch ("1F0"), or only a stage ("0REDUCE_GRAD")?"""
        return self not in _NO_MICROBATCH and self is not Kind.OVERLAP_F_B


_WAITS = frozenset({Kind.WAIT_SEND_F, Kind.WAIT_SEND_B, Kind.WAIT_REDUCE_GRAD})
# the kind bits are full: 0-14 are kinds, 15 is readiness.GRAD_DONE (a marker no action has); one more
# kind needs a wider KIND_BITS
assert max(Kind) < 15
# the kinds that run a stage's computation, as the codes' kind bits (ints: a code's `c & KIND_MASK`)
COMPUTE_KINDS = frozenset(int(k) for k in (Kind.F, Kind.I, Kind.W, Kind.B, Kind.OVERLAP_F_B))
_KINDS = tuple(Kind)
_NO_MICROBATCH = frozenset({Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD, Kind.WAIT_REDUCE_GRAD})

KIND_BITS = 4
KIND_MASK = (1 << KIND_BITS) - 1  # a code's kind: code & KIND_MASK
STAGE_SHIFT = 4
MB_SHIFT = 20
SUB_SHIFT = 52
MAX_STAGES = 1 << 16
MAX_MICROBATCHES = (1 << 32) - 1
STAGE_MASK = MAX_STAGES - 1
SUB_MASK = (1 << SUB_SHIFT) - 1


def stage_of(code: int) -> int:
    """The stage of a single action's code."""
    return (code >> STAGE_SHIFT) & STAGE_MASK


def microbatch_of(code: int) -> int:
    """The microbatch of a single action's code (-1: none)."""
    return (code >> MB_SHIFT) - 1


def leaf_codes(code: int) -> list[int]:
    """Codes of the actions a step runs (the two halves of an OVERLAP_F_B container)."""
    if code & KIND_MASK != Kind.OVERLAP_F_B:
        return [code]
    out, rest = [], code >> STAGE_SHIFT
    while rest:
        out.append(rest & SUB_MASK)
        rest >>= SUB_SHIFT
    return out


def encode(stage: int, kind: int, microbatch: int | None = None) -> int:
    """Integer code of a single (non-container) action."""
    return kind | (stage << STAGE_SHIFT) | ((0 if microbatch is None else microbatch + 1) << MB_SHIFT)


class Action(NamedTuple):
    """One schedule step: `Action(stage=1, kind=Kind.F, microbatch=0)` is "1F0".

    OVERLAP_F_B containers have stage -1, no microbatch and their parts in `sub_actions`:
    "(0F3;1B1)OVERLAP_F_B" runs forward of 0F3 and backward of 1B1 as one step.
    """

    stage: int
    kind: Kind
    microbatch: int | None = None
    sub_actions: tuple["Action", ...] | None = None

    # -- string form -------------------------------------------------------------------
    def __str__(self) -> str:
        if self.sub_actions is not None:
            return "(" + ";".join(map(str, self.sub_actions)) + ")" + self.kind.name
        if self.microbatch is None:
            return f"{self.stage}{self.kind.name}"
        return f"{self.stage}{self.kind.name}{self.microbatch}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> "Action":
        """Parse torch's string form ("1F0", "2SEND_F1", "0REDUCE_GRAD", "(0F3;1B1)OVERLAP_F_B")."""
        action = _parse_cached(text)
        if action is None:
            raise ScheduleError(_bad_action_message(text))
        return action

    # -- properties --------------------------------------------------------------------
    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return Kind.SEND_F <= self.kind <= Kind.RECV_B

    @property
    def code(self) -> int:
        if self.sub_actions is not None:
            code = int(self.kind)
            for i, sub in enumerate(self.sub_actions):
                code |= sub.code << (STAGE_SHIFT + SUB_SHIFT * i)
            return code
        return encode(self.stage, self.kind, self.microbatch)

    def leaves(self) -> tuple["Action", ...]:
        """The actions this step runs: its sub-actions for a container, else itself."""
        return self.sub_actions if self.sub_actions is not None else (self,)

    @staticmethod
    def from_code(code: int) -> "Action":
        return decode(code)


_SINGLE_RE = re.compile(
    r"(\d+)(F|I|W|B|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD|WAIT_SEND_F|WAIT_SEND_B|WAIT_REDUCE_GRAD)(\d*)")
_CONTAINER_RE = re.compile(r"\((.*)\)(OVERLAP_F_B)")
_parse_memo: dict[str, Action | None] = {}


def _parse_single(text: str) -> Action | None:
    match = _SINGLE_RE.fullmatch(text)
    if match is None:
        return None
    stage, kind_name, mb = match.groups()
    kind = Kind[kind_name]
    if kind in _NO_MICROBATCH:
        if mb:
            return None
        return Action(int(stage), kind, None)
    if not mb:
        return None
    return Action(int(stage), kind, int(mb))


def _parse_cached(text: str) -> Action | None:
    try:
        return _parse_memo[text]
    except KeyError:
        pass
    if not isinstance(text, str):
        return None
    stripped = text.strip()
    container = _CONTAINER_RE.fullmatch(stripped)
    if container is not None:
        parts = [p.strip() for p in container.group(1).split(";")]
        subs = [_parse_single(p) for p in parts]
        if len(subs) < 2 or any(s is None or not s.is_compute for s in subs):
            action = None
        else:
            action = Action(-1, Kind.OVERLAP_F_B, None, tuple(subs))  # type: ignore[arg-type]
    else:
        action = _parse_single(stripped)
    if len(_parse_memo) < 1 << 16:
        _parse_memo[text] = action
    return action


def _bad_action_message(text: object) -> str:
    return (
        f"cannot parse action {text!r}: expected [stage][kind][microbatch] such as '1F0', '0B3', "
        "'2SEND_F1', '0UNSHARD', '0REDUCE_GRAD', '1WAIT_SEND_F0', or '(0F3;1B1)OVERLAP_F_B'; kinds: "
        + " ".join(k.name for k in Kind)
    )


_decode_memo: dict[int, Action] = {}
_new_action = tuple.__new__  # skips NamedTuple's argument handling: decoding is on hot paths


def decode(code: int) -> Action:
    """Action of an integer code (memoised: equal codes give the same object)."""
    action = _decode_memo.get(code)
    if action is not None:
        return action
    kind = _KINDS[code & KIND_MASK]
    if kind is Kind.OVERLAP_F_B:
        subs = []
        rest = code >> STAGE_SHIFT
        while rest:
            subs.append(decode(rest & SUB_MASK))
            rest >>= SUB_SHIFT
        action = _new_action(Action, (-1, kind, None, tuple(subs)))
    else:
        mb = (code >> MB_SHIFT) - 1
        action = _new_action(Action, (stage_of(code), kind, None if mb < 0 else mb, None))
    if len(_decode_memo) < 1 << 20:
        _decode_memo[code] = action
    return action
