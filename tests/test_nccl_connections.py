"""Communicators connected before the first step (issue 61; [Note: connecting before the first step] in
csrc/device_comm.h), on the CPU model of NCCL, whose communicators connect at their first operation and
hold the posting host until their peers come (csrc/testing/nccl_connections.h)."""

import pytest

import pipecore as pc
from dist_pool import free_port, fresh_pool, pool
from exactness import FLOAT64_BOUND
from nccl_connection_cases import channels_end_with_the_world, connections_over_steps, exchange_times_out
from soak import SOAK

# on 4 ranks the suite runs the issue's four, 1F1B and dualpipe (its mirrors' exchange), `make soak` every one;
# dualpipe needs an even number of ranks
SCHEDULES = [name for name in pc.SCHEDULES if name != "forward_only"]
WORLDS = [(name, world) for name in SCHEDULES for world in (3, 4)
          if (world == 3 and name != "dualpipe") or world == 4 and (
              SOAK or name in ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev", "dualpipe"))]


@pytest.mark.parametrize("all_ranks_connected", [False, True], ids=["lazy_group", "group_with_device_id"])
@pytest.mark.parametrize("name, world", WORLDS)
def test_no_step_connects_a_communicator(name, world, all_ranks_connected):
    """Every schedule on 3 and 4 ranks (dualpipe on 4; 2 microbatches per rank; on 4, the suite runs six of them
    and `make soak` all), on a group whose communicator connects
    lazily ("cpu:gloo,cuda:nccl" without device_id) and on one connected when it was made (with
    device_id), shapes in the messages and step 2 outgrowing every capacity (follow-ups): every step
    exact, no communicator connected by a step's operation (the store is not touched inside a step), the
    channels with the group's c10d timeout (above the Pipeline's 60 s)."""
    results = pool(world).run(connections_over_steps, name, all_ranks_connected, timeout=240)
    for rank, r in enumerate(results):
        assert not r["failed"] and r["grad"] <= FLOAT64_BOUND and r["violations"] == [], (rank, r)
        assert all(counts[1] == 0 for counts in r["counts"]), (rank, r["counts"])
        assert r["counts"][0][0] > 0 and len({tuple(c) for c in r["counts"]}) == 1, (rank, r["counts"])
        assert r["channel_timeouts"] and set(r["channel_timeouts"]) == {r["group_timeout"]} and \
            r["group_timeout"] > 60, (rank, r)
    assert sum(r["grown"] for r in results) > 0, results


@pytest.mark.parametrize("name, world, partners, unlinked", [
    ("1f1b", 3, {0: [2], 2: [0]}, {0, 2}),  # the tie's holders, ranks 0 and 2
    # mirrors and the tie (0 and 3: the same partner); ranks 1 and 2 send each other messages too
    ("dualpipe", 4, {0: [3], 1: [2], 2: [1], 3: [0]}, {0, 3}),
])
def test_exchanges_of_ties_and_mirrors_connect_no_communicator_inside_a_step(name, world, partners, unlinked):
    """A tied weight's holders, and dualpipe's mirrored partners, sum gradients after each step with an exchange
    (Comm.exchange). On NCCL it goes as one group on the group's communicator, whose path to the partner the
    Pipeline connects at its first agreement with its messages' (c10d would post a lone send on a
    communicator of the two ranks, made there, inside the step). The tie's copies start unequal: the first
    agreement makes them equal, after that connecting. On the CPU model: no connection by an operation,
    every step exact; with the partners left out of that connecting (as before), the model counts one made by
    an operation (the copies' equalisation, the first exchange) on every rank whose partner sends it no
    message (`unlinked`). (Fresh processes: the model keeps a communicator's connections in its backend, as
    c10d does, so the pool's earlier tests may have connected the partners' path.)"""
    for ahead in (True, False):
        p = fresh_pool(world)
        try:
            results = p.run(connections_over_steps, name, True, True, 60, 3, True, ahead, timeout=240)
        finally:
            p.close()
        for rank, r in enumerate(results):
            assert not r["failed"] and r["grad"] <= FLOAT64_BOUND and r["violations"] == [], (ahead, rank, r)
            assert r["exchange_peers"] == partners.get(rank, []), (rank, r["exchange_peers"])
            in_steps = [counts[1] for counts in r["counts"]]
            assert in_steps == ([0, 0, 0] if ahead or rank not in unlinked else [1, 1, 1]), (ahead, rank, r["counts"])


@pytest.mark.parametrize("name, world, all_ranks_connected, step, communicator", [
    # the group's communicator at the first batch: rank 2 waits on its host for rank 1's description,
    # which rank 1 sends only after the batch rank 0 and rank 1 are held in
    ("interleaved_1f1b", 3, False, 0, "the communicator of all 3 ranks"),
    # a follow-up's pair communicator at the first growth, where another rank waits for that header
    ("interleaved_1f1b", 3, True, 2, "the communicator of ranks 0 and 2"),
])
def test_a_communicator_first_used_inside_a_step_is_the_hang_it_would_be(name, world, all_ranks_connected, step,
                                                                         communicator):
    """Without the Pipeline's connecting at its first agreement (as before issue 61), the model holds a
    rank's first operation on a communicator until its peers come, as NCCL does, and reports the cycle
    that follows as the hang it would be, on every rank within the timeout and a few seconds."""
    p = fresh_pool(world)
    try:
        results = p.run(connections_over_steps, name, all_ranks_connected, False, 5, timeout=120)
    finally:
        p.close()
    texts = [r["failed"][0] if r["failed"] else "" for r in results]
    assert all(t.startswith(f"{step}: CommunicationError") for t in texts), texts
    assert all(r["seconds"][-1] < 5 + 5 for r in results), [r["seconds"] for r in results]
    held = [t for t in texts if "this would hang" in t and communicator in t]
    assert held and all("inside the step" in t and "no timeout of NCCL's and no abort ends that wait" in t
                        for t in held), texts


def test_destroy_process_group_ends_the_channels():
    """The channels a Pipeline opened (here its follow-up channels, on 2 ranks) are communicators c10d did not
    make: `destroy_process_group()` shuts each down (an NCCL one left would warn, or wait, at the process's
    exit) and the Pipeline lists none after it."""
    p = fresh_pool(2)
    try:
        results = p.run(channels_end_with_the_world, free_port(), timeout=120)
    finally:
        p.close()
    if not results[0]["c10d_finalises"]:
        pytest.skip("this torch's c10d keeps no list of communicators to finalise: the channels end when let go of")
    assert all(r["opened"] >= 2 and r["ended"] == r["opened"] and r["listed"] == 0 for r in results), results


@pytest.mark.parametrize("device", [False, True], ids=["host_path", "device_path"])
def test_an_exchange_that_times_out_breaks_the_group_on_both_ranks(device):
    """dualpipe's mirrors' exchange, rank 1 coming 6 s late with `timeout` 3 s: rank 0 raises a
    CommunicationError naming the exchange within the timeout and a few seconds, rank 1 one of its own once it
    comes (on gloo the timed-out wait closed the pair, which refuses rank 1's posting: that too is pipecore's
    error, gloo's text only its cause); both groups are broken (no later step may run on them)."""
    p = fresh_pool(2)
    try:
        results = p.run(exchange_times_out, device, timeout=120)
    finally:
        p.close()
    assert all(r["raised"].startswith("CommunicationError") and r["broken"] and "gloo" not in r["raised"]
               for r in results), results
    assert "summing mirrored dualpipe gradients with rank 1" in results[0]["raised"], results
    assert results[0]["seconds"] < 3 + 5, results
