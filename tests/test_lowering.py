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
    pairs = any(a.kind is Kind.OVERLAP_F_B for row in s.actions for a in row)  # a pair computes two stages
    low = s.lower(sharded=True, max_active_stages=2 if pairs else 1)
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


# -- torch 2.15's waits and unshard lookahead -----------------------------------------------------------------

_WAIT_CASES = [("1f1b", 2, 1), ("gpipe", 4, 1), ("interleaved_1f1b", 2, 2), ("zbv", 2, 2), ("dualpipev", 2, 2),
               ("interleaved_zb", 2, 2), ("looped_bfs", 2, 2)]


def _torch_215():
    """torch.distributed.pipelining.schedules where it has torch 2.15's waits, else the test is skipped."""
    from pipecore.compat.schedules import torch_has_waits

    if not torch_has_waits():
        pytest.skip("torch before 2.15 has no WAIT_SEND_F/WAIT_SEND_B/WAIT_REDUCE_GRAD")
    import torch.distributed.pipelining.schedules as torchs
    return torchs


@pytest.mark.parametrize("name,ranks,stages", _WAIT_CASES)
@pytest.mark.parametrize("defer", [False, True])
def test_waits_are_placed_after_what_they_wait_for_and_cost_nothing(name, ranks, stages, defer):
    s = pc.build_schedule(name, ranks, 4, stages)
    plain, waited = s.lower(), s.lower(waits=True, defer_reduce_grad_wait=defer)
    waited.validate()
    for row, bare in zip(_strs(waited), _strs(plain)):
        assert [a for a in row if "WAIT" not in a] == bare
        sends = [a for a in bare if "SEND_" in a]
        waits = [a for a in row if "WAIT_SEND" in a]
        assert sorted(w.replace("WAIT_", "") for w in waits) == sorted(sends)  # every send waited for once
        for w in waits:
            assert row.index(w) > row.index(w.replace("WAIT_", ""))
        reductions = [a for a in row if a.endswith("REDUCE_GRAD") and "WAIT" not in a]
        assert sorted(a for a in row if "WAIT_REDUCE_GRAD" in a) == sorted(r.replace("RED", "WAIT_RED") for r in reductions)
        if not defer:
            for r in reductions:
                assert row[row.index(r) + 1] == r.replace("RED", "WAIT_RED")
        else:  # at most one reduction pending
            pending = 0
            for a in row:
                pending += a in reductions
                pending -= "WAIT_REDUCE_GRAD" in a
                assert pending <= 1
    # the waits cost nothing and never stall a pipecore lowering (each send's peer posted its receive)
    assert waited.simulate().makespan == plain.simulate().makespan
    assert waited.compute_only() == plain.compute_only()


@pytest.mark.parametrize("name,ranks,stages", _WAIT_CASES)
@pytest.mark.parametrize("defer", [False, True])
def test_waits_are_placed_as_torch_215_places_them(name, ranks, stages, defer):
    """torch's own passes (_add_wait_send, _add_reduce_grad) over pipecore's rows give pipecore's."""
    torchs = _torch_215()
    s = pc.build_schedule(name, ranks, 4, stages)
    plain = s.lower()
    rows = {r: [torchs._Action.from_str(a) for a in row] for r, row in enumerate(_strs(plain))}
    theirs = torchs._add_wait_send(rows)
    ours = s.lower(waits=True)
    for r, row in enumerate(_strs(ours)):
        assert [str(a) for a in theirs[r]] == [a for a in row if "WAIT_REDUCE_GRAD" not in a]
    for r, row in enumerate(_strs(s)):  # the reductions on the compute rows, as torch's builders add them
        theirs = torchs._add_reduce_grad([torchs._Action.from_str(a) for a in row], 4, defer)
        ours = pc.schedule.lowering.add_waits(pc.schedule.lowering.add_reduce_grad(s.codes[r]), defer)
        assert [str(a) for a in theirs] == [str(pc.Action.from_code(c)) for c in ours]
    if name in ("zbv", "dualpipev", "interleaved_zb"):
        return  # pipecore's lowering merges I and W where torch's keeps them: the rows differ before the waits
    # torch's whole chain (its reductions, sends and receives, then the waits) on its own order
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    order = {r: [torchs._Action.from_str(a) for a in row] for r, row in enumerate(_strs(s))}
    order = {r: torchs._add_reduce_grad(row, 4, defer) for r, row in order.items()}
    mapping = generate_stage_to_rank_mapping(ranks, s.num_stages, style="loop")
    chain = torchs._add_wait_send(torchs._add_send_recv(order, stage_to_rank=lambda x: mapping[x],
                                                        num_stages=s.num_stages))
    ours = s.lower(waits=True, defer_reduce_grad_wait=defer)
    for r, row in enumerate(_strs(ours)):
        assert [str(a) for a in chain[r]] == row, r


def test_validator_refuses_misplaced_waits():
    good = pc.build_schedule("1f1b", 2, 2).lower(waits=True)
    rows = _strs(good)

    def with_row0(row):
        return Schedule([row, rows[1]], placement="loop")

    before = [a for a in rows[0] if a != "0WAIT_SEND_F0"]
    before.insert(before.index("0SEND_F0"), "0WAIT_SEND_F0")
    with pytest.raises(pc.ScheduleError, match="0WAIT_SEND_F0 waits for 0SEND_F0, which this rank has not run"):
        with_row0(before).validate()
    with pytest.raises(pc.ScheduleError, match="appears twice"):
        with_row0(rows[0] + ["0WAIT_SEND_F0"]).validate()
    with pytest.raises(pc.ScheduleError, match="stage 0 sends no gradients to another rank"):
        with_row0(rows[0] + ["0WAIT_SEND_B0"]).validate()
    with pytest.raises(pc.ScheduleError, match="waits for its reduction twice"):
        with_row0(rows[0] + ["0WAIT_REDUCE_GRAD"]).validate()
    # torch 2.15's rules for what it loads: a schedule that waits waits for every send and reduction
    with pytest.raises(pc.ScheduleError, match="0SEND_F1 has no 0WAIT_SEND_F1: a schedule that waits for its sends"):
        with_row0([a for a in rows[0] if a != "0WAIT_SEND_F1"]).validate()
    with pytest.raises(pc.ScheduleError, match="1REDUCE_GRAD has no 1WAIT_REDUCE_GRAD"):
        Schedule([rows[0], [a for a in rows[1] if a != "1WAIT_REDUCE_GRAD"]], placement="loop").validate()


def test_validator_refuses_two_reductions_pending_once_reductions_are_waited_for():
    rows = _strs(pc.build_schedule("interleaved_1f1b", 2, 4, 2).lower(waits=True, defer_reduce_grad_wait=True))
    Schedule(rows, placement="loop").validate()
    assert rows[0].index("2REDUCE_GRAD") < rows[0].index("2WAIT_REDUCE_GRAD") < rows[0].index("0REDUCE_GRAD")
    late = [a for a in rows[0] if a != "2WAIT_REDUCE_GRAD"] + ["2WAIT_REDUCE_GRAD"]  # 2's wait after 0's reduction
    with pytest.raises(pc.ScheduleError, match="a second reduction starts while stage 2's is pending"):
        Schedule([late, rows[1]], placement="loop").validate()


def test_a_pair_that_computes_more_sharded_stages_than_max_active_is_refused():
    s = pc.build_schedule("dualpipev", 2, 4, 2)
    with pytest.raises(pc.ScheduleError, match="computes 2 sharded stages at once, more than max_active_stages=1"):
        s.lower(sharded=True, max_active_stages=1)


@pytest.mark.parametrize("name,ranks,stages", [("interleaved_1f1b", 2, 2), ("zbv", 2, 2), ("dualpipev", 2, 2),
                                               ("looped_bfs", 2, 3), ("1f1b", 4, 1)])
@pytest.mark.parametrize("max_active,lookahead", [(2, 1), (2, 2), (3, 1), (3, 3)])
def test_a_lowered_row_gets_the_unshards_its_compute_row_gets(name, ranks, stages, max_active, lookahead):
    """What a Pipeline does (UNSHARD/RESHARD added to the lowered row): sends, receives and REDUCE_GRAD
    neither count nor move the window, so each all-gather is the compute-only row's."""
    from pipecore.schedule.lowering import add_unshard_reshard

    low = pc.build_schedule(name, ranks, 4, stages).lower()
    every = frozenset(range(low.num_stages))
    comm = {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRAD"}
    for r, row in enumerate(low.codes):
        on_lowered = [str(pc.Action.from_code(c)) for c in add_unshard_reshard(row, every, max_active, lookahead)]
        compute = [c for c in row if pc.Action.from_code(c).is_compute]
        on_compute = [str(pc.Action.from_code(c)) for c in add_unshard_reshard(compute, every, max_active, lookahead)]
        assert [a for a in on_lowered if pc.Action.parse(a).kind.name not in comm] == on_compute
        Schedule([on_lowered if q == r else [] for q in range(ranks)], num_stages=low.num_stages, num_microbatches=4,
                 placement=low.placement)


def test_a_wait_that_needs_a_receive_the_peer_posts_after_it_deadlocks():
    # rank 0 waits for its second send before receiving the first gradient; rank 1 waits for that
    # gradient's send before posting the second receive: each waits for the other
    s = Schedule([["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0WAIT_SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1",
                   "0WAIT_SEND_F0"],
                  ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1WAIT_SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1",
                   "1WAIT_SEND_B1"]],
                 placement="loop")
    with pytest.raises(pc.ScheduleError, match="deadlock"):
        s.validate()
    moved = [[a for a in row if "WAIT" not in a] for row in _strs(s)]
    moved[0] += ["0WAIT_SEND_F0", "0WAIT_SEND_F1"]
    moved[1] += ["1WAIT_SEND_B0", "1WAIT_SEND_B1"]
    Schedule(moved, placement="loop").validate()  # the same waits at the end are fine


@pytest.mark.parametrize("name,ranks,stages", [("interleaved_1f1b", 2, 4), ("zbv", 2, 2), ("dualpipev", 2, 2),
                                               ("looped_bfs", 2, 3)])
@pytest.mark.parametrize("max_active,lookahead", [(1, 1), (2, 1), (3, 1), (3, 2), (3, 3), (2, 2)])
def test_unshard_lookahead_fetches_fewer_ahead_and_keeps_residency(name, ranks, stages, max_active, lookahead):
    s = pc.build_schedule(name, ranks, 4, stages)
    if name == "dualpipev" and max_active == 1:
        return  # an OVERLAP_F_B pair computes two stages at once: refused (below)
    low = s.lower(sharded=True, max_active_stages=max_active, unshard_lookahead=lookahead)
    low.validate()  # every stage unsharded when it computes
    for row in _strs(low):
        unsharded: list[str] = []
        computes = [a for a in row if a[1:2] in "FIWB(" and "SEND" not in a and "RECV" not in a]
        for k, a in enumerate(row):
            if a.endswith("UNSHARD") and not a.endswith("RESHARD"):
                unsharded.append(a[:-len("UNSHARD")])
                # fetched only when it is among the next `lookahead` stages this row computes
                nxt = row[k + 1:]
                upcoming: list[str] = []
                for b in nxt:
                    for stage in _stages_of(b):
                        if stage not in upcoming:
                            upcoming.append(stage)
                    if len(upcoming) >= lookahead:
                        break
                assert unsharded[-1] in upcoming
            elif a.endswith("RESHARD"):
                unsharded.remove(a[:-len("RESHARD")])
            assert len(unsharded) <= max(max_active, 2)
        assert not unsharded and computes


def _stages_of(action: str) -> list[str]:
    a = pc.Action.parse(action)
    return [str(leaf.stage) for leaf in a.leaves()] if a.is_compute else []


@pytest.mark.parametrize("name,ranks,stages", [("interleaved_1f1b", 2, 4), ("zbv", 2, 2), ("dualpipev", 2, 2),
                                               ("looped_bfs", 2, 3)])
@pytest.mark.parametrize("max_active,lookahead", [(2, 1), (3, 1), (3, 2), (3, 3)])
def test_unshard_lookahead_places_as_torch_215(name, ranks, stages, max_active, lookahead):
    torchs = _torch_215()
    s = pc.build_schedule(name, ranks, 4, stages)
    for r, row in enumerate(_strs(s)):
        theirs = torchs._add_unshard_reshard([torchs._Action.from_str(a) for a in row], max_active,
                                             unshard_lookahead=lookahead)
        ours = pc.schedule.lowering.add_unshard_reshard(s.codes[r], frozenset(range(s.num_stages)), max_active,
                                                        lookahead)
        assert [str(a) for a in theirs] == [str(pc.Action.from_code(c)) for c in ours]
