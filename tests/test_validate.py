"""The validator names rank, step and action, and shows the timeline around the problem."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipecore as pc
from pipecore import Schedule, ScheduleError


def _error(actions, **kw):
    with pytest.raises(ScheduleError) as info:
        Schedule(actions, **kw).validate()
    return str(info.value)


def test_valid_hand_written_schedule():
    s = Schedule([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]])
    assert s.validate() is s
    assert s.num_stages == 2 and s.num_microbatches == 2 and s.placement == "loop"


def test_backward_before_forward():
    msg = _error([["0F0", "0B1", "0F1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]])
    assert msg.startswith("rank 0, step 1, action 0B1: backward runs before its forward 0F1 (step 2)")
    assert "Rank 0" in msg and "<-- rank 0" in msg


def test_missing_backward():
    msg = _error([["0F0", "0F1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]])
    assert "rank 0, step 3 (end of its list): missing the backward of 0F1" in msg


def test_missing_forward():
    msg = _error([["0F0", "0B0"], ["1F0", "1B0", "1B1"]], num_microbatches=2)
    assert "missing 0F1" in msg


def test_wrong_rank_for_stage():
    msg = _error([["0F0", "0B0", "1F0", "1B0"], []], placement="loop")
    assert "rank 0, step 2, action 1F0: stage 1 is placed on rank 1" in msg


def test_duplicate_action():
    msg = _error([["0F0", "0F0", "0B0"]])
    assert "rank 0, step 1, action 0F0: 0F0 appears twice" in msg


def test_w_without_i_and_w_before_i():
    assert "has no matching 0W0" in _error([["0F0", "0I0"]])
    assert "0W0 runs before 0I0" in _error([["0F0", "0W0", "0I0"]])
    assert "runs a full backward but" in _error([["0F0", "0I0", "0B0", "0W0"]])


DEADLOCK = [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]]


def test_deadlock_is_reported_with_both_ranks():
    # rank 1 wants microbatch 1 first, rank 0 sends it only after microbatch 0's backward
    msg = _error(DEADLOCK)
    assert "deadlock" in msg
    assert "rank 0 at step 1 (0B0) waits for the backward of 1B0 on rank 1" in msg
    assert "rank 1 at step 0 (1F1) waits for 0F1 on rank 0" in msg


def test_microbatch_out_of_range():
    msg = _error([["0F0", "0B0", "0F5", "0B5"]], num_microbatches=2)
    assert "microbatch 5" in msg


def test_lowered_missing_recv_and_channel_order():
    low = pc.build_schedule("1f1b", 2, 2).lower()
    rows = [[str(a) for a in row] for row in low.actions]
    broken = [list(r) for r in rows]
    broken[1].remove("1RECV_F1")
    with pytest.raises(ScheduleError, match="needs 1RECV_F1 before it"):
        Schedule(broken).validate()
    swapped = [list(r) for r in rows]
    swapped[1].remove("1RECV_F1")
    swapped[1].insert(0, "1RECV_F1")  # rank 0 sends microbatch 0 first
    with pytest.raises(ScheduleError, match="both sides must agree on the order"):
        Schedule(swapped).validate()


def test_lowered_send_before_producer():
    low = pc.build_schedule("gpipe", 2, 1).lower()
    rows = [[str(a) for a in row] for row in low.actions]
    rows[0].remove("0SEND_F0")
    rows[0].insert(0, "0SEND_F0")
    with pytest.raises(ScheduleError, match="comes before 0F0 computes what it sends"):
        Schedule(rows).validate()


def test_reduce_grad_before_last_backward():
    with pytest.raises(ScheduleError, match="REDUCE_GRAD of stage 0 comes before its last backward"):
        Schedule([["0F0", "0F1", "0B0", "0REDUCE_GRAD", "0B1"]]).validate()


def test_non_action_items():
    with pytest.raises(ScheduleError, match="rank 0, step 1: expected an Action"):
        Schedule([["0F0", 3]])
    with pytest.raises(ScheduleError, match="rank 1, step 0: cannot parse action 'oops'"):
        Schedule([["0F0"], ["oops"]])


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from([n for n in pc.SCHEDULES if n != "forward_only"]), data=st.data())
def test_property_corrupted_schedules_fail(name, data):
    """Dropping any one compute action from a valid schedule is always caught."""
    R = data.draw(st.sampled_from([2, 4]) if name == "dualpipe" else st.integers(2, 4))
    m = data.draw(st.sampled_from([2 * R, 4 * R]))
    s = pc.build_schedule(name, R, m)
    rows = [[str(a) for a in row] for row in s.actions]
    rank = data.draw(st.integers(0, R - 1))
    step = data.draw(st.integers(0, len(rows[rank]) - 1))
    del rows[rank][step]
    with pytest.raises(ScheduleError):
        Schedule(rows, s.num_stages, m, placement=s.placement).validate()


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(pc.SCHEDULES), data=st.data())
def test_property_swaps_either_validate_or_name_the_problem(name, data):
    """Swapping two actions on one rank gives a schedule that validates and lowers, or an error
    that names a rank, a step and an action."""
    R = data.draw(st.sampled_from([2, 4]) if name == "dualpipe" else st.integers(2, 4))
    m = 2 * R
    s = pc.build_schedule(name, R, m)
    rows = [[str(a) for a in row] for row in s.actions]
    rank = data.draw(st.integers(0, R - 1))
    i = data.draw(st.integers(0, len(rows[rank]) - 1))
    j = data.draw(st.integers(0, len(rows[rank]) - 1))
    rows[rank][i], rows[rank][j] = rows[rank][j], rows[rank][i]
    t = Schedule(rows, s.num_stages, m, placement=s.placement)
    try:
        t.validate()
    except ScheduleError as exc:
        assert str(exc).startswith("rank ") and ", step " in str(exc)
        return
    t.lower().validate()
