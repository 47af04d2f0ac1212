"""The readiness rule: what a compute action waits for and what it marks done, and the one replay of
the ranks that runs a schedule by it. Lowering, validation, simulation, zb_auto's pricing and the
builders that place actions one by one (zb_auto's list scheduler, v_rounds, v_half/v_min) all read
the rule from here; `inputs()` states it, and everything else here is derived from it.

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

from pipecore.schedule.action import KIND_MASK, STAGE_MASK, STAGE_SHIFT, Kind, leaf_codes, microbatch_of, stage_of

F, I, W, B = int(Kind.F), int(Kind.I), int(Kind.W), int(Kind.B)
SEND_F, RECV_F, SEND_B, RECV_B = int(Kind.SEND_F), int(Kind.RECV_F), int(Kind.SEND_B), int(Kind.RECV_B)
OVERLAP = int(Kind.OVERLAP_F_B)
WAIT_SEND_F, WAIT_SEND_B = int(Kind.WAIT_SEND_F), int(Kind.WAIT_SEND_B)
GRAD_DONE = KIND_MASK  # the kind bits of "the input gradient of (stage, microbatch) is done": no Kind has them


def inputs(c: int, topo, grad: int = GRAD_DONE) -> tuple[int, ...]:
    """The codes compute action `c` (F, I, B or W) waits for: the rule, stated once. The input
    gradient a stage's I/B and W wait for is named by `grad`: the `GRAD_DONE` marker that I and B
    both set (replay, lowering), or the kind a builder places (I, when it places no B)."""
    kind, s = c & KIND_MASK, (c >> STAGE_SHIFT) & STAGE_MASK
    base = c & ~KIND_MASK
    if kind == F:
        p = topo.prev_stage[s]
        return () if p < 0 else ((base + ((p - s) << STAGE_SHIFT)) | F,)
    if kind == W:
        return (base | grad,)
    n = topo.next_stage[s]
    return (base | F,) if n < 0 else (base | F, (base + ((n - s) << STAGE_SHIFT)) | grad)


def feeders(topo) -> tuple[list[int], list[int]]:
    """Per stage s: the stage whose F output s's F waits for, and the stage whose input gradient s's
    I/B waits for (-1: none). `inputs()` for list schedulers that keep their times in flat arrays."""
    forward, backward = [], []
    for s in range(topo.num_stages):
        for kind, out in ((F, forward), (I, backward)):
            others = [d for d in inputs((s << STAGE_SHIFT) | kind, topo) if (d >> STAGE_SHIFT) & STAGE_MASK != s]
            out.append((others[0] >> STAGE_SHIFT) & STAGE_MASK if others else -1)
    return forward, backward


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
        deps = _dependencies(topo, lowered=False, local=False)
        fields: dict[str, list] = {k: [] for k in cls.__dataclass_fields__}
        for s in range(topo.num_stages):
            fields["fwd_need"].append(deps[F][s][0][0] if deps[F][s] else None)
            fields["bwd_need"].append(deps[I][s][0][0] + GRAD_DONE if deps[I][s] else None)
            for send, recv, peer, offset in ((SEND_F, RECV_F, "fwd_peer", "fwd_recv"),
                                             (SEND_B, RECV_B, "bwd_peer", "bwd_recv")):
                crosses = topo.crosses_ranks(s, send)
                fields[peer].append(topo.peer_rank(s, send) if crosses else -1)
                fields[offset].append(((topo.peer_stage(s, send) - s) << STAGE_SHIFT) + recv if crosses else 0)
        return cls(**fields)


def _dependencies(topo, lowered: bool, local: bool) -> dict[int, list[tuple]]:
    """`inputs()` as a table, per compute kind, per stage: ((offset from the action's code, kind bits
    of the awaited code, crosses ranks)...); `lowered`: data from another rank is awaited at its SEND.
    `local=False` leaves out what the same rank's earlier actions provide (a schedule whose
    same-rank order is known to be right)."""
    rank = topo.stage_rank
    sent = {F: SEND_F, GRAD_DONE: SEND_B}
    deps: dict[int, list[tuple]] = {F: [], I: [], B: [], W: []}
    for kind, table in deps.items():
        for s in range(len(rank)):
            c = (s << STAGE_SHIFT) | kind  # microbatch bits cancel out in the offsets
            row = []
            for d in inputs(c, topo):
                d_stage, awaited = (d >> STAGE_SHIFT) & STAGE_MASK, d & KIND_MASK
                cross = rank[d_stage] != rank[s]
                if d_stage == s and not local:
                    continue
                offset = (d & ~KIND_MASK) - (c & ~KIND_MASK)
                row.append((offset, sent[awaited] if cross and lowered else awaited, cross))
            table.append(tuple(row))
    if lowered:  # torch 2.15's send waits: until the peer has posted the matching receive
        for wait, send, recv in ((WAIT_SEND_F, SEND_F, RECV_F), (WAIT_SEND_B, SEND_B, RECV_B)):
            deps[wait] = [(((topo.peer_stage(s, send) - s) << STAGE_SHIFT, recv, True),)
                          if topo.crosses_ranks(s, send) else () for s in range(len(rank))]
    return deps


@dataclass
class Replay:
    """Where each rank got to, when it got there, and (if stuck) what it waits for."""

    pos: list[int]
    clock: list[float]
    blocked_on: dict[int, int]  # rank -> the code it last waited for (for the stuck ones: what they wait for)

    def stuck(self, codes: Sequence[Sequence[int]]) -> list[int]:
        return [r for r in range(len(codes)) if self.pos[r] < len(codes[r])]


def _price(per_stage, code: int) -> float:
    """One action's cost: a number per stage, or a function of (stage, microbatch)."""
    if per_stage is None:
        return 0.0
    if callable(per_stage):
        return per_stage(stage_of(code), microbatch_of(code))
    return per_stage[stage_of(code)]


def replay(codes: Sequence[Sequence[int]], topo, *, lowered: bool = False, local: bool = True,
           cost: dict[int, Sequence[float]] | None = None, pair: Callable[[float, float], float] | None = None,
           comm: Sequence[float] | None = None,
           on_action: Callable[[int, int, float, float], None] | None = None) -> Replay:
    """Run `codes` by the rule: ranks in turn run every action whose inputs are done, until all are
    done or none can move. `cost[kind][stage]`, or `cost[kind](stage, microbatch)`, prices an action
    (kinds it lacks take no time; an OVERLAP_F_B pair costs `pair(forward, backward)`, or both
    halves); data that crosses ranks arrives `comm[waiting stage]` after its producer ends;
    `on_action(rank, code, start, end)` sees each action as it runs. Actions other than F, I, W and B
    wait for nothing."""
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
                kind = c & KIND_MASK
                leaves = leaf_codes(c) if kind == OVERLAP else (c,)
                start, need = t, -1
                for lc in leaves:
                    table = deps.get(lc & KIND_MASK)
                    if table is None:
                        continue
                    s = (lc >> STAGE_SHIFT) & STAGE_MASK
                    base = lc & ~KIND_MASK
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
                    parts = [_price(cost.get(lc & KIND_MASK), lc) for lc in leaves]
                    fwd = sum(d for d, lc in zip(parts, leaves) if lc & KIND_MASK == F)
                    t = start + (pair(fwd, sum(parts) - fwd) if pair is not None else sum(parts))
                else:
                    t = start + _price(cost.get(kind), c)
                for lc in leaves:
                    end[lc] = t
                    if lc & KIND_MASK == I or lc & KIND_MASK == B:
                        end[(lc & ~KIND_MASK) | GRAD_DONE] = t
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
