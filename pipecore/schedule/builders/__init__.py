"""Schedule builders, one module per family, and `build_schedule`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pipecore.schedule.lowering import gc_paused
from pipecore.schedule.schedule import Schedule
from pipecore.schedule.builders.auto import build_zb_auto, build_zbh2
from pipecore.schedule.builders.controllable_memory import build_v_half, build_v_min
from pipecore.schedule.builders.dualpipe import build_dualpipe, build_dualpipev, dualpipe_sizes, dualpipev_sizes
from pipecore.schedule.builders.gpipe import build_forward_only, build_gpipe
from pipecore.schedule.builders.interleaved import build_interleaved_1f1b, build_interleaved_zb, build_looped_bfs
from pipecore.schedule.builders.one_f_one_b import build_1f1b
from pipecore.schedule.builders.zero_bubble_v import build_zbv


@dataclass(frozen=True)
class _Spec:
    build: Callable[..., Schedule]  # (ranks, microbatches, stages per rank, **options)
    default_stages_per_rank: int
    allowed_stages_per_rank: tuple[int, ...] | None  # None: any >= 1
    summary: str
    options: tuple[str, ...] = ()  # keyword options of build_schedule this schedule takes
    sizes: Callable[[int, int], str | None] | None = None  # why (ranks, microbatches) do not fit, or None


_SPECS: dict[str, _Spec] = {
    "gpipe": _Spec(build_gpipe, 1, (1,), "all forwards, then all backwards"),
    "1f1b": _Spec(build_1f1b, 1, (1,), "one forward, one backward in steady state"),
    "interleaved_1f1b": _Spec(build_interleaved_1f1b, 2, None, "Megatron's depth-first interleaving, loop placement",
                              ("group_size",)),
    "looped_bfs": _Spec(build_looped_bfs, 2, None, "breadth-first over a rank's stages, loop placement"),
    "interleaved_zb": _Spec(build_interleaved_zb, 2, None,
                            "zero bubble (ZB-H1 at 1 stage per rank): I/W split, W fills bubbles", ("group_size",)),
    "zbh2": _Spec(build_zbh2, 1, (1,), "zero bubble ZB-H2: up to 2R-1 activations per rank fill warmup and cooldown"),
    "zbv": _Spec(build_zbv, 2, (2,), "zero bubble V: rank r holds stages r and 2R-1-r"),
    "v_half": _Spec(build_v_half, 2, (2,), "V-Half (controllable memory): half of 1F1B's activations"),
    "v_min": _Spec(build_v_min, 2, (2,), "V-Min (controllable memory): a third of 1F1B's activations"),
    "zb_auto": _Spec(lambda *args, **options: build_zb_auto(*args, **options, fixed_schedules=_fixed_candidates), 1, (1, 2), "zero bubble built for given costs and memory limit (1 stage or a V)",
                     ("costs", "memory_limit")),
    "dualpipe": _Spec(build_dualpipe, 2, (2,), "DeepSeek's bidirectional DualPipe: mirrored stages r and R-1-r",
                      sizes=dualpipe_sizes),
    "dualpipev": _Spec(build_dualpipev, 2, (2,), "DualPipe folded into a V: overlapped F&B pairs", sizes=dualpipev_sizes),
    "forward_only": _Spec(build_forward_only, 1, None, "inference: forwards only"),
}

SCHEDULES: tuple[str, ...] = tuple(_SPECS)

# torch.distributed.pipelining's class names (pipecore.compat's ScheduleDualPipe too) for its schedules
TORCH_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
               "looped_bfs": "ScheduleLoopedBFS", "interleaved_zb": "ScheduleInterleavedZeroBubble",
               "zbv": "ScheduleZBVZeroBubble", "dualpipe": "ScheduleDualPipe", "dualpipev": "ScheduleDualPipeV"}


def _key(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "").replace(" ", "").removeprefix("schedule")


# the one way to name a schedule: its name in SCHEDULES or torch's class name, in any case, with or without
# "_", "-", spaces or torch's "Schedule" prefix
_NAMES = {**{_key(n): n for n in SCHEDULES}, **{_key(t): n for n, t in TORCH_NAMES.items()}}


def canonical_name(name: str) -> str:
    """The schedule name in `SCHEDULES` for `name`: one of those, or torch's class name
    ("ScheduleInterleaved1F1B"), in any case, with or without "_", "-" and spaces."""
    if not isinstance(name, str):
        raise ValueError(f"schedule name must be a string, one of {', '.join(SCHEDULES)}; got {name!r}")
    if _key(name) not in _NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)} (or torch's class name)")
    return _NAMES[_key(name)]


def build_schedule(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None, *,
                   group_size: int | None = None, costs: Mapping[str, object] | None = None,
                   memory_limit: int | None = None) -> Schedule:
    """The compute-only schedule `name` for `num_ranks` ranks and `num_microbatches` microbatches.

    `stages_per_rank` defaults to 1 for gpipe, 1f1b, zbh2, zb_auto and forward_only, to 2 for the rest.
    `group_size` (interleaved_1f1b, interleaved_zb): Megatron's microbatch group size per virtual
    stage, see `builders.interleaved`.
    `costs`, `memory_limit` (zb_auto): per-stage costs as `Schedule.simulate` takes them (default
    F = I = W = 1, comm = 0) and the activations a rank may hold (default 1F1B's: ranks x stages
    per rank), see `builders.auto`.
    Raises ValueError for combinations the schedule does not support, saying what is allowed.
    """
    canon = canonical_name(name)
    spec = _SPECS[canon]
    options = {k: v for k, v in (("group_size", group_size), ("costs", costs), ("memory_limit", memory_limit))
               if v is not None}
    for key in options:
        if key not in spec.options:
            takers = [n for n, sp in _SPECS.items() if key in sp.options]
            raise ValueError(f"{key} applies to {', '.join(takers)}, not to {canon}")
    for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if stages_per_rank is None:
        stages_per_rank = spec.default_stages_per_rank
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be a positive integer, got {stages_per_rank!r}")
    problem = unsupported(canon, num_ranks, num_microbatches, stages_per_rank)
    if problem is not None:
        raise ValueError(problem)
    with gc_paused():
        return spec.build(num_ranks, num_microbatches, stages_per_rank, **options)


def unsupported(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None) -> str | None:
    """Why schedule `name` does not run these sizes (None: it does): what build_schedule raises
    before building, so that a ValueError from a builder itself is a bug, never a refusal."""
    canon = canonical_name(name)
    spec = _SPECS[canon]
    if stages_per_rank is None:
        stages_per_rank = spec.default_stages_per_rank
    allowed = spec.allowed_stages_per_rank
    if allowed is not None and stages_per_rank not in allowed:
        hint = "interleaved_1f1b, looped_bfs or interleaved_zb" if allowed == (1,) else "the default"
        return (f"{canon} runs {' or '.join(map(str, allowed))} stage(s) per rank, got "
                f"stages_per_rank={stages_per_rank} (for several stages per rank use {hint})")
    if num_ranks * stages_per_rank >= 1 << 16:
        return f"at most {(1 << 16) - 1} stages are supported"
    if num_microbatches >= 1 << 31:
        return "at most 2**31 - 1 microbatches are supported"
    return spec.sizes(num_ranks, num_microbatches) if spec.sizes is not None else None


def takes_stages_per_rank(name: str, stages_per_rank: int) -> bool:
    """Whether schedule `name` runs `stages_per_rank` stages per rank."""
    allowed = _SPECS[canonical_name(name)].allowed_stages_per_rank
    return allowed is None or stages_per_rank in allowed


def default_stages_per_rank(name: str) -> int:
    return _SPECS[canonical_name(name)].default_stages_per_rank


def fixed_schedules(stages_per_rank: int) -> tuple[str, ...]:
    """The training schedules of fixed order that run `stages_per_rank` stages per rank, model
    stage s once (not dualpipe's mirrored copies): what zb_auto compares itself with."""
    return tuple(n for n in SCHEDULES if n not in ("zb_auto", "forward_only", "dualpipe")
                 and takes_stages_per_rank(n, stages_per_rank))


def _fixed_candidates(num_ranks: int, num_microbatches: int, stages_per_rank: int):
    """What zb_auto compares itself with: each fixed schedule that builds for these sizes."""
    for name in fixed_schedules(stages_per_rank):
        try:
            yield build_schedule(name, num_ranks, num_microbatches, stages_per_rank)
        except ValueError:
            continue


def describe() -> dict[str, str]:
    """One line per schedule: what it does."""
    return {name: spec.summary for name, spec in _SPECS.items()}
