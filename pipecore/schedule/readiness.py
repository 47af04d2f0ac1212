"""The readiness rule: what a compute action waits for and what it marks done, and the one replay of
the ranks that runs a schedule by it. Lowering, validation, simulation and zb_auto's pricing use
these (the builders' list schedulers still decide it their own way while they place actions).

The rule, for microbatch k of stage s:

- F waits for the previous stage's F of k (its activations);
- I or B waits for its own F of k and for the input gradient of the next stage's k (its I or B);
- W waits for its own I (or B) of k.

An action is done when it ends: F marks its own code; I and B also mark their code with the kind bits
`GRAD_DONE`: the input gradient that the previous stage and the W wait for. In a lowered
program, data from another rank is ready when the producer's SEND ran (`lowered=True`); the replay
charges `comm` of the waiting stage for data that crosses ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipecore.schedule.action import STAGE_MASK, STAGE_SHIFT, Kind, leaf_codes

F, I, W, B = int(Kind.F), int(Kind.I), int(Kind.W), int(Kind.B)
SEND_F, RECV_F, SEND_B, RECV_B = int(Kind.SEND_F), int(Kind.RECV_F), int(Kind.SEND_B), int(Kind.RECV_B)
OVERLAP = int(Kind.OVERLAP_F_B)
GRAD_DONE = 0xF  # the kind bits of "the input gradient of (stage, microbatch) is done"
_KIND = 0xF


@dataclass(frozen=True)
class Links:
    """Per stage, the rule as code offsets (one addition per dependency on the hot paths)."""

    fwd_need: list[int | None]  # F: offset to the previous stage's F code (None: first stage)
    bwd_need: list[int | None]  # I/B: offset to the next stage's GRAD_DONE marker (None: last stage)
    fwd_peer: list[int]  # the rank the activations go to (-1: same rank or none)
    fwd_recv: list[int]  # offset from F to the peer's RECV_F code
    bwd_peer: list[int]  # the rank the input gradient goes to (-1: same rank or none)
    bwd_recv: list[int]  # offset from I/B to the peer's RECV_B code

    @classmethod
    def of(cls, topo) -> Links:
        stage_rank = topo.stage_rank
        fields: dict[str, list] = {k: [] for k in cls.__dataclass_fields__}
        for s, r in enumerate(stage_rank):
            p, n = topo.prev_stage[s], topo.next_stage[s]
            fields["fwd_need"].append(None if p < 0 else (p - s) << STAGE_SHIFT)
            fields["bwd_need"].append(None if n < 0 else ((n - s) << STAGE_SHIFT) + GRAD_DONE)
            cross_next = n >= 0 and stage_rank[n] != r
            fields["fwd_peer"].append(stage_rank[n] if cross_next else -1)
            fields["fwd_recv"].append(((n - s) << STAGE_SHIFT) + RECV_F if cross_next else 0)
            cross_prev = p >= 0 and stage_rank[p] != r
            fields["bwd_peer"].append(stage_rank[p] if cross_prev else -1)
            fields["bwd_recv"].append(((p - s) << STAGE_SHIFT) + RECV_B if cross_prev else 0)
        return cls(**fields)


def _dependencies(topo, lowered: bool, local: bool) -> dict[int, list[tuple]]:
    """Per compute kind, per stage: ((offset, kind bits of the awaited code, crosses ranks)...).
    `local=False` leaves out what the same rank's earlier actions provide (a schedule whose
    same-rank order is known to be right)."""
    rank, prev, nxt = topo.stage_rank, topo.prev_stage, topo.next_stage
    deps: dict[int, list[tuple]] = {F: [], I: [], B: [], W: []}
    for s in range(len(rank)):
        p, n = prev[s], nxt[s]
        f = []
        if p >= 0:
            cross = rank[p] != rank[s]
            f.append(((p - s) << STAGE_SHIFT, SEND_F if cross and lowered else F, cross))
        back = [(0, F, False)] if local else []
        if n >= 0:
            cross = rank[n] != rank[s]
            back.append(((n - s) << STAGE_SHIFT, SEND_B if cross and lowered else GRAD_DONE, cross))
        deps[F].append(tuple(f))
        deps[I].append(tuple(back))
        deps[B].append(tuple(back))
        deps[W].append(((0, GRAD_DONE, False),) if local else ())
    return deps


@dataclass
class Replay:
    """Where each rank got to, when it got there, and (if stuck) what it waits for."""

    pos: list[int]
    clock: list[float]
    blocked_on: dict[int, int]  # rank -> the code it last waited for (for the stuck ones: what they wait for)

    def stuck(self, codes: Sequence[Sequence[int]]) -> list[int]:
        return [r for r in range(len(codes)) if self.pos[r] < len(codes[r])]


def replay(codes: Sequence[Sequence[int]], topo, *, lowered: bool = False, local: bool = True,
           cost: dict[int, Sequence[float]] | None = None, pair: Callable[[float, float], float] | None = None,
           comm: Sequence[float] | None = None,
           on_action: Callable[[int, int, float, float], None] | None = None) -> Replay:
    """Run `codes` by the rule: ranks in turn run every action whose inputs are done, until all are
    done or none can move. `cost[kind][stage]` prices an action (kinds it lacks take no time; an
    OVERLAP_F_B pair costs `pair(forward, backward)`, or both halves); data that crosses ranks
    arrives `comm[waiting stage]` after its producer ends; `on_action(rank, code, start, end)` sees
    each action as it runs. Actions other than F, I, W and B wait for nothing."""
    deps = _dependencies(topo, lowered, local)
    cost = cost or {}
    R = len(codes)
    end: dict[int, float] = {}
    pos, clock = [0] * R, [0.0] * R
    blocked: dict[int, int] = {}
    active = [r for r in range(R) if codes[r]]
    while active:
        moved = False
        for r in active:
            row, p, t = codes[r], pos[r], clock[r]
            n = len(row)
            while p < n:
                c = row[p]
                kind = c & _KIND
                leaves = leaf_codes(c) if kind == OVERLAP else (c,)
                start, need = t, -1
                for lc in leaves:
                    table = deps.get(lc & _KIND)
                    if table is None:
                        continue
                    s = (lc >> STAGE_SHIFT) & STAGE_MASK
                    base = lc & ~_KIND
                    for offset, awaited, cross in table[s]:
                        key = (base + offset) | awaited
                        e = end.get(key)
                        if e is None:
                            need = key
                            break
                        if cross and comm is not None:
                            e += comm[s]
                        if e > start:
                            start = e
                    if need >= 0:
                        break
                if need >= 0:
                    blocked[r] = need
                    break
                if kind == OVERLAP:
                    parts = [cost[lc & _KIND][(lc >> STAGE_SHIFT) & STAGE_MASK] if lc & _KIND in cost else 0.0
                             for lc in leaves]
                    fwd = sum(d for d, lc in zip(parts, leaves) if lc & _KIND == F)
                    t = start + (pair(fwd, sum(parts) - fwd) if pair is not None else sum(parts))
                else:
                    per_stage = cost.get(kind)
                    t = start + per_stage[(c >> STAGE_SHIFT) & STAGE_MASK] if per_stage is not None else start
                for lc in leaves:
                    end[lc] = t
                    if lc & _KIND == I or lc & _KIND == B:
                        end[(lc & ~_KIND) | GRAD_DONE] = t
                if on_action is not None:
                    on_action(r, c, start, t)
                p += 1
            if p != pos[r]:
                moved = True
                pos[r], clock[r] = p, t
        if not moved:
            break
        active = [r for r in active if pos[r] < len(codes[r])]
    return Replay(pos, clock, blocked)
