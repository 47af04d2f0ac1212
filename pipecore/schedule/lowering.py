"""Lowering passes: from a compute-only schedule to the one the executor runs.

All passes work on integer action codes (see action.py) so that lowering a pp=32 x 2 stages x
256 microbatch schedule takes milliseconds.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from contextlib import contextmanager

from pipecore.schedule.action import (COMPUTE_KINDS, KIND_MASK, STAGE_MASK, STAGE_SHIFT, Kind, decode, encode,
                                      leaf_codes, microbatch_of, stage_of)
from pipecore.schedule.errors import ScheduleError
from pipecore.schedule.readiness import GRAD_DONE, Links

F, I, W, B = int(Kind.F), int(Kind.I), int(Kind.W), int(Kind.B)
SEND_F, RECV_F, SEND_B, RECV_B = int(Kind.SEND_F), int(Kind.RECV_F), int(Kind.SEND_B), int(Kind.RECV_B)
UNSHARD, RESHARD, REDUCE_GRAD, OVERLAP = int(Kind.UNSHARD), int(Kind.RESHARD), int(Kind.REDUCE_GRAD), int(Kind.OVERLAP_F_B)
WAIT_SEND_F, WAIT_SEND_B, WAIT_REDUCE_GRAD = int(Kind.WAIT_SEND_F), int(Kind.WAIT_SEND_B), int(Kind.WAIT_REDUCE_GRAD)


def lower(schedule, *, merge_iw: bool = True, reduce_grad: bool = True,
          sharded: Iterable[int] | bool = (), max_active_stages: int = 3, unshard_lookahead: int | None = None,
          waits: bool = False, defer_reduce_grad_wait: bool = False):
    with gc_paused():
        lowered = _lower(schedule, merge_iw, reduce_grad, sharded, max_active_stages, unshard_lookahead)
        if waits:
            lowered = type(lowered).from_codes([add_waits(row, defer_reduce_grad_wait) for row in lowered.codes],
                                               lowered.topology, lowered.name)
        return lowered


@contextmanager
def gc_paused():
    """Pause the cyclic GC: lowering allocates many small lists but never cycles, and collections
    triggered by those allocations cost more than the pass itself."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _lower(schedule, merge_iw, reduce_grad, sharded, max_active_stages, unshard_lookahead):
    topo = schedule.topology
    codes = schedule.compute_only().codes
    if merge_iw:
        awaited = input_grad_awaited(topo)
        codes = [merge_adjacent_iw(row, awaited) for row in codes]
    if sharded is True:
        sharded = range(topo.num_stages)
    sharded = frozenset(sharded or ())
    bad = [s for s in sharded if not 0 <= s < topo.num_stages]
    if bad:
        raise ScheduleError(f"sharded stages {bad} do not exist: stages are 0..{topo.num_stages - 1}")
    if sharded:
        codes = [add_unshard_reshard(row, sharded, max_active_stages, unshard_lookahead) for row in codes]
    if reduce_grad and any((c & KIND_MASK) in (I, W, B, OVERLAP) for row in codes for c in row):
        codes = [add_reduce_grad(row, len(topo.rank_stages(r))) for r, row in enumerate(codes)]
    codes = add_send_recv(codes, topo)
    return type(schedule).from_codes(codes, topo, schedule.name)


def input_grad_awaited(topo) -> frozenset[int]:
    """Stages whose input gradient another rank waits for: their previous stage lives elsewhere."""
    return frozenset(s for s in range(topo.num_stages) if topo.crosses_ranks(s, Kind.SEND_B))


def merge_adjacent_iw(row: list[int], keep_split: frozenset[int]) -> list[int]:
    """I followed directly by W of the same stage and microbatch becomes one full B (one engine
    call instead of two), except for the stages in `keep_split`: there another rank waits for the
    input gradient, which a B would send only once the weight gradients are done too. Merging
    elsewhere leaves the schedule's timing as it is: nothing waits for the I before the W ends."""
    out: list[int] = []
    append = out.append
    n, k = len(row), 0
    while k < n:
        c = row[k]
        if (c & KIND_MASK == I and k + 1 < n and row[k + 1] == c + 1  # W code = I code + 1
                and stage_of(c) not in keep_split):
            append(c + 2)  # B code = I code + 2
            k += 2
        else:
            append(c)
            k += 1
    return out


def add_reduce_grad(row: list[int], num_stages: int | None = None) -> list[int]:
    """REDUCE_GRAD for a stage right after its last weight-gradient action (B or W). With the number
    of stages the row's rank holds, the backward scan stops once each has been found."""
    last: dict[int, int] = {}  # stage -> index of its last B/W in this row
    for idx in range(len(row) - 1, -1, -1):
        if len(last) == num_stages:
            break
        c = row[idx]
        kind = c & KIND_MASK
        if kind == B or kind == W:
            stage = stage_of(c)
            if stage not in last:
                last[stage] = idx
        elif kind == OVERLAP:
            for leaf in leaf_codes(c):
                if leaf & KIND_MASK in (B, W):
                    last.setdefault(stage_of(leaf), idx)
    if not last:
        return list(row)
    at: dict[int, list[int]] = {}
    for stage, idx in last.items():
        at.setdefault(idx, []).append(REDUCE_GRAD | (stage << STAGE_SHIFT))
    out: list[int] = []
    prev = 0
    for idx in sorted(at):
        out.extend(row[prev:idx + 1])
        out.extend(sorted(at[idx]))
        prev = idx + 1
    out.extend(row[prev:])
    return out


def check_residency(max_active: int, lookahead: int | None, name: str = "unshard_lookahead") -> int:
    """The FSDP2 residency options checked (ScheduleError, a ValueError): at most `max_active` stages
    unsharded, `lookahead` (default: all of them) fetched ahead; returns the lookahead. `name`: how the
    error names the lookahead (one entry of torch's per-rank tuple names its index)."""
    if isinstance(max_active, bool) or not isinstance(max_active, int) or max_active < 1:
        raise ScheduleError(f"max_active_stages must be a positive integer (FSDP2 stages unsharded at once), got "
                            f"{max_active!r}")
    lookahead = max_active if lookahead is None else lookahead
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or not 1 <= lookahead <= max_active:
        raise ScheduleError(f"{name} must be an integer within [1, max_active_stages={max_active}] "
                            f"(FSDP2 stages all-gathered ahead), got {lookahead!r}")
    return lookahead


def add_unshard_reshard(row: list[int], sharded: frozenset[int], max_active: int,
                        lookahead: int | None = None) -> list[int]:
    """Keep at most `max_active` sharded stages unsharded (RESHARD when a stage is not among the next
    `max_active` the rank computes), and UNSHARD the next `lookahead` of them ahead of use (default:
    `max_active`; torch 2.15's unshard_lookahead: fewer all-gathers in flight, each issued later).
    Every stage is unsharded before it computes: the stage computing now is always the next one.
    Only compute actions count and move the window: a lowered row's sends, receives and REDUCE_GRADs
    are kept where they are, so a lowered row gets the UNSHARDs and RESHARDs its compute-only row gets
    (torch's _add_unshard_reshard, which sees compute actions only)."""
    lookahead = check_residency(max_active, lookahead)
    stages_at = [[stage_of(leaf) for leaf in leaf_codes(c)] if c & KIND_MASK in COMPUTE_KINDS else None for c in row]

    def upcoming(k: int, count: int) -> list[int]:
        """The next `count` sharded stages the row computes from step k (whole steps: an OVERLAP_F_B
        pair's stages all count, even past `count`)."""
        found: list[int] = []
        for stages in stages_at[k:]:
            if stages is None:
                continue
            for s in stages:
                if s in sharded and s not in found:
                    found.append(s)
            if len(found) >= count:
                break
        return found

    out: list[int] = []
    active: list[int] = []
    for k, c in enumerate(row):
        if stages_at[k] is None:
            out.append(c)
            continue
        now = {s for s in stages_at[k] if s in sharded}
        if len(now) > max_active:
            raise ScheduleError(f"{decode(c)} computes {len(now)} sharded stages at once, more than "
                                f"max_active_stages={max_active}: allow at least that many")
        resident = upcoming(k, max_active)
        for s in [s for s in active if s not in resident]:
            active.remove(s)
            out.append(RESHARD | (s << STAGE_SHIFT))
        for s in resident if lookahead == max_active else upcoming(k, lookahead):
            if s not in active:
                active.append(s)
                out.append(UNSHARD | (s << STAGE_SHIFT))
        out.append(c)
    for s in active:
        out.append(RESHARD | (s << STAGE_SHIFT))
    return out


def add_waits(row: list[int], defer_reduce_grad_wait: bool = False) -> list[int]:
    """torch 2.15's explicit waits in a lowered row (its `_add_wait_send` and `_add_reduce_grad`
    rules), for schedules handed to torch or written for it: WAIT_SEND_F of (stage, microbatch)
    right after that stage's backward of the microbatch (the peer has consumed the activation by
    then), every other send's wait at the row's end, in sending order; WAIT_REDUCE_GRAD right after
    its REDUCE_GRAD, or, deferred, before the next REDUCE_GRAD and at the end (one reduction
    pending at a time). pipecore's executor needs none of them (docs/schedules.md, "Waits")."""
    out: list[int] = []
    pending: dict[int, None] = {}  # the sends not waited for, as their wait's code, in sending order
    deferred = -1
    for c in row:
        kind = c & KIND_MASK
        if kind == REDUCE_GRAD and defer_reduce_grad_wait and deferred >= 0:
            out.append(deferred)
        out.append(c)
        if kind == SEND_F or kind == SEND_B:
            pending[(c & ~KIND_MASK) | (WAIT_SEND_F if kind == SEND_F else WAIT_SEND_B)] = None
        elif kind == REDUCE_GRAD:
            wait = (c & ~KIND_MASK) | WAIT_REDUCE_GRAD
            if defer_reduce_grad_wait:
                deferred = wait
            else:
                out.append(wait)
        for leaf in leaf_codes(c):
            if leaf & KIND_MASK in (B, I):
                wait = (leaf & ~KIND_MASK) | WAIT_SEND_F
                if wait in pending:
                    del pending[wait]
                    out.append(wait)
    if deferred >= 0:  # (before the sends' waits, as torch: its reductions are placed before its sends)
        out.append(deferred)
    out.extend(pending)
    return out


def add_send_recv(codes: list[list[int]], topo) -> list[list[int]]:
    """Insert SEND_*/RECV_* between stages on different ranks.

    Ranks advance in lock-step rounds (one step per rank per round; a blocked rank sleeps until the
    action it needs is done). When an action produces data for another rank, its SEND goes right
    after it and the matching RECV is appended to the peer's list at that moment. The result is one
    global order in which every SEND is directly followed by its RECV, so it cannot deadlock, even
    with rendezvous (blocking) sends, and both ends of every channel see the same message order.
    """
    return _add_send_recv_python(codes, Links.of(topo))


def _add_send_recv_python(codes: list[list[int]], links) -> list[list[int]]:
    num_ranks = len(codes)
    # done markers (readiness.py): an F's own code once it ran, grad_done(code) once an I or B ran
    fwd_need, fwd_peer, fwd_recv = links.fwd_need, links.fwd_peer, links.fwd_recv
    bwd_need, bwd_peer, bwd_recv = links.bwd_need, links.bwd_peer, links.bwd_recv
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    pos = [0] * num_ranks
    lengths = [len(row) for row in codes]
    done: set[int] = set()
    waiting: dict[int, list[int]] = {}
    blocked: dict[int, int] = {}
    current = [r for r in range(num_ranks) if lengths[r]]
    smask = STAGE_MASK
    base_mask = ~KIND_MASK  # a code without its kind

    def wait(r: int, need: int) -> None:
        w = waiting.get(need)
        if w is None:
            waiting[need] = [r]
        else:
            w.append(r)
        blocked[r] = need

    while current:
        woken: list[int] = []
        for r in current:
            p = pos[r]
            c = codes[r][p]
            kind = c & KIND_MASK
            s = (c >> STAGE_SHIFT) & smask
            # the common single actions inline; containers take the general path below
            if kind == F:
                d = fwd_need[s]
                if d is not None and c + d not in done:
                    wait(r, c + d)
                    continue
                dst = out[r]
                dst.append(c)
                peer = fwd_peer[s]
                if peer >= 0:
                    dst.append(c | SEND_F)
                    out[peer].append(c + fwd_recv[s])
                mark = c
                done.add(mark)
                if mark in waiting:
                    woken.extend(waiting.pop(mark))
            elif kind == B or kind == I:
                base = c & base_mask
                if base not in done:
                    wait(r, base)
                    continue
                d = bwd_need[s]
                if d is not None and base + d not in done:
                    wait(r, base + d)
                    continue
                dst = out[r]
                dst.append(c)
                peer = bwd_peer[s]
                if peer >= 0:
                    dst.append(base | SEND_B)
                    out[peer].append(base + bwd_recv[s])
                mark = base | GRAD_DONE
                done.add(mark)
                if mark in waiting:
                    woken.extend(waiting.pop(mark))
            elif kind == W:  # nothing waits for a W: no marker
                base = c & base_mask
                if base | GRAD_DONE not in done:
                    wait(r, base | GRAD_DONE)
                    continue
                out[r].append(c)
            elif kind == OVERLAP:
                leaves = leaf_codes(c)
                need = 0
                for leaf in leaves:
                    lk, ls, base = leaf & KIND_MASK, (leaf >> STAGE_SHIFT) & smask, leaf & base_mask
                    if lk == F:
                        d = fwd_need[ls]
                        if d is not None and leaf + d not in done:
                            need = leaf + d
                    elif lk == W:
                        if base | GRAD_DONE not in done:
                            need = base | GRAD_DONE
                    elif base not in done:
                        need = base
                    elif bwd_need[ls] is not None and base + bwd_need[ls] not in done:
                        need = base + bwd_need[ls]
                    if need:
                        break
                if need:
                    wait(r, need)
                    continue
                dst = out[r]
                dst.append(c)
                for leaf in leaves:
                    lk, ls, base = leaf & KIND_MASK, (leaf >> STAGE_SHIFT) & smask, leaf & base_mask
                    if lk == F:
                        mark = base
                        if fwd_peer[ls] >= 0:
                            dst.append(base | SEND_F)
                            out[fwd_peer[ls]].append(base + fwd_recv[ls])
                    elif lk == W:
                        continue
                    else:
                        mark = base | GRAD_DONE
                        if bwd_peer[ls] >= 0:
                            dst.append(base | SEND_B)
                            out[bwd_peer[ls]].append(base + bwd_recv[ls])
                    done.add(mark)
                    if mark in waiting:
                        woken.extend(waiting.pop(mark))
            else:  # REDUCE_GRAD, UNSHARD, RESHARD: never wait
                out[r].append(c)
            p += 1
            pos[r] = p
            if p < lengths[r]:
                woken.append(r)
        current = woken
    stuck = [r for r in range(num_ranks) if pos[r] < lengths[r]]
    if stuck:
        _raise_deadlock(codes, [(r, pos[r]) for r in stuck], blocked)
    return out


def _raise_deadlock(codes, stuck, blocked) -> None:
    lines = [f"rank {r}, step {p}, action {decode(codes[r][p])} waits for {_describe_key(blocked[r])}"
             for r, p in stuck]
    raise ScheduleError("schedule deadlocks, cannot insert communication:\n  " + "\n  ".join(lines)
                        + "\nrun schedule.validate() for the full diagnosis")


def _describe_key(key: int) -> str:
    kind = "I/B" if key & KIND_MASK == GRAD_DONE else "F"
    return f"{stage_of(key)}{kind}{microbatch_of(key)}"


__all__ = ["lower", "merge_adjacent_iw", "input_grad_awaited", "add_reduce_grad", "add_unshard_reshard",
           "add_waits", "check_residency", "add_send_recv", "leaf_codes", "encode"]
