import pytest

import pipecore as pc
from pipecore import Kind, Schedule


def _strs(s):
    return [[str(a) for a in row] for row in s.actions]


def test_two_rank_gpipe_lowered_exactly():
    low = pc.build_schedule("gpipe", 2, 2).lower()
    assert _strs(low) == [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1", "0REDUCE_GRAD"],
        ["1RECV_F0", "1F0", "1RECV_F1", "1F1", "1B0", "1SEND_B0", "1B1", "1SEND_B1", "1REDUCE_GRAD"],
    ]
    assert low.is_lowered and low.compute_only() == pc.build_schedule("gpipe", 2, 2)


def test_merge_adjacent_i_w():
    s = Schedule([["0F0", "0I0", "0W0", "0F1", "0I1", "0F2", "0W1", "0I2", "0W2"]])
    low = s.lower()
    assert _strs(low) == [["0F0", "0B0", "0F1", "0I1", "0F2", "0W1", "0B2", "0REDUCE_GRAD"]]
    kept = s.lower(merge_iw=False)
    assert "0I0" in _strs(kept)[0]


def test_input_gradient_another_rank_awaits_is_sent_before_w():
    # zbv on 2 ranks: rank 1 holds stages 1 and 2. Stage 1's input gradient goes to rank 0, so its
    # I and W stay apart with the SEND_B between them; stage 2's previous stage is local (merged).
    low = pc.build_schedule("zbv", 2, 4).lower()
    row = _strs(low)[1]
    assert "1B0" not in row and "2I0" not in row and "2B0" in row
    i = row.index("1I0")
    assert row[i + 1] == "1SEND_B0" and row.index("1W0") > i + 1
    # rank 0: stage 3's input gradient goes to rank 1 (kept split); stage 0 is the first (merged
    # where the schedule puts I right before W)
    row0 = _strs(low)[0]
    assert "3B0" not in row0 and row0[row0.index("3I0") + 1] == "3SEND_B0"


def test_reduce_grad_after_each_stages_last_backward():
    low = pc.build_schedule("interleaved_1f1b", 2, 4).lower()
    for rank, row in enumerate(low.actions):
        for stage in low.rank_stages(rank):
            idx = row.index(pc.Action(stage, Kind.REDUCE_GRAD))
            last = max(i for i, a in enumerate(row) if a.stage == stage and a.kind in (Kind.B, Kind.W))
            # right after the last backward: only that backward's communication in between
            assert idx > last and all(a.is_comm or a.kind is Kind.REDUCE_GRAD for a in row[last + 1:idx])
    assert not any(a.kind is Kind.REDUCE_GRAD for row in pc.build_schedule("forward_only", 2, 4).lower().actions
                   for a in row)
    assert not any(a.kind is Kind.REDUCE_GRAD for row in pc.build_schedule("1f1b", 2, 4).lower(reduce_grad=False).actions
                   for a in row)


def test_reduce_grad_counts_split_backward_and_overlap():
    low = pc.build_schedule("dualpipev", 2, 4).lower(merge_iw=False)
    low.validate()
    for rank, row in enumerate(low.actions):
        assert sum(a.kind is Kind.REDUCE_GRAD for a in row) == 2


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zbv", "dualpipev", "dualpipe"])
def test_unshard_reshard(name):
    s = pc.build_schedule(name, 4, 8)
    low = s.lower(sharded=True, max_active_stages=1)
    low.validate()
    for rank, row in enumerate(low.actions):
        unsharded = set()
        for a in row:
            if a.kind is Kind.UNSHARD:
                unsharded.add(a.stage)
            elif a.kind is Kind.RESHARD:
                unsharded.discard(a.stage)
            elif a.is_compute:
                assert all(leaf.stage in unsharded for leaf in a.leaves())
        assert not unsharded
    only_first = s.lower(sharded=[0])
    assert {a.stage for row in only_first.actions for a in row if a.kind is Kind.UNSHARD} == {0}
    with pytest.raises(pc.ScheduleError, match="do not exist"):
        s.lower(sharded=[99])


def test_no_comm_between_stages_on_the_same_rank():
    low = pc.build_schedule("zbv", 2, 4).lower()
    # stages 1 and 2 both live on rank 1: nothing is sent between them
    assert not any(a.is_comm and a.stage in (1, 2) and a.kind in (Kind.SEND_F, Kind.RECV_F)
                   and (a.stage == 1) == (a.kind is Kind.SEND_F) for row in low.actions for a in row)


def test_lower_reports_deadlock():
    s = Schedule([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]])
    with pytest.raises(pc.ScheduleError, match="schedule deadlocks") as err:
        s.lower()
    assert "rank 0, step 1, action 0B0 waits for 1I/B0" in str(err.value)
    assert "rank 1, step 0, action 1F1 waits for 0F1" in str(err.value)


def test_lowering_is_idempotent_on_compute():
    s = pc.build_schedule("interleaved_zb", 4, 8)
    assert s.lower().lower() == s.lower()
