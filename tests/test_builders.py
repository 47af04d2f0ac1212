"""Every schedule, over a grid of ranks x microbatches: complete, dependency-correct, its lowered
form deadlock-free, and no slower (simulated) than torch.distributed.pipelining's."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_reference
import pipecore as pc
from pipecore.schedule.builders import unsupported
from torch_schedules import TORCH_CLASSES, torch_order

RANKS = [1, 2, 3, 4, 8]
MICROBATCHES = [1, 2, 3, 4, 6, 8, 16]
COSTS = [
    {"F": 1, "B": 2, "I": 1, "W": 1},
    {"F": 1, "B": 2, "I": 1, "W": 1, "comm": 0.25},
    {"F": 1, "B": 3, "I": 2, "W": 1, "comm": 1},
]


def _grid():
    """Every size each schedule runs (those it refuses are in test_unsupported_combinations_say_why;
    a builder that raises for a size it claims to run fails, never skips)."""
    for name in pc.SCHEDULES:
        for R in RANKS:
            for m in MICROBATCHES:
                if unsupported(name, R, m) is None:
                    yield name, R, m


@pytest.mark.parametrize("name, R, m", list(_grid()))
def test_schedule_is_complete_and_runs(name, R, m):
    s = pc.build_schedule(name, R, m)
    assert s.num_ranks == R and s.num_microbatches == m
    assert not s.is_lowered
    s.validate()
    low = s.lower()
    low.validate()
    assert low.compute_only().num_ranks == R
    # no communication between stages that share a rank
    for rank, row in enumerate(low.actions):
        for a in row:
            if a.is_comm:
                peer_stage = a.stage + 1 if a.kind in (pc.Kind.SEND_F, pc.Kind.RECV_B) else a.stage - 1
                if s.placement == "dualpipe":
                    peer_stage = (s.topology.next_stage if a.kind in (pc.Kind.SEND_F, pc.Kind.RECV_B)
                                  else s.topology.prev_stage)[a.stage]
                assert s.stage_to_rank(peer_stage) != rank, (rank, a)
    result = s.simulate(COSTS[0])
    assert result.makespan > 0 and 0 <= result.bubble_ratio < 1


@pytest.mark.parametrize("name, R, m", [(name, R, m) for name in sorted(TORCH_CLASSES) for R in [1, 2, 4, 8]
                                          for m in [1, 2, 4, 6, 8, 16] if unsupported(name, R, m) is None])
def test_no_worse_than_torch(name, R, m):
    V = 1 if name in ("gpipe", "1f1b") else 2
    ours = pc.build_schedule(name, R, m, V)
    try:
        reference = torch_order(name, R, m, V)
    except Exception as exc:  # torch refuses the combination too
        pytest.skip(f"torch cannot build it: {exc}")
    theirs = pc.Schedule(reference, ours.num_stages, m, placement=ours.placement)
    theirs.validate()
    for costs in COSTS:
        assert ours.simulate(costs).makespan <= theirs.simulate(costs).makespan + 1e-9, costs


@pytest.mark.parametrize("name", sorted(TORCH_CLASSES))
@pytest.mark.parametrize("R, m", [(2, 4), (4, 8), (4, 12)])
def test_torch_validator_accepts_ours(name, R, m):
    from torch.distributed.pipelining.schedules import _Action, _add_send_recv, _simulate_comms_compute, _validate_schedule

    V = 1 if name in ("gpipe", "1f1b") else 2
    s = pc.build_schedule(name, R, m, V)
    order = {r: [_Action.from_str(str(a)) for a in row] for r, row in enumerate(s.actions)}
    mapping = _validate_schedule(order, R, s.num_stages, m)
    assert all(mapping[st] == s.stage_to_rank(st) for st in mapping)
    if name == "dualpipev":
        return  # torch's comm simulator does not take OVERLAP_F_B containers
    low = s.lower(reduce_grad=False)
    lowered = {r: [_Action.from_str(str(a)) for a in row] for r, row in enumerate(low.actions)}
    _simulate_comms_compute(lowered, s.stage_to_rank, s.num_stages)  # raises if it cannot progress
    _add_send_recv({r: list(v) for r, v in order.items()}, s.stage_to_rank, s.num_stages)


def test_same_actions_as_torch_where_torch_is_correct():
    for name in TORCH_CLASSES:
        V = 1 if name in ("gpipe", "1f1b") else 2
        for R, m in [(2, 4), (4, 8), (3, 6), (4, 16)]:
            ours = [[str(a) for a in row] for row in pc.build_schedule(name, R, m, V).actions]
            assert ours == torch_order(name, R, m, V), (name, R, m)


@pytest.mark.parametrize("name, args, needle", [
    ("nope", (2, 4), "choose one of"),
    ("gpipe", (2, 4, 2), "stage(s) per rank"),
    ("1f1b", (2, 4, 3), "stage(s) per rank"),
    ("zbv", (2, 4, 3), "2 stage(s) per rank"),
    ("dualpipe", (3, 6), "even number of ranks"),
    ("dualpipe", (2, 3), "even number of microbatches"),
    ("dualpipe", (4, 6), "at least 2 * ranks = 8"),
    ("dualpipev", (4, 7), "at least 2 * ranks = 8"),
    ("gpipe", (0, 4), "num_ranks must be a positive integer"),
    ("gpipe", (2, 0), "num_microbatches must be a positive integer"),
    ("looped_bfs", (2, 4, 0), "stages_per_rank must be a positive integer"),
])
def test_unsupported_combinations_say_why(name, args, needle):
    with pytest.raises(ValueError) as info:
        pc.build_schedule(name, *args)
    assert needle in str(info.value)


def test_names():
    assert pc.SCHEDULES == ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbh2", "zbv",
                            "v_half", "v_min", "zb_auto", "dualpipe", "dualpipev", "forward_only")
    assert pc.build_schedule("ZB-H2", 2, 4).name == "zbh2" and pc.build_schedule("V-Half", 2, 4).name == "v_half"
    assert pc.build_schedule("ZBAuto", 2, 4).name == "zb_auto"
    assert pc.build_schedule("Interleaved1F1B", 2, 4).name == "interleaved_1f1b"
    assert pc.build_schedule("ScheduleZBVZeroBubble", 2, 4).name == "zbv"
    # one way to name a schedule: pipecore's name or torch's class name, no other nicknames
    assert pc.build_schedule("ScheduleInterleavedZeroBubble", 2, 4).name == "interleaved_zb"
    for nickname in ("auto", "bfs", "zb1p", "inference"):
        with pytest.raises(ValueError, match="unknown schedule"):
            pc.build_schedule(nickname, 2, 4)


def test_placements():
    s = pc.build_schedule("interleaved_1f1b", 4, 8, 3)
    assert [s.stage_to_rank(x) for x in range(12)] == [x % 4 for x in range(12)]
    v = pc.build_schedule("zbv", 4, 8)
    assert [v.stage_to_rank(x) for x in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.rank_stages(1) == [1, 6]
    d = pc.build_schedule("dualpipe", 4, 8)
    assert d.num_stages == 8 and d.rank_stages(0) == [0, 7] and d.rank_stages(3) == [3, 4]
    assert d.topology.model_stage == (0, 1, 2, 3, 0, 1, 2, 3)
    assert d.topology.microbatches[0] == range(0, 4) and d.topology.microbatches[4] == range(4, 8)
    with pytest.raises(pc.ScheduleError, match="out of range"):
        s.stage_to_rank(12)


def test_dualpipe_runs_both_directions_and_overlaps():
    d = pc.build_schedule("dualpipe", 4, 16)
    kinds = {a.kind for row in d.actions for a in row}
    assert pc.Kind.OVERLAP_F_B in kinds and pc.Kind.I in kinds and pc.Kind.W in kinds
    # rank 0 starts the down pipeline (stage 0), rank 3 the up pipeline (stage 4 = model stage 0)
    assert d.actions[0][0] == pc.Action.parse("0F0")
    assert d.actions[3][0] == pc.Action.parse("4F8")
    # each direction alone is a pipeline over R ranks: bubble well below GPipe's
    assert d.simulate({"F": 1, "B": 2}).bubble_ratio < pc.build_schedule("gpipe", 4, 16).simulate({"F": 1, "B": 2}).bubble_ratio


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(pc.SCHEDULES), R=st.integers(1, 10), m=st.integers(1, 40), V=st.integers(1, 4))
def test_property_random_configs(name, R, m, V):
    why = unsupported(name, R, m, V)
    if why is not None:  # a refused size is refused saying why, never built
        with pytest.raises(ValueError) as info:
            pc.build_schedule(name, R, m, V)
        assert str(info.value) == why
        return
    s = pc.build_schedule(name, R, m, V)
    s.validate()
    low = s.lower()
    low.validate()
    counts = {}
    for row in s.actions:
        for a in row:
            for leaf in a.leaves():
                counts[leaf.kind] = counts.get(leaf.kind, 0) + 1
    stages = s.num_stages
    per_stage = m if s.placement != "dualpipe" else m // 2
    assert counts[pc.Kind.F] == stages * per_stage
    if name != "forward_only":
        assert counts.get(pc.Kind.B, 0) + counts.get(pc.Kind.I, 0) == stages * per_stage
        assert counts.get(pc.Kind.I, 0) == counts.get(pc.Kind.W, 0)


MEGATRON_GRID = [(R, m, V, N) for R in (2, 3, 4, 8) for m in range(R, 3 * R + 2) for V in (2, 3)
                 for N in range(R, m + 1) if megatron_reference.accepts(R, m, N)]


@pytest.mark.parametrize("R, m, V, N", MEGATRON_GRID)
def test_interleaved_1f1b_is_megatrons_order(R, m, V, N):
    s = pc.build_schedule("interleaved_1f1b", R, m, V, group_size=N)
    assert [[str(a) for a in row] for row in s.actions] == [
        megatron_reference.rank_order(r, R, m, V, N) for r in range(R)]
    s.lower().validate()


def test_interleaved_takes_every_microbatch_count():
    # torch refuses m=9 on 4 ranks (not a multiple of its 2 rounds); Megatron groups 5 + 4
    refused_by_torch = [(R, m) for R in range(2, 9) for m in range(R, 4 * R) if m % max(1, m // R)]
    assert (4, 9) in refused_by_torch
    for R, m in refused_by_torch:
        for name in ("interleaved_1f1b", "interleaved_zb"):
            s = pc.build_schedule(name, R, m, 2)
            s.lower().validate()
    s = pc.build_schedule("interleaved_1f1b", 4, 9, 2)
    assert [str(a) for a in s.actions[0][:12]] == megatron_reference.rank_order(0, 4, 9, 2, 5)[:12]
    with pytest.raises(ValueError, match=r"group_size=4 does not fit 9 microbatches on 4 ranks.*e.g. \[5, 9\]"):
        pc.build_schedule("interleaved_1f1b", 4, 9, 2, group_size=4)
    with pytest.raises(ValueError, match="group_size applies to interleaved_1f1b, interleaved_zb, not to zbv"):
        pc.build_schedule("zbv", 4, 8, group_size=4)
