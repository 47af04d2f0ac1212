"""`Schedule`: per-rank action lists plus the placement they run on."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

from pipecore.schedule.action import COMPUTE_KINDS, KIND_MASK, Action, Kind, decode
from pipecore.schedule.csvio import read_csv, write_csv
from pipecore.schedule.errors import ScheduleError
from pipecore.schedule.lowering import lower
from pipecore.schedule.simulate import SimResult, simulate
from pipecore.schedule.timeline import format_table
from pipecore.schedule.topology import Topology
from pipecore.schedule.validate import validate

ActionLike = Action | str | None


class Schedule:
    """What every rank runs, in order.

    `actions[rank]` lists that rank's `Action`s in execution order. A *compute-only* schedule holds
    F/I/W/B (and OVERLAP_F_B) actions; `lower()` returns the runnable form with SEND_*/RECV_*,
    REDUCE_GRAD and (for sharded stages) UNSHARD/RESHARD inserted.

    Build one with `pc.build_schedule(...)`, from a CSV (`Schedule.from_csv`), or by hand:
    `Schedule([["0F0", "0B0"], ["1F0", "1B0"]])` (stages, microbatches and ranks are inferred;
    `placement` takes "loop", "v", "dualpipe" or an explicit stage -> rank list/dict).
    """

    __slots__ = ("codes", "topology", "name", "_actions")

    def __init__(
        self,
        actions: Mapping[int, Sequence[ActionLike]] | Sequence[Sequence[ActionLike]],
        num_stages: int | None = None,
        num_microbatches: int | None = None,
        *,
        placement: str | Sequence[int] | Mapping[int, int] | None = None,
        num_ranks: int | None = None,
        name: str | None = None,
    ):
        rows = _rows(actions, num_ranks)
        parsed: list[list[Action]] = []
        for rank, row in enumerate(rows):
            out = []
            for step, item in enumerate(row):
                if item is None:
                    continue
                if isinstance(item, str):
                    if not item.strip():
                        continue
                    try:
                        item = Action.parse(item)
                    except ScheduleError as exc:
                        raise ScheduleError(f"rank {rank}, step {step}: {exc}") from None
                elif not isinstance(item, Action):
                    raise ScheduleError(
                        f"rank {rank}, step {step}: expected an Action or its string form, got {item!r}")
                out.append(item)
            parsed.append(out)
        topology = _infer_topology(parsed, num_stages, num_microbatches, placement)
        self.codes = [[a.code for a in row] for row in parsed]
        self.topology = topology
        self.name = name
        self._actions = parsed

    @classmethod
    def from_codes(cls, codes: list[list[int]], topology: Topology, name: str | None = None) -> "Schedule":
        """A schedule of per-rank integer action codes (pipecore/schedule/action.py) over `topology`, as
        the builders, the passes and the executor's programs make them: taken as they are, nothing
        parsed or checked (`validate()` checks)."""
        self = object.__new__(cls)
        self.codes = codes
        self.topology = topology
        self.name = name
        self._actions = None
        return self

    # -- shape ----------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.codes)

    @property
    def num_stages(self) -> int:
        return self.topology.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.topology.num_microbatches

    @property
    def placement(self) -> str:
        return self.topology.style

    @property
    def actions(self) -> list[list[Action]]:
        if self._actions is None:
            self._actions = [[decode(c) for c in row] for row in self.codes]
        return self._actions

    def stage_to_rank(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ScheduleError(f"stage {stage} out of range: this schedule has stages 0..{self.num_stages - 1}")
        return self.topology.stage_rank[stage]

    def rank_stages(self, rank: int) -> list[int]:
        """The stages rank `rank` holds, in increasing order."""
        return self.topology.rank_stages(rank)

    @property
    def is_lowered(self) -> bool:
        """True when the schedule already holds communication (or other non-compute) actions."""
        return any((c & KIND_MASK) not in COMPUTE_KINDS for row in self.codes for c in row)

    @property
    def has_backward(self) -> bool:
        return any((c & KIND_MASK) in _BACKWARD_KINDS for row in self.codes for c in row)

    # -- passes ---------------------------------------------------------------------------
    def lower(self, *, merge_iw: bool = True, reduce_grad: bool = True,
              sharded: Iterable[int] | bool = (), max_active_stages: int = 3, unshard_lookahead: int | None = None,
              waits: bool = False, defer_reduce_grad_wait: bool = False) -> "Schedule":
        """The runnable form (what a Pipeline runs): comm actions inserted (never deadlocks),
        adjacent I+W merged into B where no other rank waits for that input gradient (elsewhere
        I, SEND_B, W: the gradient leaves before the weight gradients are computed, so the lowered
        program simulates to the schedule's makespan), REDUCE_GRAD after each stage's last
        backward, UNSHARD/RESHARD around sharded stages (at most `max_active_stages` unsharded, the
        next `unshard_lookahead` fetched ahead). `waits`: torch 2.15's WAIT_SEND_F/WAIT_SEND_B and
        WAIT_REDUCE_GRAD placed as torch places them (lowering.add_waits), for a schedule handed to
        torch; pipecore's executor retires sends and reductions itself and runs programs without."""
        return lower(self, merge_iw=merge_iw, reduce_grad=reduce_grad, sharded=sharded,
                     max_active_stages=max_active_stages, unshard_lookahead=unshard_lookahead, waits=waits,
                     defer_reduce_grad_wait=defer_reduce_grad_wait)

    def compute_only(self) -> "Schedule":
        """This schedule without communication, REDUCE_GRAD, UNSHARD/RESHARD and WAIT_* actions."""
        codes = [[c for c in row if (c & KIND_MASK) in COMPUTE_KINDS] for row in self.codes]
        return Schedule.from_codes(codes, self.topology, self.name)

    def validate(self) -> "Schedule":
        """Check completeness, placement, dependency order and deadlock freedom.
        Raises `ScheduleError` naming the rank, step and action; returns self when valid."""
        validate(self)
        return self

    def simulate(self, costs: Mapping[str, object] | None = None, overlap: str = "lockstep") -> "SimResult":
        """Makespan, bubble and peak activations under `costs` (see pipecore.schedule.simulate);
        `overlap` prices OVERLAP_F_B pairs as the executor runs them (Pipeline's `overlap_f_b`)."""
        return simulate(self, costs, overlap)

    # -- io -------------------------------------------------------------------------------
    def to_csv(self, path) -> None:
        write_csv(self, path)

    @classmethod
    def from_csv(cls, path, *, num_stages: int | None = None, num_microbatches: int | None = None,
                 placement: str | Sequence[int] | Mapping[int, int] | None = None,
                 name: str | None = None) -> "Schedule":
        rows = read_csv(path)
        try:
            return cls(rows, num_stages, num_microbatches, placement=placement,
                       name=name or os.path.splitext(os.path.basename(str(path)))[0])
        except ScheduleError as exc:
            raise ScheduleError(f"{path}: {exc}") from None

    def format(self, *, aligned: bool = True, steps: range | None = None,
               highlight: tuple[int, int] | None = None) -> str:
        """Step x rank table. `aligned` places actions at their unit-time step so bubbles show; a
        lowered schedule prints each rank's program in order, its sends and receives included."""
        return format_table(self, aligned=aligned, steps=steps, highlight=highlight)

    # -- dunder ---------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self.codes == other.codes and self.topology == other.topology

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name else ""
        return (f"Schedule({label}ranks={self.num_ranks}, stages={self.num_stages}, "
                f"microbatches={self.num_microbatches}, placement={self.placement!r}, "
                f"actions={sum(map(len, self.codes))})")

    def __str__(self) -> str:
        return self.format()


_BACKWARD_KINDS = frozenset(int(k) for k in (Kind.I, Kind.W, Kind.B, Kind.OVERLAP_F_B))


def _rows(actions, num_ranks):
    if isinstance(actions, Mapping):
        bad = [k for k in actions if not isinstance(k, int) or k < 0]
        if bad:
            raise ScheduleError(f"schedule ranks must be integers >= 0, got {bad}")
        count = max(actions, default=-1) + 1
        if num_ranks is not None:
            if count > num_ranks:
                raise ScheduleError(f"actions name rank {count - 1} but num_ranks={num_ranks}")
            count = num_ranks
        return [list(actions.get(r, ())) for r in range(count)]
    if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence):
        raise ScheduleError("actions must be a list of per-rank action lists or a {rank: actions} dict")
    rows = [list(row) for row in actions]
    if num_ranks is not None:
        if len(rows) > num_ranks:
            raise ScheduleError(f"got action lists for {len(rows)} ranks but num_ranks={num_ranks}")
        rows += [[] for _ in range(num_ranks - len(rows))]
    return rows


def _leaves(action: Action):
    return action.sub_actions if action.sub_actions is not None else (action,)


def _infer_topology(rows: list[list[Action]], num_stages, num_microbatches, placement) -> Topology:
    num_ranks = len(rows)
    if num_ranks == 0:
        raise ScheduleError("a schedule needs at least one rank")
    seen_rank: dict[int, tuple[int, int]] = {}
    forwards: dict[int, set[int]] = {}  # the microbatches each stage runs forward
    max_stage, max_mb = -1, -1
    for rank, row in enumerate(rows):
        for step, action in enumerate(row):
            for leaf in _leaves(action):
                if leaf.stage < 0:
                    raise ScheduleError(f"rank {rank}, step {step}, action {action}: negative stage")
                max_stage = max(max_stage, leaf.stage)
                if leaf.microbatch is not None:
                    max_mb = max(max_mb, leaf.microbatch)
                if leaf.kind in (Kind.F, Kind.I, Kind.W, Kind.B) and leaf.stage not in seen_rank:
                    seen_rank[leaf.stage] = (rank, step)
                if leaf.kind is Kind.F:
                    forwards.setdefault(leaf.stage, set()).add(leaf.microbatch)
    if num_stages is None:
        num_stages = max_stage + 1
    elif max_stage >= num_stages:
        raise ScheduleError(f"an action names stage {max_stage} but num_stages={num_stages}")
    if num_microbatches is None:
        num_microbatches = max_mb + 1
    elif max_mb >= num_microbatches:
        raise ScheduleError(f"an action names microbatch {max_mb} but num_microbatches={num_microbatches}")
    if num_stages <= 0:
        raise ScheduleError("the schedule holds no actions: cannot infer its stages")

    if isinstance(placement, str):
        return Topology.from_style(placement, num_ranks, num_stages, num_microbatches)
    if placement is not None:
        mapping = dict(placement) if isinstance(placement, Mapping) else dict(enumerate(placement))
        missing = [s for s in range(num_stages) if s not in mapping]
        if missing:
            raise ScheduleError(f"placement gives no rank for stages {missing}")
        bad = {s: r for s, r in mapping.items() if not 0 <= r < num_ranks}
        if bad:
            raise ScheduleError(f"placement maps stages to ranks outside 0..{num_ranks - 1}: {bad}")
        return Topology.chain("custom", [mapping[s] for s in range(num_stages)], num_microbatches, num_ranks)
    # infer: the rank where each stage computes; the standard styles when they match. A style whose stages
    # run forward on exactly its microbatches first: dualpipe's stages sit where the V placement puts them,
    # and each runs half of the microbatches (torch's CSV has no placement to say which it is)
    styles = []
    for style in ("loop", "v", "dualpipe"):
        try:
            topo = Topology.from_style(style, num_ranks, num_stages, num_microbatches)
        except ScheduleError:
            continue
        if all(topo.stage_rank[s] == r for s, (r, _) in seen_rank.items()) and len(seen_rank) == num_stages:
            styles.append(topo)
    for topo in styles:
        if all(forwards.get(s, set()) == set(topo.microbatches[s]) for s in range(num_stages)):
            return topo
    for topo in styles:
        if topo.style != "dualpipe":  # an incomplete schedule: placed, and the validator names what is missing
            return topo
    missing = [s for s in range(num_stages) if s not in seen_rank]
    if missing:
        raise ScheduleError(
            f"cannot place stages {missing}: no rank computes them; pass placement= (a stage -> rank map)")
    return Topology.chain("custom", [seen_rank[s][0] for s in range(num_stages)], num_microbatches, num_ranks)
