"""The posting order of the device path (pipecore/schedule/p2p_order.py, csrc/device_comm.h),
replayed on CPU as NCCL runs it with init_process_group(device_id=...): every rank's P2P operations
in one serialised FIFO of batches, each operation waiting for its partner (rendezvous)."""

import pytest

import pipecore as pc
from pipecore.schedule import Kind, Schedule, ScheduleError
from pipecore.schedule.builders import unsupported
from pipecore.schedule.p2p_order import p2p_batches, replay_serialized

CONFIGS = [(name, R, m) for name in sorted(pc.SCHEDULES) for R in range(2, 9)
           for m in sorted({1, 2, R - 1, R, R + 1, 2 * R, 3 * R + 1, 4 * R} - {0})
           if unsupported(name, R, m) is None]  # the sizes each schedule runs (e.g. dualpipe: even ranks)


def _build(name, R, m):
    return pc.build_schedule(name, R, m)


@pytest.mark.parametrize("learning", [False, True], ids=["steady", "learning"])
@pytest.mark.parametrize("name, R, m", CONFIGS)
def test_batches_in_program_order_never_deadlock_on_one_serialised_stream(name, R, m, learning):
    # learning: the first step of a batch shape, whose batches are cut before each later receive of
    # activations (csrc/device_path.cpp post_batch; rule 5)
    lowered = _build(name, R, m).lower()
    replay = replay_serialized(lowered, learning)
    assert sum(replay.batches) > 0
    assert replay.computes == [sum(1 for a in row if a.kind.is_compute) for row in lowered.actions]


def _hoist_receives(lowered: Schedule, rank: int) -> Schedule:
    """The old receive window on `rank`: every receive posted in the batch before its own."""
    rows = [list(r) for r in lowered.actions]
    batches = p2p_batches(lowered, rank)
    row = rows[rank]
    moved = {}
    for prev, cur in zip(batches, batches[1:]):
        for i in cur:
            if row[i].kind in (Kind.RECV_F, Kind.RECV_B):
                moved.setdefault(prev[-1], []).append(i)
    out = []
    skip = {i for ids in moved.values() for i in ids}
    for i, a in enumerate(row):
        if i not in skip:
            out.append(a)
        out.extend(row[j] for j in moved.get(i, []))
    rows[rank] = out
    return Schedule.from_codes([[a.code for a in r] for r in rows], lowered.topology, name=lowered.name)


def test_receives_posted_ahead_deadlock_where_the_stream_is_serialised():
    """What the issue saw: interleaved_1f1b on 4 ranks with receives posted ahead of sends waits
    forever on one serialised stream; the replay says which ranks wait for what."""
    lowered = pc.build_schedule("interleaved_1f1b", 4, 8).lower()
    hoisted = lowered
    for rank in range(4):
        hoisted = _hoist_receives(hoisted, rank)
    with pytest.raises(ScheduleError, match="wait for each other forever") as info:
        replay_serialized(hoisted)
    assert "rank " in str(info.value) and "RECV" in str(info.value)


def test_message_order_disagreement_is_named():
    lowered = pc.build_schedule("1f1b", 2, 4).lower()
    rows = [list(r) for r in lowered.actions]
    recvs = [i for i, a in enumerate(rows[1]) if a.kind is Kind.RECV_F]
    rows[1][recvs[0]], rows[1][recvs[1]] = rows[1][recvs[1]], rows[1][recvs[0]]
    swapped = Schedule.from_codes([[a.code for a in r] for r in rows], lowered.topology)
    with pytest.raises(ScheduleError, match="matches messages by order"):
        replay_serialized(swapped)


def executor_batches(rank, world, lowered, learning=False):
    """On rank `rank` of a gloo group of `lowered`'s ranks: the executor's batches of this rank's
    program, as action names (`learning`: as a step that learns shapes posts them)."""
    import torch.distributed as dist
    from pipecore._C import Executor
    from pipecore.executor.program import encode
    mine = lowered.rank_stages(rank)
    program = encode(lowered, rank, {s: i for i, s in enumerate(mine)})
    flat, labels = program.instructions, program.labels
    ex = Executor(dist.group.WORLD, len(mine), lowered.num_microbatches, 10.0)
    ex.set_program(flat, labels)
    groups: dict[int, list[str]] = {}
    for j, end in enumerate(ex.batch_ends(learning)):
        if end:
            groups.setdefault(end, []).append(labels[flat[5 * j + 4]][3:])
    return [groups[e] for e in sorted(groups)]


def _replayed_batches(lowered, rank, learning):
    return [[str(lowered.actions[rank][i]) for i in b] for b in p2p_batches(lowered, rank, learning)]


@pytest.mark.parametrize("learning", [False, True], ids=["steady", "learning"])
@pytest.mark.parametrize("name, R", [("interleaved_1f1b", 4), ("zbv", 2), ("dualpipev", 4), ("1f1b", 3)])
def test_executor_batches_are_the_replayed_batches(name, R, learning):
    """The C++ executor's batches (csrc/program.cpp, Program::load) are p2p_batches' for every rank,
    in steady steps and in steps that learn shapes."""
    from dist_pool import pool
    lowered = pc.build_schedule(name, R, 2 * R).lower()
    got = pool(R).run(executor_batches, lowered, learning)
    assert got == [_replayed_batches(lowered, r, learning) for r in range(R)]


@pytest.mark.parametrize("name, V", [("interleaved_1f1b", 4), ("zbv", 2), ("dualpipev", 2), ("interleaved_zb", 2)])
def test_a_send_to_self_and_its_receive_are_one_batch_in_a_learning_step(name, V):
    """tests/cuda_loopback.py sends every boundary of a one-rank pipeline to itself (the device path on
    one GPU): NCCL refuses a send to self whose receive is in another group, so a learning step does not
    cut before a receive from the rank itself (rule 5); the executor and p2p_batches agree."""
    from cuda_loopback import loopback_schedule
    from dist_pool import pool
    lowered = loopback_schedule(pc.build_schedule(name, 1, 2 * V, stages_per_rank=V))
    got = pool(1).run(executor_batches, lowered, True)[0]
    assert got == _replayed_batches(lowered, 0, True)
    sends = [b for b in got if any("SEND_F" in a for a in b)]
    assert sends and all(any("RECV_F" in a for a in b) for b in sends)


def _rows_from_labels(labels: list[str]) -> list:
    """An executor's action labels ("PP:0F0"; an OVERLAP_F_B pair between two labels of its
    container) as the schedule row it runs."""
    from pipecore.schedule.action import Action
    row, inside = [], None
    for label in labels:
        a = Action.parse(label[3:])
        if inside is not None:
            inside = None if str(a) == inside else inside
            continue
        if a.kind is Kind.OVERLAP_F_B:
            inside = str(a)
        row.append(a)
    return row


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zbv", "dualpipev"])
def test_the_programs_data_parallel_pipelines_run_never_deadlock_on_one_serialised_stream(name):
    """The programs executors actually ran in a dp=2 x pp=2 step (REDUCE_GRAD where each rank's
    buckets go) replay without deadlock. The buckets' all-reduces run on the dp group's own
    communicator, between ranks whose programs are the same, at the same REDUCE_GRAD (or from the
    same backward's hooks): they wait only for compute on both replicas, which the replay of each
    replica's pipeline shows to finish."""
    from data_parallel_cases import executed_program, microbatch_counts, stages_per_rank
    from dist_pool import pool
    m = microbatch_counts(name, 2)[0]
    runs = pool(4).run(executed_program, name, m, 2, timeout=120)
    lowered = pc.build_schedule(name, 2, m, stages_per_rank(name)).lower()
    for replica in range(2):
        rows = [_rows_from_labels(labels) for rep, _, labels in sorted(runs, key=lambda r: r[1]) if rep == replica]
        assert any(a.kind is Kind.REDUCE_GRAD for row in rows for a in row)
        replay_serialized(Schedule.from_codes([[a.code for a in row] for row in rows], lowered.topology, name=name))
    same = [labels for _, _, labels in sorted(runs, key=lambda r: (r[1], r[0]))]
    assert same[0] == same[1] and same[2] == same[3]  # the replicas of a position run one program
