"""zb_auto: a zero-bubble schedule built for given costs and a memory limit.

The generator is a list scheduler run on the simulator's own cost model: every rank, when it is
free, takes the action that keeps the pipeline moving, and the schedule is the order in which
ranks took their actions (so the simulator reproduces the generator's times exactly).

- A backward (I) or forward (F) whose input is there runs at once; which of the two goes first,
  and which of a rank's two stages, are policies.
- A forward needs room: a rank holds at most `memory_limit` activations (one per microbatch and
  stage, freed by the stage's W, the simulator's `peak_activations`). On a V a rank keeps one
  place for the second leg's forward, so the first leg cannot take it and deadlock the V.
- Weight gradients (W) wait: they run when the rank would otherwise idle, when memory is full, or
  at the end. A W that would delay an input about to arrive is run only if a policy allows it.

Several policies are tried and the shortest simulated makespan kept; on a V also the construction
in rounds of `v_rounds`, which sees when each input arrives. Every fixed schedule that fits the
memory limit is a candidate too (`builders.fixed_schedules`, scored by a replay of the simulator),
so under the costs it was given zb_auto is never worse than any of them. The list schedules are
tried within a budget of actions placed (`SEARCH_BUDGET`): all of them for a few hundred
actions (4 ranks x 8 microbatches x 2 stages), the first ones at 8 x 32 x 2, only the first
policy at 32 ranks x 2 stages x 256 microbatches. The budget counts actions, not seconds, so
every rank builds the same schedule from the same costs (bit for bit: give every rank the same
numbers rather than each its own measurement).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from pipecore.schedule.schedule import Schedule
from pipecore.schedule.topology import Topology
from pipecore.schedule.builders._codes import B, F, I, W, code
from pipecore.schedule.builders.v_rounds import Stuck, build_rounds
from pipecore.schedule.readiness import feeders, replay
from pipecore.schedule.simulate import cost_table, peak_activations


@dataclass(frozen=True)
class Policy:
    first: str  # an I and an F both ready: "backward" (1F1B), "forward" (fills faster), "alternate"
    pick: str  # a rank's two stages both ready: "deeper" (later in the chain) first, "shallower",
    # or "balanced": forwards deeper first, backwards on the stage with fewer done (deeper on ties)
    w_overrun: float  # an idle W may delay an arriving input by up to this share of W's cost
    reserve: bool  # on a V, the first leg's forward leaves room for the second's (never deadlocks)

    def __post_init__(self):
        if self.first not in ("backward", "forward", "alternate") or self.pick not in ("deeper", "shallower",
                                                                                         "balanced"):
            raise ValueError(f"unknown policy {self}")


# every policy, the ones that most often gave the shortest makespan over a grid of ranks,
# microbatches, costs and memory limits first (a search with a budget tries them in this order)
_RANKED = (Policy("alternate", "balanced", 1.0, False), Policy("forward", "deeper", 0.5, True),
           Policy("backward", "deeper", 0.5, True), Policy("alternate", "balanced", 0.0, True),
           Policy("forward", "balanced", 0.0, True), Policy("alternate", "deeper", 0.5, True),
           Policy("backward", "shallower", 0.5, True))
POLICIES = _RANKED + tuple(
    p for p in (Policy(f, d, o, v) for v in (True, False) for f in ("alternate", "backward", "forward")
                for d in ("balanced", "deeper", "shallower") for o in (0.0, 0.5, 1.0)) if p not in _RANKED)
# list-scheduling work (actions placed, over all policies tried) one zb_auto build may spend
SEARCH_BUDGET = 90_000
SLACK_ROUNDS = 3


def generate(topo: Topology, costs: dict[str, list[float]], memory_limit: int, policy: Policy,
             slack: list[float] | None = None):
    """Codes per rank, the makespan and each rank's idle time inside its span, for `policy`.
    `slack[r]`: how much rank r may delay arriving inputs in all to run W (it idles less than
    the most idle rank by that much)."""
    R, S, m = topo.num_ranks, topo.num_stages, topo.num_microbatches
    cf, ci, cw, comm = costs["F"], costs["I"], costs["W"], costs["comm"]
    prev, nxt = feeders(topo)  # whose output a stage's F and I wait for (the readiness rule)
    srank = topo.stage_rank
    local = [sorted(topo.rank_stages(r), reverse=policy.pick != "shallower") for r in range(R)]
    balanced = policy.pick == "balanced"
    # a V's first-leg forward keeps room for the second leg's
    first_leg = [policy.reserve and len(local[srank[s]]) > 1 and s == min(local[srank[s]]) for s in range(S)]
    fin_f = [-1.0] * (S * m)  # end of each (stage, microbatch)'s F / I; -1: not placed yet
    fin_i = [-1.0] * (S * m)
    nf = [0] * S
    ni = [0] * S
    clock = [0.0] * R
    live = [0] * R
    pend = [deque() for _ in range(R)]
    rows: list[list[int]] = [[] for _ in range(R)]
    left = [len(local[r]) * m * 3 for r in range(R)]
    waiting: dict[int, list[int]] = {}
    backward_kinds, forward_kinds = (I, F), (F, I)
    last_kind = [I] * R
    overrun = policy.w_overrun
    inf = float("inf")

    def ready_f(s):
        """(ready time or None if not yet known, lower bound) of stage s's next forward."""
        k = nf[s]
        p = prev[s]
        if p < 0:
            return 0.0, 0.0
        t = fin_f[p * m + k]
        extra = comm[s] if srank[p] != srank[s] else 0.0
        if t >= 0:
            return t + extra, t + extra
        return None, clock[srank[p]] + cf[p] + extra

    def ready_i(s):
        k = ni[s]
        n = nxt[s]
        own = fin_f[s * m + k]
        if n < 0:
            return own, own
        t = fin_i[n * m + k]
        extra = comm[s] if srank[n] != srank[s] else 0.0
        if t >= 0:
            return max(own, t + extra), max(own, t + extra)
        return None, max(own, clock[srank[n]] + ci[n] + extra)

    def run(r, c, start, dur):
        end = start + dur
        busy[r] += dur
        if first[r] is None:
            first[r] = start
        rows[r].append(c)
        clock[r] = end
        left[r] -= 1
        return end

    def run_w(r):  # the oldest pending weight gradient: it needs nothing but the rank
        s, k = pend[r].popleft()
        run(r, code(s, W, k), clock[r], cw[s])
        live[r] -= 1
        push(r, clock[r])

    stamp = [0] * R  # a rank's newest heap entry; older ones are stale
    used = [0.0] * R  # delay spent of its slack
    first = [None] * R
    busy = [0.0] * R

    def push(r, at):
        stamp[r] += 1
        heapq.heappush(heap, (at, stamp[r], r))

    def wake(key):
        for q in waiting.pop(key, ()):
            push(q, clock[q])

    heap = [(0.0, 0, r) for r in range(R)]
    while heap:
        at, st, r = heapq.heappop(heap)
        if st != stamp[r] or left[r] == 0:
            continue
        t = max(at, clock[r])
        now = soonest = None  # (kind, stage) ready at t by priority; (ready, kind, stage) first to come
        unknown_keys = []
        lower = inf
        if policy.first == "alternate":
            kinds = backward_kinds if last_kind[r] == F else forward_kinds
        else:
            kinds = backward_kinds if policy.first == "backward" else forward_kinds
        for kind in kinds:
            stages = local[r]
            if kind == I and balanced and len(stages) == 2 and ni[stages[1]] < ni[stages[0]]:
                stages = stages[::-1]
            for s in stages:
                if kind == F:
                    if nf[s] >= m:
                        continue
                    rt, lb = ready_f(s)
                    key = (prev[s] * m + nf[s]) * 2
                    if live[r] + (2 if first_leg[s] else 1) > memory_limit:
                        if not pend[r]:
                            continue  # room comes with a backward
                        kind_here = W  # when the forward is there, free some memory for it
                    else:
                        kind_here = F
                else:
                    if ni[s] >= nf[s]:
                        continue
                    rt, lb = ready_i(s)
                    key = (nxt[s] * m + ni[s]) * 2 + 1
                    kind_here = I
                if rt is None:
                    unknown_keys.append(key)
                    lower = min(lower, lb)
                elif rt <= t:
                    now = (kind_here, s)
                    break
                elif soonest is None or rt < soonest[0]:
                    soonest = (rt, kind_here, s)
            if now:
                break
        if now and now[0] == W:
            run_w(r)
            continue
        if now:
            kind, s = now
        else:
            arrival = min(soonest[0] if soonest else inf, lower)
            if pend[r]:
                wc = cw[pend[r][0][0]]
                late = t + wc - arrival
                if late <= overrun * wc or slack is not None and used[r] + late <= slack[r]:
                    if late > 0:
                        used[r] += late
                    run_w(r)
                    continue
            if soonest is None and not unknown_keys:
                raise Stuck(f"rank {r} has nothing to run at {t}")
            for key in unknown_keys:  # whichever comes first wakes the rank
                waiting.setdefault(key, []).append(r)
            if soonest is not None:
                push(r, soonest[0])
            continue
        last_kind[r] = kind
        if kind == F:
            k = nf[s]
            nf[s] += 1
            live[r] += 1
            end = run(r, code(s, F, k), t, cf[s])
            fin_f[s * m + k] = end
            wake((s * m + k) * 2)
        else:
            k = ni[s]
            ni[s] += 1
            end = run(r, code(s, I, k), t, ci[s])
            fin_i[s * m + k] = end
            pend[r].append((s, k))
            wake((s * m + k) * 2 + 1)
        push(r, clock[r])
    if any(left):
        raise Stuck(f"ranks {[r for r in range(R) if left[r]]} could not finish")
    idle = [clock[r] - (first[r] or 0.0) - busy[r] for r in range(R)]
    return rows, max(clock), idle


def check_memory_limit(R: int, V: int, memory_limit) -> int:
    if memory_limit is None:
        return R * V
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit < V:
        raise ValueError(
            f"memory_limit counts the activations a rank may hold (one per microbatch and stage, as "
            f"SimResult.peak_activations does): an integer of at least {V} for {V} stage(s) per rank; 1F1B's "
            f"is {R * V}; got {memory_limit!r}")
    return memory_limit


def _while_shorter(run, times: int, topo: Topology):
    """`run(idle)` -> (rows, makespan, idle per rank), run again with the idle of the run before
    while that shortens it, at most `times`: each result, None for a run that deadlocked."""
    idle = last = None
    for _ in range(times):
        try:
            rows, makespan, idle = run(idle)
        except Stuck:
            yield None
            return
        yield rows, makespan, topo
        if last is not None and makespan >= last:
            return
        last = makespan


def _policy_runs(topo, table, limit):
    """Policy after policy; again with slack: the least idle ranks may spend what they idled less
    than the most idle one to run W early."""
    for policy in POLICIES:
        yield from _while_shorter(
            lambda idle, policy=policy: generate(topo, table, limit, policy,
                                                 None if idle is None else [max(idle) - x for x in idle]),
            SLACK_ROUNDS, topo)


def _round_runs(topo, table, limit):
    """The V built in rounds (`v_rounds`), each way of filling; again with what each rank idled
    the time before."""
    for before_backward in (True, False):
        for before_forward in (True, False):
            for reserve in (True, False):
                yield from _while_shorter(
                    lambda idle, flags=(before_backward, before_forward, reserve): build_rounds(
                        topo, table, limit, *flags, approved=idle),
                    SLACK_ROUNDS + 1, topo)


def makespan(codes: list[list[int]], topo: Topology, table: dict[str, list[float]]) -> float:
    """The simulator's makespan (overlap "lockstep": a pair costs both halves) of a compute-only
    schedule, without its timeline. Raises Stuck when it deadlocks."""
    cost = {F: table["F"], I: table["I"], W: table["W"], B: table["B"]}
    # the candidates are built in a valid same-rank order: only what crosses stages is waited for
    run = replay(codes, topo, local=False, cost=cost, comm=table["comm"])
    if run.stuck(codes):
        raise Stuck("the schedule deadlocks")
    return max(run.clock, default=0.0)


def _fixed_runs(topo, table, limit, V, fixed_schedules):
    """Each of `fixed_schedules(R, m, V)` that fits `limit` (the registry's fixed schedules: on a V
    the loop-placed interleaved ones too, which win now and then, e.g. with slow forwards)."""
    for fixed in fixed_schedules(topo.num_ranks, topo.num_microbatches, V):
        if max(peak_activations(fixed.codes)) > limit:
            continue
        yield fixed.codes, makespan(fixed.codes, fixed.topology, table), fixed.topology


def search(topo: Topology, table: dict[str, list[float]], limit: int, V: int, fixed_schedules,
           budget: int = SEARCH_BUDGET):
    """The shortest of: every fixed schedule that fits `limit` (`fixed_schedules(R, m, V)` yields
    them), and the list schedules that fit
    `budget` (each run places every action once): the first policy, then the other policies and,
    on a V, the rounds taking turns; a run that would pass the budget is not started once there
    is a schedule. On a tie, `topo`'s placement wins."""
    best = None

    def keep(result):
        nonlocal best
        if result is not None and (best is None or (result[1], result[2].style != topo.style)
                                   < (best[1], best[2].style != topo.style)):
            best = result

    for result in _fixed_runs(topo, table, limit, V, fixed_schedules):
        keep(result)
    size = len(topo.stage_rank) * topo.num_microbatches * 3
    policies = _policy_runs(topo, table, limit)
    keep(next(policies))
    spent = size
    sources = ([_round_runs(topo, table, limit)] if V == 2 else []) + [policies]
    while sources and (best is None or spent + size <= budget):  # the sources take turns
        runs = sources.pop(0)
        result = next(runs, StopIteration)
        if result is StopIteration:
            continue
        sources.append(runs)
        spent += size
        keep(result)
    return best


def build_zb_auto(num_ranks: int, num_microbatches: int, stages_per_rank: int,
                  costs: Mapping[str, object] | None = None, memory_limit: int | None = None, *,
                  fixed_schedules) -> Schedule:
    """The fastest schedule found for `costs` within `memory_limit` (see the module's docstring),
    compared with `fixed_schedules(R, m, V)` (the registry passes them: it holds this builder).
    At 2 stages per rank it is a V, unless a loop-placed interleaved schedule simulates faster:
    its `placement` says which (a Pipeline places stages by it)."""
    R, m, V = num_ranks, num_microbatches, stages_per_rank
    limit = check_memory_limit(R, V, memory_limit)
    topo = Topology.loop(R, R, m) if V == 1 else Topology.v(R, 2 * R, m)
    best = search(topo, cost_table(costs, topo.num_stages), limit, V, fixed_schedules)
    if best is None:  # pragma: no cover - the policies that reserve room never deadlock
        raise ValueError(f"zb_auto found no schedule within memory_limit={limit}")
    return Schedule.from_codes(best[0], best[2], "zb_auto")


# ZB-H2's order: forwards and backwards as they come, W into the waits (2R-1 activations)
ZBH2_POLICY = Policy("alternate", "balanced", 1.0, False)


def build_zbh2(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    """ZB-H2 of "Zero Bubble Pipeline Parallelism" (Qi et al., 2024): a rank holds up to 2R-1
    activations, twice 1F1B's, to fill the warmup and cooldown; listed for F = I = W."""
    R, m = num_ranks, num_microbatches
    topo = Topology.loop(R, R, m)
    rows, _, _ = generate(topo, cost_table(None, R), 2 * R - 1, ZBH2_POLICY)
    return Schedule.from_codes(rows, topo, "zbh2")
