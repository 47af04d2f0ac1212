"""The device path against the CPU model of NCCL (csrc/testing/host_device_comm.cpp), for the
hazards a review of the NCCL path found (issue 51): each hazard's case failed on the code before its
fix. The last cases drive the model itself one batch at a time (`_C.NcclModel`), for what it must
report where NCCL would hang."""

from datetime import timedelta

import pytest

from dist_pool import fresh_pool, pool
from exactness import FLOAT64_BOUND
from nccl_model_cases import (descriptions_on_a_communicator_of_their_own, grown_messages_cross_without_the_store, shapes_in_messages_on_one_rank,
                              side_tensors_cross, store_operations_per_step, stuck_replica_aborts_its_group,
                              timed_out_send_is_held)
from nccl_model_rules_cases import (a_device_wide_sync_waits_for_a_peer, group_end_failure_leaves_no_group_open,
                                     groups_on_one_communicator_run_in_order, sends_complete_eagerly_up_to,
                                     posting_error_aborts_the_communicator,
                                     receive_of_another_size, release_on_the_posting_stream,
                                     send_to_self_without_its_receive)
from pipecore.errors import InputError
from pipecore.runtime.message_path import check_device_path_settings
from shaped_message_cases import LENGTHS, step_lengths, steps_for


@pytest.mark.parametrize("messages", ["large", "default"])
def test_tensors_of_dtypes_nccl_lacks_cross_as_bytes(messages):
    # M1: an int16 mask and complex64 frequencies beside the activations. "large": each tensor goes
    # from its own storage, not packed into one byte buffer; NCCL would refuse their dtypes inside the
    # batch's group, after some of it was posted (the model refused them: "a send of Short").
    pool(2).run(side_tensors_cross, messages, timeout=120)


class _NcclOptions:  # what c10d's ProcessGroupNCCL backend shows of its options
    def __init__(self, seconds):
        self._timeout = timedelta(seconds=seconds)


@pytest.mark.parametrize("timeout, group_s, environ, refused", [
    (300, 600, {}, None),
    (600, 600, {}, "not below its NCCL group's (600 s)"),
    (900, 600, {}, "timeout=, or the group a larger one"),
    (60, 600, {"TORCH_NCCL_BLOCKING_WAIT": "1"}, "unset TORCH_NCCL_BLOCKING_WAIT"),
    (60, 600, {"NCCL_BLOCKING_WAIT": "1"}, "unset NCCL_BLOCKING_WAIT"),
    (60, 600, {"TORCH_NCCL_BLOCKING_WAIT": "0"}, None),
])
def test_the_device_path_refuses_a_watchdog_or_blocking_wait_that_would_act_first(timeout, group_s, environ, refused):
    # M4: at or above the group's timeout, c10d's watchdog kills a rank whose transfer is stuck before
    # the Pipeline's timeout aborts the communicator with its message; with blocking wait the host
    # waits for every batch. Both were accepted silently.
    backend = type("NcclBackend", (), {"options": _NcclOptions(group_s)})()
    if refused is None:
        check_device_path_settings("rank 3", timeout, backend, environ)
        return
    with pytest.raises(InputError, match="rank 3: ") as caught:
        check_device_path_settings("rank 3", timeout, backend, environ)
    assert refused in str(caught.value), caught.value


def test_a_message_grown_past_64_mib_follows_over_the_communicator_not_the_store():
    # H1: a device message that outgrew its capacity followed through the group's TCPStore, which
    # refuses values over 8 MiB: the sender's set failed and the receiver waited out its timeout. Steps
    # 1-3: within the plan's capacity, then growth to 64 MiB per message (a sequence of 65,536 by 128
    # in float64), then within the grown capacity again: no store operation in any of them.
    lengths = [64, 32, 65536, 32768]
    results = pool(2).run(grown_messages_cross_without_the_store, lengths, timeout=300)
    for rank, (ops, largest, grown) in enumerate(results):
        assert ops == [0, 0, 0], (rank, ops, largest)
        assert grown == [0, 0, 2, 0], (rank, grown)  # both microbatches: activations on rank 0, gradients on 1


@pytest.mark.parametrize("path", ["default", "device"])
def test_new_batch_shapes_are_learnt_without_the_store(path):
    # Scale: the first step of each batch shape learnt its boundaries through rank 0's store, a set,
    # a wait, a get and a delete per boundary and microbatch (at 1,000 pipelines x 16 stages x 32
    # microbatches, two million operations against one server at every new shape). Now descriptions
    # go point to point: a new shape makes no store operation, and the first step as many with 2
    # microbatches as with 8 (before: steps with a new shape made 5 + m on rank 0, 5 + 3m on rank 1).
    rows = [4, 4, 6, 4, 3]  # a new shape at steps 3 and 5 (step 4's was learnt at step 1)
    first = {}
    for m in (2, 8):
        results = pool(2).run(store_operations_per_step, "1f1b", m, path, rows, timeout=180)
        for rank, ops in enumerate(results):
            assert ops[1:] == [0, 0, 0, 0], (m, rank, ops)
            first.setdefault(rank, set()).add(ops[0])
    assert all(len(counts) == 1 for counts in first.values()), first


def test_descriptions_match_by_step_stage_and_microbatch_whatever_their_order():
    # Where the group has no gloo (NCCL), descriptions go on a communicator of their own, matched by
    # order alone: a receiver keeps those it did not ask for yet and drops an earlier step's.
    _, (read, kept) = pool(2).run(descriptions_on_a_communicator_of_their_own, timeout=120)
    assert read[:3] == [None, True, b"short"], read
    assert kept == [True, True, False], kept
    assert read[3] == "OutOfStep: 1024 bytes from rank 0 that are not a boundary description", read
    assert read[4] == "DescriptionTimeout: nothing arrived from rank 0", read


def test_ranks_whose_messages_differ_are_refused_at_the_first_step():
    # M2: variable_shapes on one rank only. On NCCL its messages and the receives posted for them
    # differ in size, which hangs; on gloo a receiver saw a channel out of step. Now the first
    # agreement compares how each rank's messages go and every rank raises at once.
    results = pool(2).run(shapes_in_messages_on_one_rank, timeout=120)
    for rank, (kind, text, seconds) in enumerate(results):
        assert kind == "InputError", (rank, kind, text)
        assert (f"rank {rank}: the ranks were built with different pipelines (messages: rank 0 'gloo, shapes in "
                "every message', rank 1 'gloo, a plan per batch shape')") in text, (rank, text)
        assert "variable_shapes" in text, text


def test_a_timed_out_send_keeps_its_buffers_until_the_executor_goes():
    # H3: the send tracker dropped a timed-out send's parts and Works at once, while NCCL may still
    # read them until its communicator is aborted (c10d's own stash is not pipecore's guarantee). Held
    # now until the executor goes, which comes after the abort.
    p = pool(2)
    results = p.run(timed_out_send_is_held, timeout=120)
    p.broken = True  # its subgroup is broken by design
    outcome, held = results[0]
    assert outcome == "CommunicationError" and held >= 1, results


def test_a_stuck_gradient_reduction_aborts_the_data_parallel_group():
    # H2: a data-parallel reduction that timed out marked the pipeline's group broken and aborted its
    # communicator, not the data-parallel one the reduction was stuck on.
    p = pool(2)
    results = p.run(stuck_replica_aborts_its_group, timeout=120)
    p.broken = True  # its groups are broken by design
    (kind, text), asked = results[0]
    assert kind == "CommunicationError" and "data-parallel" in text, results[0]
    assert asked[:2] == ["dp", "pp"], asked
    assert "aborted the data-parallel group's and the pipeline group's NCCL communicators" in text, text


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name, world, overlap", [("zbv", 2, None), ("interleaved_1f1b", 3, None),
                                                  ("dualpipev", 2, "concurrent")])
def test_grown_messages_follow_in_order_under_random_delays(name, world, overlap, seed):
    # H1's order: a receiver takes one peer's follow-ups in the order that peer sent them, whichever
    # header an action reads first (V schedules: activations and gradients between the same two ranks;
    # dualpipev's pairs: two threads reading at once), with random delays before every send and
    # receive drawn from several seeds. Step 2 outgrows every capacity; all steps exact.
    results = pool(world).run(step_lengths, name, steps_for(LENGTHS, world), None, None, 300, overlap, True, seed,
                              timeout=240)
    for rank, r in enumerate(results):
        assert not r["failed"] and r["grad"] <= FLOAT64_BOUND and r["violations"] == [], (rank, r)
        assert r["plans"] == [1] * len(LENGTHS), (rank, r)
    assert sum(r["counts"][2][2] for r in results) > 0, results


# The model itself, driven one batch at a time (nccl_model_rules_cases.py): each case leaves operations
# posted that never complete, so its processes go with the module.
@pytest.fixture(scope="module")
def model_pool():
    p = fresh_pool(2)
    yield p
    p.close()


def test_a_receive_of_another_size_than_its_send_is_named_on_both_ranks(model_pool):
    (sender, _), (receiver, _) = model_pool.run(receive_of_another_size, timeout=60)
    for text, mine, theirs in [(sender, "rank 0's send to rank 1 (512 bytes, action 0)", "rank 1's receive"),
                               (receiver, "rank 1's receive from rank 0 (384 bytes, action 0)", "rank 0's send")]:
        assert "this would hang" in text and mine in text and theirs in text, text


def test_a_send_to_self_without_its_receive_in_the_group_is_refused(model_pool):
    # NCCL on one GPU (tests/test_cuda.py's loopback): "Trying to send to self without a matching recv"
    for rank, text in enumerate(model_pool.run(send_to_self_without_its_receive, timeout=60)):
        assert f"1 send(s) to rank {rank} itself and 0 receive(s) from it" in text, text
        assert "invalid usage" in text, text


def test_a_posting_error_aborts_the_communicator_and_ends_its_pending_operations(model_pool):
    # H2/M1 on the device path: the batch's first send was added when the second failed; the group is
    # ended (NCCL launches that half), then the communicator aborted, which ends every pending operation
    # (here a receive that would have waited 30 s) and refuses later posts.
    (posting, ended, seconds, after), (timed_out, waited, received) = model_pool.run(
        posting_error_aborts_the_communicator, timeout=60)
    assert "out of memory while posting the send to rank 1" in posting, posting
    assert "communicator was aborted" in posting, posting
    # the half reached rank 1 before the abort, or never did
    assert (received, timed_out) == (8.0, None) or (received == 0 and "did not complete" in timed_out
                                                    and waited >= 2.5), (timed_out, waited, received)
    assert "communicator was aborted" in ended and seconds < 1, (ended, seconds)
    assert "nothing more can be posted" in after, after


def test_a_failed_posting_leaves_no_nccl_group_open_on_its_thread(model_pool):
    # issue 61 (5): the communicator was aborted inside the open group, whose end then failed, leaving
    # c10d's per-thread count of open groups raised: a later operation alone on that thread joined a
    # group that never ends ("posted alone while c10d counts 1 NCCL group(s) open on this thread").
    # The group is now ended first.
    # A peer out of range, which NCCL refuses inside the group (its end then fails, whatever the order), is
    # now refused before the group opens.
    (refused, failed, alone), (receiving, received) = model_pool.run(group_end_failure_leaves_no_group_open,
                                                                     timeout=60)
    assert "rank 5, which a communicator of 2 ranks does not have); nothing of it was posted" in refused, refused
    assert "out of memory" in failed and "communicator was aborted" in failed, failed
    assert alone is None and receiving is None and received == 8.0, (alone, receiving, received)


def test_groups_on_one_communicator_launch_one_after_another(model_pool):
    results = model_pool.run(groups_on_one_communicator_run_in_order, timeout=60)
    for rank, (together, waited, queued) in enumerate(results):
        assert together == [float(2 - rank)] * 4, together
        assert f"a receive from rank {1 - rank}" in waited and "did not complete" in waited, waited
        assert "never launched" in queued and "would hang" in queued, queued


def test_a_receive_let_go_of_waits_on_the_stream_that_posted_it(model_pool):
    # M5: the release's wait went to the stream current on the releasing thread (before the fix:
    # "freed to the compute stream's pool while the communication stream may still use it").
    for dropped, after in model_pool.run(release_on_the_posting_stream, timeout=60):
        assert dropped == [], dropped
        assert len(after) == 1, after  # both uses named: the transfer on one stream, the free on the other
        assert "freed to the compute stream's pool (letting go of the receive from rank" in after[0], after
        assert "while the communication stream may still use it (the receive from rank" in after[0], after


@pytest.mark.parametrize("eager_bytes", [0, 1024])
def test_small_sends_complete_before_their_receiver_posts_as_with_nccl_eager_protocol(model_pool, eager_bytes):
    """Issue 61: by default every send is a rendezvous (the strictest protocol: what completes on the model
    completes on every one of NCCL's); with eager_bytes, a send up to that size completes before its
    receiver posts, from a copy (the sender overwrote its buffer), and a larger one does not."""
    (small, large), received = model_pool.run(sends_complete_eagerly_up_to, eager_bytes, timeout=60)
    assert (small is None) == (eager_bytes >= 64), small
    assert large is not None and "did not complete" in large, large
    if eager_bytes:
        assert received[0] == [1.0], received  # (sent from a copy: rank 0 had overwritten its buffer)


def test_a_device_wide_sync_that_waits_for_a_peer_reports_the_hang(model_pool):
    """Issue 61: the model's device-wide synchronisation (cudaFree, empty_cache) holds the host until every
    stream completed its work; a transfer that waits for what this host posts next is the hang it would be,
    named, within the timeout; everything completes once the host posts it."""
    (error, received), _ = model_pool.run(a_device_wide_sync_waits_for_a_peer, timeout=60)
    assert received == [2.0] * 4, received
    assert "cudaFree (the caching allocator off) on device 7 holds the host" in error, error
    assert "the group: a receive from rank 1 (32 bytes" in error and "this would hang" in error, error
