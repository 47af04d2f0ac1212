"""A V schedule built in rounds: every rank runs one backward, then one forward, per round.

The list scheduler of `auto` decides when a rank is free, seeing only the inputs already placed.
Here the ranks take turns in the order the data flows, so every input of an action is placed
before the action, and a rank knows exactly how long it would idle before it: it fills that wait
with weight gradients (W) that fit, and runs one more W (delaying the input's consumer) only
when idling would make it the most idle rank so far. Run again with what each rank idled the
first time, ranks that idled less may delay more (the idea of sail-sg's ZB-V heuristic).

Rank r holds the down stage r and the up stage 2R-1-r. Warm-up: microbatch 0 goes down and up
the V; while a rank waits for it to come back up, it and the ranks before it take more
microbatches down, within the memory limit (keeping room for what will come back up). Then
rounds: a backward on each rank (the up stage's first, unless the down stage is behind), then
a forward (the up stage's when its input is there, else the down stage's).
"""

from __future__ import annotations

from collections import deque

from pipecore.schedule.action import stage_of
from pipecore.schedule.readiness import inputs
from pipecore.schedule.topology import Topology
from pipecore.schedule.builders._codes import F, I, W, code


class Stuck(Exception):
    """A placement that cannot go on (a round placed nothing, an input never placed): raised by the
    rounds here and by zb_auto's list scheduler, whose search drops that candidate."""


def build_rounds(topo: Topology, costs: dict[str, list[float]], memory_limit: int,
                 fill_before_backward: bool, fill_before_forward: bool, reserve: bool = True,
                 approved: list[float] | None = None):
    """(codes per rank, makespan, idle per rank)."""
    R, m = topo.num_ranks, topo.num_microbatches
    S = 2 * R
    cf, ci, cw, comm = costs["F"], costs["I"], costs["W"], costs["comm"]
    down = list(range(R))
    up = [S - 1 - r for r in range(R)]
    end: dict[int, float] = {}
    clock = [0.0] * R
    idle = [0.0] * R
    started = [False] * R
    live = [0] * R
    pend = [deque() for _ in range(R)]
    rows: list[list[int]] = [[] for _ in range(R)]
    count = {}  # (kind, stage) -> microbatches placed
    most_approved = max(approved) if approved else 0.0

    def n(kind, s):
        return count.get((kind, s), 0)

    # the readiness rule per (kind, stage): (offset to an input's code, whether it crosses ranks)
    needs = {(kind, s): [(d - code(s, kind, 0), topo.stage_rank[stage_of(d)] != topo.stage_rank[s])
                         for d in inputs(code(s, kind, 0), topo, grad=I)] for kind in (F, I) for s in range(S)}

    def ready(kind, s, k):
        """When (kind, stage s, microbatch k)'s inputs are there; None if a producer is not placed."""
        c, t = code(s, kind, k), 0.0
        for offset, cross in needs[(kind, s)]:
            e = end.get(c + offset)
            if e is None:
                return None
            t = max(t, e + comm[s] if cross else e)
        return t

    def put(r, kind, s):
        k = n(kind, s)
        t = ready(kind, s, k)
        if t is None:
            raise Stuck(f"input of {kind} on stage {s} microbatch {k} not placed")
        start = max(clock[r], t)
        if started[r]:
            idle[r] += start - clock[r]
        started[r] = True
        dur = (cf if kind == F else ci)[s]
        c = code(s, kind, k)
        rows[r].append(c)
        clock[r] = end[c] = start + dur
        count[(kind, s)] = k + 1
        if kind == F:
            live[r] += 1
        else:
            pend[r].append(c - I + W)

    def put_w(r):
        c = pend[r].popleft()
        s = stage_of(c)
        rows[r].append(c)
        clock[r] += cw[s]
        live[r] -= 1

    def most_idle(r):
        worst = max(idle)
        if approved:
            worst = max(worst, most_approved - approved[r])
        return worst

    def fill(r, arrival, allowed):
        """Weight gradients into rank r's wait for `arrival`; one more if idling would make it the
        most idle rank (and `allowed`)."""
        while pend[r] and clock[r] + cw[stage_of(pend[r][0])] <= arrival:
            put_w(r)
        if pend[r] and allowed and arrival - clock[r] > most_idle(r) - idle[r]:
            put_w(r)

    # warm-up: microbatch 0 down the V, then up; meanwhile more microbatches down
    for r in range(R):
        put(r, F, down[r])
    for r in range(R - 1, -1, -1):
        if r < R - 1:
            back = end[code(up[r + 1], F, 0)] + comm[up[r]]
            while (live[r] + 2 + 2 * r <= memory_limit and clock[r] + cf[down[r]] <= back
                   and n(F, down[r]) < m):
                for j in range(r + 1):
                    k = n(F, down[j])
                    if k < m and live[j] + 2 <= memory_limit and ready(F, down[j], k) is not None:
                        put(j, F, down[j])
                if n(F, down[r]) == k:  # rank r could not take one more: its input did not come
                    break
        put(r, F, up[r])
    leg = 0
    for r in range(1, R):
        while ((n(F, down[r]) + n(F, up[r]) < n(F, down[r - 1]) + n(F, up[r - 1]))
               or n(F, up[r]) <= n(F, up[r - 1]) < m):
            progressed = False
            for j in range(R - 1, r - 1, -1):
                s = (down if leg == 0 else up)[j]
                k = n(F, s)
                if k < m and ready(F, s, k) is not None and live[j] + (2 if leg == 0 else 1) <= memory_limit:
                    put(j, F, s)
                    progressed = True
            leg = 1 - leg
            if not progressed and leg == 0:
                break

    # rounds: a backward, then a forward, on every rank
    while any(n(k, s) < m for k in (F, I) for s in range(S)):
        before = sum(len(row) for row in rows)
        first_up, first_down = [], []
        for r in range(R):
            nu, nd = n(I, up[r]), n(I, down[r])
            if nu >= m and nd >= m:
                continue
            if nd >= nu or nd >= m:
                first_up.append(r)
            elif r == R - 1 or ready(I, down[r], nd) is not None or nu >= m:
                first_down.append(r)
            else:
                first_up.append(r)
        for r, s in [(r, down[r]) for r in reversed(first_down)] + [(r, up[r]) for r in first_up]:
            k = n(I, s)
            if k >= n(F, s):
                continue
            t = ready(I, s, k)
            if t is None:
                continue
            fill(r, t, fill_before_backward or s == down[r])
            put(r, I, s)
        for r in range(R):
            nd, nu = n(F, down[r]), n(F, up[r])
            if nu >= m:
                continue
            choice = None
            if nu >= nd:
                choice = down[r] if nd < m else None
            elif r == R - 1 or ready(F, up[r], nu) is not None:
                choice = up[r]
            elif nd < m and ready(F, down[r], nd) is not None:
                choice = down[r]
            if choice is None or ready(F, choice, n(F, choice)) is None:
                continue
            need = 2 if choice == down[r] and reserve else 1
            while live[r] + need > memory_limit and pend[r]:
                put_w(r)
            if live[r] + need > memory_limit:
                continue  # room comes with this rank's next backward
            fill(r, ready(F, choice, n(F, choice)), fill_before_forward)
            put(r, F, choice)
        if sum(len(row) for row in rows) == before:
            raise Stuck("a round placed nothing")
    for r in range(R):
        while pend[r]:
            put_w(r)
    return rows, max(clock), idle
