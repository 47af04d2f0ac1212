"""The schedule validator: placement, completeness, order, communication and deadlock freedom.

Every error names the rank, the step (index in that rank's list) and the action, and shows the
timeline around it.
"""

from __future__ import annotations

from pipecore.schedule.action import (KIND_MASK, MB_SHIFT, STAGE_MASK, STAGE_SHIFT, Kind, decode, leaf_codes,
                                      microbatch_of, stage_of)
from pipecore.schedule.errors import ScheduleError
from pipecore.schedule.readiness import GRAD_DONE, replay
from pipecore.schedule.timeline import format_table

F, I, W, B = int(Kind.F), int(Kind.I), int(Kind.W), int(Kind.B)
SEND_F, RECV_F, SEND_B, RECV_B = int(Kind.SEND_F), int(Kind.RECV_F), int(Kind.SEND_B), int(Kind.RECV_B)
UNSHARD, RESHARD, REDUCE_GRAD, OVERLAP = int(Kind.UNSHARD), int(Kind.RESHARD), int(Kind.REDUCE_GRAD), int(Kind.OVERLAP_F_B)
WAIT_SEND_F, WAIT_SEND_B, WAIT_REDUCE_GRAD = int(Kind.WAIT_SEND_F), int(Kind.WAIT_SEND_B), int(Kind.WAIT_REDUCE_GRAD)
# what each wait waits for: the same stage's (and microbatch's) action of this kind, earlier in the rank's list
_WAITED = {WAIT_SEND_F: SEND_F, WAIT_SEND_B: SEND_B, WAIT_REDUCE_GRAD: REDUCE_GRAD}
_WAIT_OF = {done: wait for wait, done in _WAITED.items()}
_COMPUTE = (F, I, W, B)
_NO_PEER = {SEND_F: "sends no activations to another rank", RECV_F: "receives no activations from another rank",
            SEND_B: "sends no gradients to another rank", RECV_B: "receives no gradients from another rank"}
def _with_stage(code: int, stage: int) -> int:
    return (code & ~(STAGE_MASK << STAGE_SHIFT)) | (stage << STAGE_SHIFT)


def _with_kind(code: int, kind: int) -> int:
    return (code & ~KIND_MASK) | kind


class _Reporter:
    def __init__(self, schedule):
        self.schedule = schedule

    def fail(self, rank: int, step: int, problem: str) -> None:
        codes = self.schedule.codes
        if 0 <= step < len(codes[rank]):
            head = f"rank {rank}, step {step}, action {decode(codes[rank][step])}: {problem}"
        else:
            head = f"rank {rank}, step {step} (end of its list): {problem}"
        lo = max(0, step - 6)
        hi = min(max(map(len, codes), default=0), step + 7)
        table = format_table(self.schedule, aligned=False, steps=range(lo, max(hi, lo + 1)),
                             highlight=(rank, step))
        raise ScheduleError(f"{head}\n\ntimeline (steps {lo}..{hi - 1}, list order):\n{table}")


def validate(schedule) -> None:
    topo = schedule.topology
    codes = schedule.codes
    rep = _Reporter(schedule)
    num_ranks, num_stages = len(codes), topo.num_stages
    if topo.num_ranks != num_ranks:
        raise ScheduleError(f"placement is for {topo.num_ranks} ranks but the schedule has {num_ranks}")
    if num_ranks == 0:
        raise ScheduleError("a schedule needs at least one rank")
    stage_rank = topo.stage_rank

    # -- 1. static per-action checks; where every action is ------------------------------
    where: dict[int, tuple[int, int]] = {}  # leaf code -> (rank, step)
    lowered = False
    training = False
    for r, row in enumerate(codes):
        for k, c in enumerate(row):
            kind = c & KIND_MASK
            if kind == OVERLAP:
                leaves = leaf_codes(c)
                if len(leaves) < 2 or any((lc & KIND_MASK) not in _COMPUTE for lc in leaves):
                    rep.fail(r, k, "OVERLAP_F_B must hold two or more compute actions")
            else:
                leaves = (c,)
            for lc in leaves:
                lk, s = lc & KIND_MASK, stage_of(lc)
                if s >= num_stages:
                    rep.fail(r, k, f"stage {s} does not exist (stages 0..{num_stages - 1})")
                if stage_rank[s] != r:
                    rep.fail(r, k, f"stage {s} is placed on rank {stage_rank[s]} ({topo.style} placement), not rank {r}")
                if lk in (UNSHARD, RESHARD, REDUCE_GRAD, WAIT_REDUCE_GRAD):
                    lowered = True
                    if lk == REDUCE_GRAD or lk == WAIT_REDUCE_GRAD:
                        if lc in where:
                            twice = "reduces its gradients" if lk == REDUCE_GRAD else "waits for its reduction"
                            rep.fail(r, k, f"stage {s} {twice} twice (first at step {where[lc][1]})")
                        where[lc] = (r, k)
                    continue
                mb = microbatch_of(lc)
                if mb not in topo.microbatches[s]:
                    mbs = topo.microbatches[s]
                    rep.fail(r, k, f"microbatch {mb} is not one of stage {s}'s ({mbs.start}..{mbs.stop - 1})")
                if lk in _NO_PEER or lk in (WAIT_SEND_F, WAIT_SEND_B):
                    if not topo.crosses_ranks(s, _WAITED.get(lk, lk)):
                        rep.fail(r, k, f"stage {s} {_NO_PEER[_WAITED.get(lk, lk)]}")
                    lowered = True
                if lk in (I, W, B):
                    training = True
                if lc in where:
                    rep.fail(r, k, f"{decode(lc)} appears twice (first at rank {where[lc][0]}, step {where[lc][1]})")
                where[lc] = (r, k)

    # -- 2. completeness and same-rank order ---------------------------------------------
    for s in range(num_stages):
        r = stage_rank[s]
        end = len(codes[r])
        base = s << STAGE_SHIFT
        for mb in topo.microbatches[s]:
            key = base | ((mb + 1) << MB_SHIFT)
            f_at = where.get(key | F)
            if f_at is None:
                rep.fail(r, end, f"missing {s}F{mb}: every stage runs forward on each of its microbatches")
            if not training:
                continue
            b_at, i_at, w_at = where.get(key | B), where.get(key | I), where.get(key | W)
            if b_at is not None and (i_at is not None or w_at is not None):
                rep.fail(r, b_at[1], f"{s}B{mb} runs a full backward but {s}I{mb}/{s}W{mb} also appear")
            if b_at is None and i_at is None:
                rep.fail(r, end, f"missing the backward of {s}F{mb}: add {s}B{mb}, or {s}I{mb} and {s}W{mb}")
            back = b_at or i_at
            if back[1] < f_at[1]:
                rep.fail(r, back[1], f"backward runs before its forward {s}F{mb} (step {f_at[1]})")
            if i_at is not None:
                if w_at is None:
                    rep.fail(r, i_at[1], f"{s}I{mb} has no matching {s}W{mb}: weight gradients would be lost")
                if w_at[1] < i_at[1]:
                    rep.fail(r, w_at[1], f"{s}W{mb} runs before {s}I{mb} (step {i_at[1]})")
            elif w_at is not None:
                rep.fail(r, w_at[1], f"{s}W{mb} has no {s}I{mb} before it")
        if training:
            rg = where.get(base | REDUCE_GRAD)
            if rg is not None:
                last = max(where.get(base | ((mb + 1) << MB_SHIFT) | kind, (r, -1))[1]
                           for mb in topo.microbatches[s] for kind in (B, W))
                if rg[1] < last:
                    rep.fail(r, rg[1], f"REDUCE_GRAD of stage {s} comes before its last backward (step {last})")
    _check_waits(codes, where, rep)
    if lowered:
        _check_sharding(codes, rep)
        _check_comms(schedule, where, training, rep)
    _check_progress(schedule, lowered, rep)


def _check_waits(codes, where, rep) -> None:
    """Each wait after what it waits for, on the same rank (once: checked above); and torch 2.15's rules
    for a schedule that holds waits (what it loads): every send has its wait once the schedule waits
    for sends, every REDUCE_GRAD its WAIT_REDUCE_GRAD once it waits for reductions, and at most one
    reduction is pending on a rank at a time."""
    kinds = {lc & KIND_MASK for lc in where}
    waits_for_sends = bool(kinds & {WAIT_SEND_F, WAIT_SEND_B})
    for lc, (r, k) in where.items():
        kind = lc & KIND_MASK
        waited = _WAITED.get(kind)
        if waited is not None:
            at = where.get(_with_kind(lc, waited))
            if at is None or at[1] > k:
                rep.fail(r, k, f"{decode(lc)} waits for {decode(_with_kind(lc, waited))}, which this rank has not "
                               "run before it")
        wait = _WAIT_OF.get(kind)
        if wait is not None and (wait in kinds if wait == WAIT_REDUCE_GRAD else waits_for_sends) \
                and _with_kind(lc, wait) not in where:
            rep.fail(r, k, f"{decode(lc)} has no {decode(_with_kind(lc, wait))}: a schedule that waits for its "
                           f"{'reductions' if wait == WAIT_REDUCE_GRAD else 'sends'} waits for each")
    if WAIT_REDUCE_GRAD in kinds:
        for r, row in enumerate(codes):
            pending = -1
            for k, c in enumerate(row):
                if c & KIND_MASK == REDUCE_GRAD:
                    if pending >= 0:
                        rep.fail(r, k, f"a second reduction starts while stage {pending}'s is pending (wait for it "
                                       "first: one reduction pending at a time)")
                    pending = stage_of(c)
                elif c & KIND_MASK == WAIT_REDUCE_GRAD and stage_of(c) == pending:
                    pending = -1


def _check_sharding(codes, rep) -> None:
    for r, row in enumerate(codes):
        state: dict[int, bool] = {}
        for k, c in enumerate(row):
            kind = c & KIND_MASK
            if kind == UNSHARD:
                state[stage_of(c)] = True
            elif kind == RESHARD:
                if not state.get(stage_of(c)):
                    rep.fail(r, k, f"stage {stage_of(c)} is resharded while not unsharded")
                state[stage_of(c)] = False
        if not state:
            continue
        sharded = set(state)
        state = {}
        for k, c in enumerate(row):
            kind = c & KIND_MASK
            if kind == UNSHARD:
                state[stage_of(c)] = True
            elif kind == RESHARD:
                state[stage_of(c)] = False
            elif kind in (F, I, W, B, OVERLAP):
                for lc in leaf_codes(c):
                    if stage_of(lc) in sharded and not state.get(stage_of(lc)):
                        rep.fail(r, k, f"stage {stage_of(lc)} computes while its parameters are sharded (UNSHARD first)")


def _check_comms(schedule, where, training, rep) -> None:
    """Every cross-rank edge has exactly its SEND after the producer and its RECV before the
    consumer, and both ends of every channel agree on message order."""
    topo = schedule.topology
    stage_rank, prev_stage, next_stage = topo.stage_rank, topo.prev_stage, topo.next_stage
    for s in range(topo.num_stages):
        r = stage_rank[s]
        base = s << STAGE_SHIFT
        for mb in topo.microbatches[s]:
            key = base | ((mb + 1) << MB_SHIFT)
            n = next_stage[s]
            if topo.crosses_ranks(s, SEND_F):
                _check_edge(key | F, key | SEND_F, _with_stage(key, n) | RECV_F, _with_stage(key, n) | F, where, rep)
            p = prev_stage[s]
            if training and topo.crosses_ranks(s, SEND_B):
                producer = key | B if (key | B) in where else key | I
                consumer = _with_stage(key, p)
                consumer = consumer | B if (consumer | B) in where else consumer | I
                _check_edge(producer, key | SEND_B, _with_stage(key, p) | RECV_B, consumer, where, rep)
    # channel order: the i-th message a sends to b is the i-th b receives from a
    codes = schedule.codes
    sent: dict[tuple[int, int], list[int]] = {}
    received: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r, row in enumerate(codes):
        for k, c in enumerate(row):
            kind = c & KIND_MASK
            s = stage_of(c)
            if kind == SEND_F or kind == SEND_B:  # as the receive it matches: the receiving stage's
                receiver = topo.peer_stage(s, kind)
                matching = _with_kind(_with_stage(c, receiver), RECV_F if kind == SEND_F else RECV_B)
                sent.setdefault((r, stage_rank[receiver]), []).append(matching)
            elif kind == RECV_F or kind == RECV_B:
                received.setdefault((topo.peer_rank(s, kind), r), []).append((c, k))
    for (a, b), recvs in received.items():
        sends = sent.get((a, b), [])
        for idx, (c, k) in enumerate(recvs):
            if idx >= len(sends) or sends[idx] != c:
                expected = decode(sends[idx]) if idx < len(sends) else "nothing"
                rep.fail(b, k, f"message {idx} from rank {a} is received as {decode(c)} but rank {a} sends "
                               f"{expected} as its message {idx} to rank {b}: both sides must agree on the order")


def _check_edge(producer, send, recv, consumer, where, rep) -> None:
    prod_at, send_at, recv_at, cons_at = where.get(producer), where.get(send), where.get(recv), where.get(consumer)
    if send_at is None:
        rep.fail(prod_at[0], prod_at[1], f"{decode(producer)} needs {decode(send)}: its output goes to another rank")
    if send_at[1] < prod_at[1]:
        rep.fail(send_at[0], send_at[1], f"{decode(send)} comes before {decode(producer)} computes what it sends")
    if cons_at is None:
        return  # reported by completeness
    if recv_at is None:
        rep.fail(cons_at[0], cons_at[1], f"{decode(consumer)} needs {decode(recv)} before it")
    if recv_at[1] > cons_at[1]:
        rep.fail(recv_at[0], recv_at[1], f"{decode(recv)} comes after {decode(consumer)} that needs its data")


def _check_progress(schedule, lowered: bool, rep) -> None:
    """Run the schedule by the readiness rule (pipecore/schedule/readiness.py): sends and receives
    are posted without blocking, a compute action waits for its inputs (the peer's SEND when they
    come from another rank). Fails when ranks get stuck."""
    topo = schedule.topology
    codes = schedule.codes
    run = replay(codes, topo, lowered=lowered)
    stuck = run.stuck(codes)
    if stuck:
        details = []
        for r in stuck:
            need = run.blocked_on[r]
            what = (decode(need) if need & KIND_MASK != GRAD_DONE
                    else f"the backward of {stage_of(need)}B{microbatch_of(need)}")
            holder = topo.stage_rank[stage_of(need)]
            details.append(f"rank {r} at step {run.pos[r]} ({decode(codes[r][run.pos[r]])}) waits for {what} on rank "
                           f"{holder}")
        r0 = stuck[0]
        rep.fail(r0, run.pos[r0], "deadlock: no rank can make progress:\n  " + "\n  ".join(details))
