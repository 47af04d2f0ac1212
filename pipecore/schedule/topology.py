"""Where stages live and how data flows between them.

A `Topology` answers, for every stage of a schedule: which rank holds it, which stage feeds it
(forward) and which it feeds, which microbatches it processes, and which model stage it is.
Placements:
  loop      stage s on rank s % R (GPipe, 1F1B, interleaved, looped BFS)
  v         rank r holds stages r and 2R-1-r (zig-zag for more stages per rank): ZBV, DualPipeV
  dualpipe  two pipelines in opposite directions over R ranks: stages 0..R-1 (model stage s on
            rank s) take the first half of the microbatches; stages R..2R-1 (model stage j as
            stage R+j on rank R-1-j) take the second half. Stage R+j mirrors model stage j.
  custom    any stage -> rank map (e.g. read from a CSV), one chain 0 -> 1 -> ... -> S-1
"""

from __future__ import annotations

from dataclasses import dataclass

from pipecore.schedule.action import Kind
from pipecore.schedule.errors import ScheduleError

PLACEMENTS = ("loop", "v", "dualpipe", "custom")
# activations go to the next stage and come from the previous one; input gradients the other way
_NEXT_STAGE_END = frozenset({Kind.SEND_F, Kind.RECV_B})
_PREV_STAGE_END = frozenset({Kind.SEND_B, Kind.RECV_F})


@dataclass(frozen=True)
class Topology:
    style: str
    num_ranks: int
    num_microbatches: int
    stage_rank: tuple[int, ...]
    prev_stage: tuple[int, ...]  # -1: first stage of its pipeline (reads the batch)
    next_stage: tuple[int, ...]  # -1: last stage of its pipeline (computes the loss)
    microbatches: tuple[range, ...]  # microbatches each stage processes
    model_stage: tuple[int, ...]  # the model stage a stage computes (dualpipe mirrors)

    @property
    def num_stages(self) -> int:
        return len(self.stage_rank)

    def rank_stages(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_rank) if r == rank]

    # -- where a message goes: the one rule for sends and receives ------------------------
    def peer_stage(self, stage: int, kind: int) -> int:
        """The stage at the other end of `stage`'s SEND_F, RECV_F, SEND_B or RECV_B (-1: none)."""
        if kind in _NEXT_STAGE_END:
            return self.next_stage[stage]
        if kind in _PREV_STAGE_END:
            return self.prev_stage[stage]
        raise ValueError(f"{Kind(kind)} is neither a send nor a receive")

    def peer_rank(self, stage: int, kind: int) -> int:
        """The rank that `stage`'s SEND_F, RECV_F, SEND_B or RECV_B talks to (-1: no stage there)."""
        other = self.peer_stage(stage, kind)
        return self.stage_rank[other] if other >= 0 else -1

    def crosses_ranks(self, stage: int, kind: int) -> bool:
        """Does that message go between two ranks (a stage there, on another rank)?"""
        return self.peer_rank(stage, kind) not in (-1, self.stage_rank[stage])

    # -- constructors --------------------------------------------------------------------
    @staticmethod
    def chain(style: str, stage_rank: list[int] | tuple[int, ...], num_microbatches: int,
              num_ranks: int | None = None) -> "Topology":
        n = len(stage_rank)
        all_mbs = range(num_microbatches)
        return Topology(
            style=style,
            num_ranks=num_ranks if num_ranks is not None else (max(stage_rank) + 1 if n else 0),
            num_microbatches=num_microbatches,
            stage_rank=tuple(stage_rank),
            prev_stage=tuple(range(-1, n - 1)),
            next_stage=tuple(list(range(1, n)) + [-1]) if n else (),
            microbatches=(all_mbs,) * n,
            model_stage=tuple(range(n)),
        )

    @staticmethod
    def loop(num_ranks: int, num_stages: int, num_microbatches: int) -> "Topology":
        return Topology.chain("loop", [s % num_ranks for s in range(num_stages)], num_microbatches, num_ranks)

    @staticmethod
    def v(num_ranks: int, num_stages: int, num_microbatches: int) -> "Topology":
        if num_stages % num_ranks:
            raise ScheduleError(
                f"V placement needs a multiple of {num_ranks} stages (one per rank per leg), got {num_stages}")
        ranks = []
        for s in range(num_stages):
            leg, pos = divmod(s, num_ranks)
            ranks.append(pos if leg % 2 == 0 else num_ranks - 1 - pos)
        return Topology.chain("v", ranks, num_microbatches, num_ranks)

    @staticmethod
    def dualpipe(num_ranks: int, num_microbatches: int) -> "Topology":
        R, half = num_ranks, num_microbatches // 2
        down, up = range(half), range(half, num_microbatches)
        stage_rank = list(range(R)) + [R - 1 - j for j in range(R)]
        prev_stage = [-1] + list(range(R - 1)) + [-1] + list(range(R, 2 * R - 1))
        next_stage = list(range(1, R)) + [-1] + list(range(R + 1, 2 * R)) + [-1]
        return Topology(
            style="dualpipe",
            num_ranks=R,
            num_microbatches=num_microbatches,
            stage_rank=tuple(stage_rank),
            prev_stage=tuple(prev_stage),
            next_stage=tuple(next_stage),
            microbatches=(down,) * R + (up,) * R,
            model_stage=tuple(range(R)) * 2,
        )

    @staticmethod
    def from_style(style: str, num_ranks: int, num_stages: int, num_microbatches: int) -> "Topology":
        if style == "loop":
            return Topology.loop(num_ranks, num_stages, num_microbatches)
        if style == "v":
            return Topology.v(num_ranks, num_stages, num_microbatches)
        if style == "dualpipe":
            if num_stages != 2 * num_ranks:
                raise ScheduleError(f"dualpipe placement has 2 stages per rank: {2 * num_ranks} stages, got {num_stages}")
            return Topology.dualpipe(num_ranks, num_microbatches)
        raise ScheduleError(f"unknown placement {style!r}; use one of {PLACEMENTS[:3]} or a stage->rank mapping")
