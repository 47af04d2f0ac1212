"""Messages that carry their shapes (csrc/comm.h): on gloo, a step whose microbatches change shapes
learns no new plan and sends no extra message; a message that outgrows its boundary's capacity goes
once more at its own size, after which the capacity has grown (tests/shaped_message_cases.py)."""

import pytest

from dist_pool import pool
from exactness import FLOAT64_BOUND
from shaped_message_cases import LENGTHS, out_of_memory_while_growing, per_shape_plans, step_lengths, steps_for


@pytest.mark.parametrize("large", [None, 0])
@pytest.mark.parametrize("name, world", [("1f1b", 2), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2),
                                         ("interleaved_zb", 4)])
def test_new_shapes_need_no_plan_and_no_extra_message(name, world, large):
    """Packed and per-part (`large` 0) layouts: one plan for every step; each steady step sends one
    message per SEND action and nothing more; only the step that outgrows the capacity sends
    messages again; gradients within exactness.FLOAT64_BOUND of one process throughout."""
    results = pool(world).run(step_lengths, name, steps_for(LENGTHS, world), large, timeout=180)
    for rank, r in enumerate(results):
        assert not r["failed"], (rank, r)
        assert r["grad"] <= FLOAT64_BOUND, (rank, r)
        assert r["plans"] == [1] * len(LENGTHS), (rank, r)
        for step, (messages, parts, grown) in enumerate(r["counts"]):
            assert messages == r["sends"], (rank, step, r)
            if step != 2:
                assert grown == 0, (rank, step, r)
    assert sum(r["counts"][2][2] for r in results) > 0, results  # step 2 outgrew the first step's shapes


@pytest.mark.parametrize("overlap", ["concurrent", "lockstep"])
def test_pairs_whose_halves_read_grown_messages_at_once(overlap):
    """dualpipev's OVERLAP_F_B pairs: a forward and a backward half receive from the same peer, on
    two threads, and the messages of both outgrow their capacity at step 2."""
    results = pool(2).run(step_lengths, "dualpipev", steps_for(LENGTHS, 2), None, None, 200, overlap, timeout=180)
    for rank, r in enumerate(results):
        assert not r["failed"] and r["grad"] <= FLOAT64_BOUND, (rank, r)
        assert all(c[0] == r["sends"] for c in r["counts"]), (rank, r)
        assert overlap != "concurrent" or r["overlapped"] > 0, (rank, r)  # halves ran on two threads
    assert sum(r["counts"][2][2] for r in results) > 0, results


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_a_step_that_fails_while_messages_grow_leaves_the_capacities_agreed(name):
    """Rank 1's forward fails in the step whose messages outgrow their capacity, with random delays
    before every post: every rank fails that step, and the steps after it run, exact, with no
    message sent twice once the capacities grew (both sides of each boundary widened alike)."""
    lengths = steps_for(LENGTHS, 2)
    results = pool(2).run(step_lengths, name, lengths, None, (2, 1), 300, timeout=180)
    for rank, r in enumerate(results):
        assert [f.split(":")[0] for f in r["failed"]] == ["2"], (rank, r)
        assert r["grad"] <= FLOAT64_BOUND, (rank, r)
        # step 3 may still outgrow what crossed before the failure stopped step 2; step 4 cannot
        assert r["counts"][4][2] == 0, (rank, r)
        assert all(c[0] == r["sends"] for c in r["counts"][3:]), (rank, r)


@pytest.mark.parametrize("name, bad_rank, large, device", [("1f1b", 1, None, False), ("1f1b", 0, 0, False),
                                                          ("zbv", 1, None, False), ("1f1b", 1, 0, True),
                                                          ("zbv", 0, None, True)])
def test_out_of_memory_while_messages_grow_ends_the_step_everywhere(name, bad_rank, large, device):
    """Every allocation of a growing step on the bad rank fails in turn (a receive buffer, a grown
    message's header or second sending, an activation): that rank raises OutOfMemoryError, the other
    PeerFailedError, and the next step, longer still, is exact."""
    results = pool(2).run(out_of_memory_while_growing, name, bad_rank, large, 400, device, timeout=300)
    count = results[bad_rank]["count"]
    assert count >= 4, results
    failed = 0
    for rank, r in enumerate(results):
        assert r["grad"] <= FLOAT64_BOUND, (rank, r)
        for k, (kind, text), second in r["tries"]:
            assert second[0] == "ok", (rank, k, second)
            if kind == "ok":
                continue
            if rank == bad_rank:
                failed += 1
                assert kind == "OutOfMemoryError" and "memory_probe: out of memory" in text, (rank, k, kind, text)
            else:
                assert kind == "PeerFailedError" and "out of memory" in text, (rank, k, kind, text)
    assert failed == count, (failed, count)  # every allocation the step makes, refused in turn


@pytest.mark.parametrize("large", [None, 0])
@pytest.mark.parametrize("name, world", [("1f1b", 2), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2),
                                         ("interleaved_zb", 4)])
def test_device_path_messages_carry_their_shapes(name, world, large):
    """The device path's protocol, emulated (NCCL: a receive takes exactly what was sent, in posting
    order, without tags): one plan for every step; every message goes at its capacity's size (a
    receiver reads one whose header says otherwise as a channel out of step: every step passing shows
    that each message was) and the host
    reads its header; only the step that outgrows the capacities sends messages again (on the
    follow-up channels); no step runs twice; gradients within exactness.FLOAT64_BOUND of one process; the stream contract holds
    (headers copied before their batch's ready event)."""
    results = pool(world).run(step_lengths, name, steps_for(LENGTHS, world), large, None, 0, None, True, timeout=240)
    for rank, r in enumerate(results):
        assert not r["failed"], (rank, r)
        assert r["grad"] <= FLOAT64_BOUND, (rank, r)
        assert r["violations"] == [], (rank, r)
        assert r["plans"] == [1] * len(LENGTHS), (rank, r)
        assert r["forwards"] == [r["once"]] * len(LENGTHS), (rank, r)
        for step, (messages, parts, grown) in enumerate(r["counts"]):
            assert messages == r["sends"], (rank, step, r)
            if step != 2:
                assert grown == 0, (rank, step, r)
    assert sum(r["counts"][2][2] for r in results) > 0, results  # step 2 outgrew the first step's shapes


def test_device_path_pairs_read_headers_at_once():
    """dualpipev's pairs, their halves on two threads, each reading headers on the emulated device path."""
    results = pool(2).run(step_lengths, "dualpipev", steps_for(LENGTHS, 2), None, None, 200, "concurrent", True,
                          timeout=180)
    for rank, r in enumerate(results):
        assert not r["failed"] and r["grad"] <= FLOAT64_BOUND and r["violations"] == [], (rank, r)
        assert r["overlapped"] > 0, (rank, r)


def test_device_path_step_that_fails_while_messages_grow():
    """Rank 1's forward fails in the step whose messages outgrow their capacity, on the emulated device
    path, with random delays: every rank fails that step; the later steps are exact, and the last one
    sends nothing twice (both sides of each boundary widened alike)."""
    results = pool(2).run(step_lengths, "1f1b", steps_for(LENGTHS, 2), None, (2, 1), 300, None, True, timeout=180)
    for rank, r in enumerate(results):
        assert [f.split(":")[0] for f in r["failed"]] == ["2"], (rank, r)
        assert r["grad"] <= FLOAT64_BOUND and r["violations"] == [], (rank, r)
        assert r["counts"][4][2] == 0, (rank, r)


def test_variable_shapes_false_plans_per_shape_on_gloo():
    """Pipeline(variable_shapes=False): messages without shapes, one plan per batch shape, exact; a
    value that is not True, False or None is refused."""
    for rank, r in enumerate(pool(2).run(per_shape_plans, timeout=120)):
        assert "variable_shapes must be True, False or None" in r["refused"], (rank, r)
        assert r["travel"] is False and r["plans"] == [1, 2, 2] and r["grad"] <= FLOAT64_BOUND, (rank, r)
