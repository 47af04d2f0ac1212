"""Device-wide synchronisations inside a step (issue 61): cudaFree with the caching allocator off, an
out-of-memory retry or empty_cache hold the host until every stream of the device completed its work,
including a transfer that waits for a peer. pipecore/schedule/p2p_order.py's replay_device_syncs says where
that hangs a step whose messages grow ([Note: follow-ups posted as their headers land] in
csrc/device_comm.h); the CPU model of NCCL runs the device path there and must agree."""

import pytest

import pipecore as pc
from dist_pool import fresh_pool, pool
from device_sync_cases import GROWING, SYNC, steps_under_device_syncs
from exactness import FLOAT64_BOUND
from pipecore.schedule import ScheduleError
from pipecore.schedule.builders import unsupported
from pipecore.schedule.p2p_order import replay_device_syncs
from soak import SOAK

CONFIGS = [(name, R, m) for name in sorted(pc.SCHEDULES) for R in range(2, 9)
           for m in sorted({1, 2, R - 1, R, R + 1, 2 * R, 3 * R + 1, 4 * R} - {0})
           if unsupported(name, R, m) is None]
# how many of them hang (of every configuration; of those on 2-4 ranks, which the suite runs: make soak, the rest)
HUNG = {"plain": 0, "no_syncs": 0, "at_consumer": 351, "when_landed": 78} if SOAK else \
    {"plain": 0, "no_syncs": 0, "at_consumer": 139, "when_landed": 16}


def _hangs(name, R, m, syncs=True, follow_ups="when_landed") -> bool:
    try:
        replay_device_syncs(pc.build_schedule(name, R, m).lower(), syncs, follow_ups)
    except ScheduleError:
        return True
    return False


def test_the_replay_of_device_wide_syncs_over_every_schedule():
    """Every schedule (R = 2..8, 8 microbatch counts; the suite R = 2..4, `make soak` all): a device-wide
    synchronisation in every compute action never hangs a step whose messages fit (each batch's partners are
    posted before any host waits for them: rule 4), nor a growing step without one. With both, posting a
    follow-up's receive when its consumer reads the header (before issue 61) hung 351 of the 612
    configurations (139 of the 244 on 2-4 ranks); posting it as soon as the header lands, 78 (16; the
    residue: docs/cuda.md)."""
    hung = {"plain": 0, "no_syncs": 0, "at_consumer": 0, "when_landed": 0}
    configs = CONFIGS if SOAK else [(name, R, m) for name, R, m in CONFIGS if R <= 4]
    for name, R, m in configs:
        hung["plain"] += _hangs(name, R, m, True, None)
        hung["no_syncs"] += _hangs(name, R, m, False, "when_landed") + _hangs(name, R, m, False, "at_consumer")
        at_consumer, when_landed = _hangs(name, R, m, True, "at_consumer"), _hangs(name, R, m, True, "when_landed")
        assert at_consumer or not when_landed, (name, R, m)  # posting earlier never adds a hang
        hung["at_consumer"] += at_consumer
        hung["when_landed"] += when_landed
    assert len(CONFIGS) == 612 and len(configs) == (612 if SOAK else 244)
    assert hung == HUNG, hung


ISSUE_SCHEDULES = ["interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("name", ISSUE_SCHEDULES)
def test_device_wide_syncs_in_every_stage_do_not_hang_a_growing_step(name, world):
    """Where the replay says so: each of the issue's schedules on 3 and 4 ranks, every stage synchronising the
    device in each forward and gradient, a step whose every message outgrows its capacity: every step exact.
    (Posting a follow-up's receive only at its consumer, the replay and the model hang each of them.)"""
    assert _hangs(name, world, 2 * world, True, "at_consumer") and not _hangs(name, world, 2 * world)
    results = pool(world).run(steps_under_device_syncs, name, timeout=300)
    for rank, r in enumerate(results):
        assert not r["failed"] and r["grad"] <= FLOAT64_BOUND and r["violations"] == [], (rank, r)
        assert len(r["seconds"]) == len(GROWING), (rank, r)
    assert sum(r["grown"] for r in results) > 0, results


@pytest.mark.skipif(not SOAK, reason="make soak (36 s; the model's report of such a hang: test_nccl_model.py)")
def test_where_the_replay_says_device_wide_syncs_hang_the_model_reports_it():
    """looped_bfs on 3 ranks, where posting follow-ups as their headers land is not enough: the model holds a
    synchronising host until its follow-up's receiver posts, which waits in its own synchronisation for what
    the first sends after it, and reports the hang it would be, naming the synchronisation."""
    assert _hangs("looped_bfs", 3, 6)
    p = fresh_pool(3)
    try:
        results = p.run(steps_under_device_syncs, "looped_bfs", 5, timeout=120)
    finally:
        p.close()
    texts = [r["failed"][0] if r["failed"] else "" for r in results]
    assert all(t.startswith("2: ") for t in texts), texts  # the growing step, on every rank
    held = [t for t in texts if SYNC in t and "this would hang" in t]
    assert held and all("holds the host until every stream of the device completed its work" in t for t in held), \
        texts
