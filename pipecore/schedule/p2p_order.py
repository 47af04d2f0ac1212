"""The order in which a rank's sends and receives reach a device backend, and a proof by replay
that this order cannot deadlock where the backend runs all of a group's P2P operations on one
serialised stream.

The rules (the CUDA executor, csrc/device_comm.cpp, follows them; why NCCL needs them:
[Note: NCCL pair order] in csrc/device_comm.h):

1. **Batches.** Each maximal run of consecutive SEND/RECV actions in a rank's lowered program is
   one batch, posted as one NCCL group (c10d coalescing) when the program reaches the run's first
   action. Its operations are posted in program order.
2. **No receive ahead of its batch.** A receive is never posted in an earlier batch: with one
   serialised stream (``init_process_group(device_id=...)``) a receive blocks every operation
   posted after it until its data arrives, so a receive hoisted past a send can wait for a peer
   that waits for that send.
3. **Per pair, one order.** The sends from rank a to rank b, in a's program order, match b's
   receives from a in b's program order (NCCL matches point-to-point operations by order, not by
   tag). Lowering guarantees it; `replay_serialized` checks it.
4. **Dependencies on the device.** Every batch starts on the device after the compute the program
   ran before it (an event recorded on the compute stream at posting: a send's data is made there,
   and a receive's buffer may reuse memory that compute queued before it still reads; the stream
   contract, csrc/stream_contract.h). A compute action starts after the batches that hold the
   receives it consumes completed (the compute stream waits on an event recorded after them).
   The host does not wait for a message's data (a shaped message's header is the exception:
   csrc/device_comm.h).

5. **A step that learns shapes** (the first of each batch signature) posts a batch in parts: a receive
   of activations from another rank that is not first in its batch starts a new group, since its
   buffer's shapes may come from the peer's forward of a message the batch sends. A group led by
   such a receive is posted once its shapes are known: once the sender ran the forward
   (``p2p_batches(..., learning=True)``; the replay models that wait too). A receive from the rank
   itself (only a test's loopback sends to itself) stays in its send's group, as NCCL needs.

`replay_serialized` replays a lowered schedule under the strictest model of such a backend: every
rank has one FIFO of batches, a batch runs only at the head of its rank's FIFO, and a batch
completes only when the batch holding each of its operations' partners is running at the same
time (rendezvous: a large message moves only while both sides are at it). Deadlock-free there is
deadlock-free on per-pair streams too (they only remove orderings).

`replay_device_syncs` replays it on the host's side too, as the device path runs it when a stage makes a
device-wide synchronisation (cudaFree, which the caching allocator calls when it is off, on an
out-of-memory retry and in empty_cache): the host waits there for every batch it posted, and, where
messages outgrow their receives, for every follow-up it sent (csrc/device_comm.h, [Note: follow-ups
posted as their headers land]).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from pipecore.schedule.action import Action, Kind
from pipecore.schedule.errors import ScheduleError
from pipecore.schedule.schedule import Schedule

__all__ = ["p2p_batches", "replay_serialized", "replay_device_syncs", "SerializedReplay"]

_RECEIVES = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B, Kind.I: Kind.RECV_B}


def p2p_batches(lowered: Schedule, rank: int, learning: bool = False) -> list[list[int]]:
    """Rule 1 (with `learning`, rule 5): the positions (in `lowered.actions[rank]`) of each batch's
    SEND/RECV actions."""
    batches: list[list[int]] = []
    previous_comm = False
    for i, a in enumerate(lowered.actions[rank]):
        comm = a.kind.is_comm
        if comm:
            from_peer = lowered.topology.peer_rank(a.stage, a.kind) != rank
            if not previous_comm or (learning and a.kind is Kind.RECV_F and from_peer):
                batches.append([])
            batches[-1].append(i)
        previous_comm = comm
    return batches


def _message_key(lowered: Schedule, a: Action) -> tuple:
    """(direction, receiving stage, microbatch): the same for a send and the receive it matches."""
    direction = "F" if a.kind in (Kind.SEND_F, Kind.RECV_F) else "B"
    sending = a.kind in (Kind.SEND_F, Kind.SEND_B)
    return (direction, lowered.topology.peer_stage(a.stage, a.kind) if sending else a.stage, a.microbatch)


@dataclass
class SerializedReplay:
    """Outcome of `replay_serialized`: per rank, the number of batches and of compute actions, and
    the rounds of the replay (each round runs everything that can run)."""
    batches: list[int]
    computes: list[int]
    rounds: int


def _rendezvous(partners, reached) -> bool:
    """The rule both replays complete a batch by (rendezvous: a large message moves only while both
    sides are at it): every partner batch (rank, batch) in `partners` is running at its stream's head, or
    completed, as `reached(rank, batch)` says."""
    return all(reached(pr, pb) for pr, pb in partners)


def replay_serialized(lowered: Schedule, learning: bool = False) -> SerializedReplay:
    """Replays `lowered` with every rank's P2P operations in one FIFO of batches (rules 1-4, and
    with `learning` rule 5, under rendezvous). Raises ScheduleError naming each stuck rank's next batch and compute action if
    the ranks would wait for each other forever, or if a pair of ranks disagrees on the order of
    its messages."""
    if not lowered.is_lowered and lowered.num_ranks > 1:
        raise ScheduleError("replay_serialized needs a lowered schedule (Schedule.lower())")
    R = lowered.num_ranks
    actions = lowered.actions
    # per rank: batches (lists of positions) and compute positions, in program order
    batches = [p2p_batches(lowered, r, learning) for r in range(R)]
    computes = [[i for i, a in enumerate(actions[r]) if a.kind.is_compute] for r in range(R)]
    # rule 3: per ordered pair, the same message order on both sides
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    where: dict[tuple, tuple[int, int]] = {}  # message key + side -> (rank, batch)
    for r in range(R):
        for b, batch in enumerate(batches[r]):
            for i in batch:
                a = actions[r][i]
                key = _message_key(lowered, a)
                sending = a.kind in (Kind.SEND_F, Kind.SEND_B)
                peer = lowered.topology.peer_rank(a.stage, a.kind)
                pair = (r, peer) if sending else (peer, r)
                (sent if sending else received).setdefault(pair, []).append(key)
                where[(key, sending)] = (r, b)
    for pair in set(sent) | set(received):
        if sent.get(pair, []) != received.get(pair, []):
            raise ScheduleError(f"rank {pair[0]} sends to rank {pair[1]} in the order {sent.get(pair, [])} but "
                                f"rank {pair[1]} receives in the order {received.get(pair, [])}: NCCL matches "
                                "messages by order")
    # what each batch and compute action waits for
    partners: list[list[list[tuple[int, int]]]] = [[[] for _ in batches[r]] for r in range(R)]
    computes_before = [[0] * len(batches[r]) for r in range(R)]
    for r in range(R):
        for b, batch in enumerate(batches[r]):
            computes_before[r][b] = bisect_left(computes[r], batch[0])
            for i in batch:
                a = actions[r][i]
                sending = a.kind in (Kind.SEND_F, Kind.SEND_B)
                partners[r][b].append(where[(_message_key(lowered, a), not sending)])
    # rule 5: a learning batch led by a receive of activations is posted once its shapes are known,
    # i.e. once the sender ran the computes before the batch that sends it
    shapes_from: list[list[tuple[int, int] | None]] = [[None] * len(batches[r]) for r in range(R)]
    if learning:
        for r in range(R):
            for b, batch in enumerate(batches[r]):
                a = actions[r][batch[0]]
                if a.kind is Kind.RECV_F:
                    pr, pb = where[(_message_key(lowered, a), True)]
                    shapes_from[r][b] = (pr, computes_before[pr][pb])
    needs: list[list[list[int]]] = [[] for _ in range(R)]  # per compute action: batches it consumes
    for r in range(R):
        for i in computes[r]:
            got = []
            for leaf in actions[r][i].leaves():
                kind = _RECEIVES.get(leaf.kind)
                if kind is not None:
                    # the receive, if any, is on this rank: it holds the receiving stage
                    found = where.get((("F" if kind is Kind.RECV_F else "B", leaf.stage, leaf.microbatch), False))
                    if found is not None:
                        got.append(found[1])
            needs[r].append(got)
    head = [0] * R           # next batch of each rank's FIFO
    running = [False] * R    # is the head batch running (its dependencies met)?
    done_computes = [0] * R
    rounds = 0
    while True:
        rounds += 1
        progress = False
        # computes: in order, once the batches they consume completed
        for r in range(R):
            while done_computes[r] < len(computes[r]) and all(b < head[r] for b in needs[r][done_computes[r]]):
                done_computes[r] += 1
                progress = True
        # batches start at the head of their FIFO once the compute before them ran (rule 4)
        for r in range(R):
            if head[r] < len(batches[r]) and not running[r]:
                known = shapes_from[r][head[r]]
                if done_computes[r] >= computes_before[r][head[r]] and (known is None or
                                                                      done_computes[known[0]] >= known[1]):
                    running[r] = True
                    progress = True
        # a running batch completes when every partner's batch is running (or already completed)
        finished = [r for r in range(R) if running[r] and _rendezvous(
            partners[r][head[r]], lambda pr, pb: (head[pr] == pb and running[pr]) or head[pr] > pb)]
        for r in finished:
            running[r] = False
            head[r] += 1
            progress = True
        if not progress:
            break
    stuck = [r for r in range(R) if head[r] < len(batches[r]) or done_computes[r] < len(computes[r])]
    if stuck:
        parts = []
        for r in stuck:
            batch = ([str(actions[r][i]) for i in batches[r][head[r]]] if head[r] < len(batches[r]) else [])
            comp = str(actions[r][computes[r][done_computes[r]]]) if done_computes[r] < len(computes[r]) else "-"
            parts.append(f"rank {r}: batch {batch} ({'running' if running[r] else 'waiting'}), compute {comp}")
        raise ScheduleError(f"{lowered.name or 'schedule'}: with every rank's P2P operations on one serialised "
                            "stream the ranks wait for each other forever: " + "; ".join(parts))
    return SerializedReplay([len(b) for b in batches], [len(c) for c in computes], rounds)


FOLLOW_UPS_POSTED = ("at_consumer", "when_landed")


def replay_device_syncs(lowered: Schedule, syncs: bool = True, follow_ups: str | None = "when_landed") -> int:
    """Replays `lowered` as the device path's hosts run a steady step (rules 1-4, batches as in
    `replay_serialized`), each rank's host in program order:

    - a batch is posted when the host reaches it, onto the rank's communication stream (one FIFO), without
      holding the host;
    - before a compute action the host reads the header of each message the action consumes, and of
      every message from the same peer posted before it (headers are read in posting order per peer),
      each waiting for the batch holding it;
    - with `syncs`, every compute action then makes a device-wide synchronisation: the host waits until
      everything it posted on its communication stream completed, and every follow-up it sent;
    - with `follow_ups`, every message outgrew its receive: its sender posts a follow-up right after the
      batch holding it, which completes once its receive ran (rendezvous). That receive goes on the
      receiver's communication stream (behind what was posted there before it, and before what comes
      after: [Note: streams between communicators] in csrc/device_comm.h), and the host reading the
      message waits for it. The receiver posts it when its consumer reads the header ("at_consumer"),
      or, as the device path does, as soon as the header is on the host and its host is between two
      actions ("when_landed": before each action, each peer's in posting order).

    Returns the rounds it took; raises ScheduleError naming what each stuck rank's host waits for if the
    ranks would wait for each other forever."""
    if follow_ups is not None and follow_ups not in FOLLOW_UPS_POSTED:
        raise ValueError(f"follow_ups: one of {FOLLOW_UPS_POSTED} or None, not {follow_ups!r}")
    if not lowered.is_lowered and lowered.num_ranks > 1:
        raise ScheduleError("replay_device_syncs needs a lowered schedule (Schedule.lower())")
    R, actions = lowered.num_ranks, lowered.actions
    batches = [p2p_batches(lowered, r) for r in range(R)]
    where: dict[tuple, tuple[int, int]] = {}  # message key + side -> (rank, batch)
    for r in range(R):
        for b, batch in enumerate(batches[r]):
            for i in batch:
                a = actions[r][i]
                where[(_message_key(lowered, a), a.kind in (Kind.SEND_F, Kind.SEND_B))] = (r, b)
    sender = {key: where[(key, True)][0] for key, sending in where if sending}
    # per receiving rank and peer: the messages it receives, in posting order
    from_peer: list[dict[int, list[tuple]]] = [{} for _ in range(R)]
    for r in range(R):
        for batch in batches[r]:
            for i in batch:
                a = actions[r][i]
                if a.kind in (Kind.RECV_F, Kind.RECV_B):
                    key = _message_key(lowered, a)
                    from_peer[r].setdefault(sender[key], []).append(key)
    # each rank's host program: ("batch", b) or ("compute", position, messages whose headers it reads first)
    hosts: list[list[tuple]] = []
    for r in range(R):
        first = {batch[0]: b for b, batch in enumerate(batches[r])}
        program = []
        for i, a in enumerate(actions[r]):
            if i in first:
                program.append(("batch", first[i]))
            elif a.kind.is_compute:
                reads: list[tuple] = []
                for leaf in a.leaves():
                    kind = _RECEIVES.get(leaf.kind)
                    key = ("F" if kind is Kind.RECV_F else "B", leaf.stage, leaf.microbatch) if kind else None
                    if key is not None and (key, False) in where:
                        keys = from_peer[r][sender[key]]
                        reads += [k for k in keys[:keys.index(key) + 1] if k not in reads]
                program.append(("compute", i, reads))
        hosts.append(program)
    partners = {(r, b): [where[(_message_key(lowered, actions[r][i]),
                                actions[r][i].kind not in (Kind.SEND_F, Kind.SEND_B))] for i in batch]
                for r in range(R) for b, batch in enumerate(batches[r])}
    carried = {(r, b): [_message_key(lowered, actions[r][i]) for i in batch]
               for r in range(R) for b, batch in enumerate(batches[r])}
    stream: list[list[tuple]] = [[] for _ in range(R)]  # each rank's communication stream: ("batch", b), ("follow-up", key)
    head = [0] * R           # its next entry to complete
    done: set[tuple] = set()  # (rank, batch) completed, and follow-ups received
    at = [0] * R             # the host's next item
    inside = [False] * R     # the host is inside that compute action (past the look before it)
    read: set[tuple] = set()       # messages whose header (and follow-up) the host read
    receiving: set[tuple] = set()  # follow-ups whose receive is posted
    sent: list[list[tuple]] = [[] for _ in range(R)]

    def landed(key) -> bool:
        return where[(key, False)] in done

    def receive_follow_up(r, key) -> None:
        receiving.add(key)
        stream[r].append(("follow-up", key))

    rounds = 0
    while True:
        rounds += 1
        progress = False
        for r in range(R):
            while at[r] < len(hosts[r]):
                item = hosts[r][at[r]]
                if not inside[r]:
                    if follow_ups == "when_landed":  # (between two actions: DevicePath::post_landed_follow_ups)
                        for keys in from_peer[r].values():
                            for key in keys:
                                if key in read or key in receiving:
                                    continue
                                if not landed(key):
                                    break
                                receive_follow_up(r, key)
                                progress = True
                    if item[0] == "batch":
                        stream[r].append(item)
                        if follow_ups:
                            sent[r] += [k for k in carried[(r, item[1])] if sender[k] == r]
                        at[r] += 1
                        progress = True
                        continue
                    inside[r] = True
                    progress = True
                waiting = False
                for key in item[2]:  # the headers it reads, and their follow-ups
                    if key in read:
                        continue
                    if not landed(key):
                        waiting = True
                        break
                    if follow_ups and key not in receiving:
                        receive_follow_up(r, key)
                        progress = True
                    if follow_ups and key not in done:
                        waiting = True
                        break
                    read.add(key)
                if waiting or (syncs and (head[r] < len(stream[r]) or any(k not in done for k in sent[r]))):
                    break  # the host waits for a header, a follow-up, or (synchronising) the whole device
                inside[r] = False
                at[r] += 1
                progress = True
        # each communication stream runs its head: a follow-up's receive at once (its send was posted with the
        # header's batch), a batch once every partner's batch is at its stream's head or completed
        finished = []
        for r in range(R):
            if head[r] == len(stream[r]):
                continue
            kind, what = stream[r][head[r]]
            if kind == "follow-up" or _rendezvous(partners[(r, what)], lambda pr, pb: (pr, pb) in done or (
                    head[pr] < len(stream[pr]) and stream[pr][head[pr]] == ("batch", pb))):
                finished.append(r)
        for r in finished:
            kind, what = stream[r][head[r]]
            done.add(what if kind == "follow-up" else (r, what))
            head[r] += 1
            progress = True
        if not progress:
            break
    stuck = [r for r in range(R) if at[r] < len(hosts[r]) or head[r] < len(stream[r])]
    if stuck:
        parts = []
        for r in stuck:
            item = hosts[r][at[r]] if at[r] < len(hosts[r]) else None
            where_host = "done" if item is None else \
                f"at {actions[r][item[1]]}" if item[0] == "compute" else f"posting batch {item[1]}"
            entry = stream[r][head[r]] if head[r] < len(stream[r]) else None
            device = "idle" if entry is None else f"follow-up receive of {entry[1]}" if entry[0] == "follow-up" \
                else str([str(actions[r][i]) for i in batches[r][entry[1]]])
            waits = [f"follow-up of {k}" for k in sent[r] if k not in done]
            parts.append(f"rank {r}: host {where_host}, communication stream at {device}" +
                         (f", its follow-ups not received yet: {waits[:3]}" if waits else ""))
        raise ScheduleError(f"{lowered.name or 'schedule'}: with a device-wide synchronisation in every compute action"
                            f"{' and every message grown' if follow_ups else ''} the ranks wait for each other "
                            "forever: " + "; ".join(parts))
    return rounds
