"""OVERLAP_F_B pairs (pipecore/runtime/overlap.py): concurrent, lock-step and hooked pairs train exactly like
sequential ones and like one process; the halves really run at once; failures end the step everywhere."""

import pytest

import pipecore as pc
from dist_pool import pool
from overlap_cases import (bad_hooks, checkpoints_run_in_sequence, collectives_in_both_halves, failing_half,
                           halves_run_at_once, hooked_pipelines_are_freed, hooks_get_their_pairs, modes_match,
                           some_checkpoints_and_dropout, traced_lanes)

PAIRED = [("dualpipev", 2, 4), ("dualpipev", 2, 8), ("dualpipev", 4, 8), ("dualpipe", 2, 4), ("dualpipe", 4, 8)]


@pytest.mark.parametrize("kind", ["mlp", "transformer", "multi"])
@pytest.mark.parametrize("name, world, m", PAIRED)
def test_every_mode_trains_like_one_process_and_alike_to_the_bit(name, world, m, kind):
    pairs = pool(world).run(modes_match, name, m, kind)
    assert sum(pairs) > 0  # the schedule has pairs to overlap


@pytest.mark.parametrize("name, world, m", [("dualpipev", 2, 4), ("dualpipe", 2, 4), ("dualpipev", 4, 8)])
def test_every_mode_on_the_device_path_protocol(name, world, m):
    # the device path's protocol run by the host on gloo, the last step at a new batch shape ("shapes
    # changed" statuses folded from both halves' threads)
    pairs = pool(world).run(modes_match, name, m, "multi", 3, "device")
    assert sum(pairs) > 0


@pytest.mark.parametrize("mode", ["concurrent", "lockstep"])
@pytest.mark.parametrize("name, world, m", [("dualpipev", 2, 6), ("dualpipe", 2, 4), ("dualpipev", 4, 8)])
def test_the_halves_of_a_pair_run_at_once(name, world, m, mode):
    results = pool(world).run(halves_run_at_once, name, m, mode, timeout=120)
    for r in results:
        assert r["waited"] == 2 * r["pairs"] and r["overlapped"] == 2 * r["pairs"], r
        assert r["forward_on_main"] and r["backward_elsewhere"], r
        if mode == "lockstep":
            assert r["most_at_once"] == 1, r  # one half computes at a time


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("name, world", [("dualpipev", 2), ("dualpipe", 2), ("dualpipev", 4)])
def test_a_failing_half_ends_the_step_on_every_rank(name, world, where):
    results = pool(world).run(failing_half, name, where, timeout=120)
    for rank, (first, ran_overlapped) in enumerate(results):
        kind, msg = first
        if rank == 0:
            assert kind == "RuntimeError" and f"boom in the {where} half" in msg, first
            assert ran_overlapped  # it failed inside a pair that ran at once
        else:
            assert kind == "PeerFailedError" and "rank 0 failed" in msg and "boom" in msg, (rank, first)


@pytest.mark.parametrize("how", ["backward_first", "threads", "lockstep", "module"])
@pytest.mark.parametrize("name, world", [("dualpipev", 2), ("dualpipe", 2)])
def test_hooks_are_called_with_their_pairs(name, world, how):
    assert sum(pool(world).run(hooks_get_their_pairs, name, how)) > 0


@pytest.mark.parametrize("how, needle", [
    ("skip", "returned without running its backward half"),
    ("late", "returned without running its backward half"),
    ("twice", "already ran: each half runs once"),
    ("raise", "the hook's own error"),
])
def test_a_bad_hook_fails_the_step_everywhere(how, needle):
    results = pool(2).run(bad_hooks, "dualpipev", how)
    for rank, (kind, msg) in enumerate(results):
        assert needle in msg, (rank, kind, msg)


def test_checkpointed_backwards_run_in_sequence():
    assert sum(pool(2).run(checkpoints_run_in_sequence, "dualpipev")) > 0


@pytest.mark.parametrize("name", ["dualpipev", "dualpipe"])
def test_each_backward_is_checked_for_checkpoints(name):
    assert sum(pool(2).run(some_checkpoints_and_dropout, name, timeout=180)) > 0  # the others overlapped


def test_lockstep_keeps_collectives_in_one_order_on_every_rank():
    assert all(pool(2).run(collectives_in_both_halves, "lockstep"))


def test_pipelines_with_hooks_are_freed():
    assert all(pool(2).run(hooked_pipelines_are_freed))


def test_backward_halves_have_a_trace_row_of_their_own():
    assert sum(pool(2).run(traced_lanes, "dualpipev")) > 0


def test_pipeline_checks_overlap_f_b():
    import torch.distributed as dist  # noqa: F401 - Pipeline needs a group: checked in-process below

    from pipecore.runtime.overlap import PairRunner

    with pytest.raises(ValueError, match="overlap mode must be one of"):
        PairRunner(None, [], [], "parallel")
    import inspect

    assert inspect.signature(pc.Pipeline).parameters["overlap_f_b"].default == "lockstep"
    with pytest.raises(TypeError, match="overlap_f_b must be"):
        PairRunner(None, [], [], 3)


def test_simulator_prices_pairs_as_the_executor_runs_them():
    s = pc.build_schedule("dualpipev", 4, 8)
    costs = {"F": 1.0, "B": 2.0}
    concurrent = s.simulate(costs, overlap="concurrent").makespan
    sequential = s.simulate(costs, overlap="sequential").makespan
    assert concurrent < sequential
    assert s.simulate(costs).makespan == s.simulate(costs, overlap="lockstep").makespan == sequential
    assert s.simulate(dict(costs, OVERLAP_F_B=max), overlap="sequential").makespan == concurrent
    with pytest.raises(ValueError, match="overlap must be"):
        s.simulate(costs, overlap="both")
