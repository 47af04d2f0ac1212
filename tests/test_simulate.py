"""The simulator agrees with the analytic bubbles."""

import pytest

import pipecore as pc


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 8, 16, 32])
def test_1f1b_bubble_matches_formula(p, m):
    r = pc.build_schedule("1f1b", p, m).simulate({"F": 1, "B": 1})
    assert r.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    assert r.makespan == pytest.approx(2 * (m + p - 1))
    assert r.peak_activations == [min(p - rank, m) for rank in range(p)]


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_gpipe_makespan_and_memory(p, m):
    r = pc.build_schedule("gpipe", p, m).simulate({"F": 1, "B": 2})
    assert r.makespan == pytest.approx(3 * (m + p - 1))
    assert r.peak_activations == [m] * p


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_zb_h1_bubble_is_about_a_third_of_1f1b(p, m):
    costs = {"F": 1, "I": 1, "W": 1}
    zb = pc.build_schedule("interleaved_zb", p, m, 1).simulate(costs)
    f1b = pc.build_schedule("1f1b", p, m).simulate(costs)
    idle_zb = zb.makespan - 3 * m
    idle_1f1b = f1b.makespan - 3 * m
    assert idle_1f1b == pytest.approx(3 * (p - 1))
    assert idle_zb == pytest.approx((p - 1))  # ZB-H1: (p-1)(F+I-W) against (p-1)(F+I+W)
    assert zb.peak_activations[0] <= p  # same memory as 1F1B on the first rank


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zbv_zero_bubble_in_steady_state(p):
    costs = {"F": 1, "I": 1, "W": 1}
    spans = [pc.build_schedule("zbv", p, m).simulate(costs).makespan for m in (4 * p, 8 * p, 16 * p)]
    # every extra microbatch adds exactly its own work (2 stages x 3 units) per rank: no new bubble
    assert spans[1] - spans[0] == pytest.approx(6 * 4 * p)
    assert spans[2] - spans[1] == pytest.approx(6 * 8 * p)


def test_comm_latency_and_per_stage_costs():
    s = pc.build_schedule("gpipe", 2, 1)
    assert s.simulate({"F": 1, "B": 2, "comm": 0.5}).makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    assert s.simulate({"F": [1, 3], "B": [2, 6]}).makespan == pytest.approx(12)
    # a lowered schedule simulates the same (comm actions cost no rank time)
    assert s.lower().simulate({"F": 1, "B": 2, "comm": 0.5}).makespan == pytest.approx(7)


def test_cost_errors():
    s = pc.build_schedule("gpipe", 2, 2)
    with pytest.raises(ValueError, match="unknown cost keys"):
        s.simulate({"X": 1})
    with pytest.raises(ValueError, match="one number per stage"):
        s.simulate({"F": [1, 2, 3]})
    with pytest.raises(ValueError, match="must be finite and not negative"):
        s.simulate({"F": -1})
    with pytest.raises(ValueError, match="must be finite and not negative"):
        s.simulate({"comm": float("nan")})


@pytest.mark.parametrize("name, V", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2),
                                     ("zbv", 2), ("dualpipev", 2)])
def test_costs_per_microbatch(name, V):
    """F, B, I and W as functions of (stage, microbatch): microbatches of their own lengths."""
    s = pc.build_schedule(name, 2, 6, V)
    stages = s.num_stages
    per_stage = {"F": [1 + st for st in range(stages)], "I": [1.5] * stages, "W": [0.5 + st for st in range(stages)]}
    # a function that ignores the microbatch simulates as the numbers do, lowered or not, its
    # derived costs (B = I + W) included
    as_functions = {k: (lambda st, k_, v=v: v[st]) for k, v in per_stage.items()}
    for sched in (s, s.lower()):
        want = sched.simulate(per_stage)
        got = sched.simulate(as_functions)
        assert got.makespan == pytest.approx(want.makespan) and got.busy == pytest.approx(want.busy)
    # B = 2 F per microbatch by default; a longer microbatch costs more, busy time adds up per rank
    lengths = [1, 4, 2, 3, 1, 2]
    r = s.simulate({"F": lambda st, k: lengths[k]})
    assert sum(r.busy) == pytest.approx(3 * stages * sum(lengths))
    assert s.lower().simulate({"F": lambda st, k: lengths[k]}).makespan == pytest.approx(r.makespan)
    assert s.simulate({"F": 4}).makespan > r.makespan > s.simulate({"F": 1}).makespan


def test_one_rank_per_microbatch_costs_add_up():
    s = pc.build_schedule("1f1b", 1, 4)
    lengths = [3, 1, 4, 1]
    assert s.simulate({"F": lambda st, k: lengths[k], "B": lambda st, k: 2 * lengths[k] + 1}).makespan == \
        pytest.approx(sum(3 * n + 1 for n in lengths))


def test_per_microbatch_cost_errors():
    s = pc.build_schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match="cost 'F' of stage 0, microbatch 0 must be a finite number"):
        s.simulate({"F": lambda st, k: -1})
    with pytest.raises(ValueError, match=r"cost 'W \(B - I\)' of stage \d, microbatch \d must be a finite number"):
        pc.build_schedule("interleaved_zb", 2, 4, 2).simulate({"B": 1, "I": lambda st, k: 2})  # W is priced there
    with pytest.raises(ValueError, match="must be a finite number"):
        s.simulate({"F": lambda st, k: float("nan")})
    # only F, B, I and W, and only in the simulator (the auto builder searches per stage)
    with pytest.raises(ValueError, match="cost 'comm' must be a number or one number per stage"):
        s.simulate({"comm": lambda st, k: 1})
    with pytest.raises(ValueError, match=r"cost 'F' must be a number or one number per stage \(2\), got <function"):
        pc.build_schedule("zb_auto", 2, 4, costs={"F": lambda st, k: 1})


def test_result_fields():
    r = pc.build_schedule("interleaved_1f1b", 2, 4).simulate({"F": 1, "B": 2})
    assert len(r.busy) == 2 and len(r.timeline) == 2 and len(r.idle) == 2
    assert all(end > start for row in r.timeline for _, start, end in row)
    assert r.bubble_ratio == pytest.approx(1 - sum(r.busy) / (2 * r.makespan))


def test_overlap_cost_function():
    s = pc.build_schedule("dualpipev", 2, 8)
    serial = s.simulate({"F": 1, "B": 2}).makespan  # the default, lockstep, prices a pair as both halves
    hidden = s.simulate({"F": 1, "B": 2, "OVERLAP_F_B": max}).makespan
    assert hidden < serial
    # a cost function prices pairs whatever the mode; without one, the mode does
    assert s.simulate({"F": 1, "B": 2, "OVERLAP_F_B": lambda f, b: f + b}, overlap="concurrent").makespan == serial
    assert s.simulate({"F": 1, "B": 2}, overlap="concurrent").makespan == hidden


def test_simulating_a_deadlocked_schedule_raises_the_validator_error():
    s = pc.Schedule([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]])
    with pytest.raises(pc.ScheduleError, match="deadlock"):
        s.simulate()


# Cost sets for the lowered-program check: equal costs, sail-sg's I=1.5/W=0.5 with latency, a costly
# W, and per-stage costs (a heavier last stage, as an LM head makes it).
_LOWERED_COSTS = [
    {"F": 1, "I": 1, "W": 1},
    {"F": 1, "I": 1.5, "W": 0.5, "comm": 0.1},
    {"F": 2, "I": 1, "W": 3, "comm": 0.5},
    "last_stage_heavy",
]


def _costs(spec, num_stages):
    if spec != "last_stage_heavy":
        return spec
    heavy = [1.0] * (num_stages - 1) + [3.0]
    return {"F": heavy, "I": heavy, "W": [0.5] * (num_stages - 1) + [2.0], "comm": 0.2}


@pytest.mark.parametrize("name, R", [(name, R) for name in ["zbv", "dualpipe", "dualpipev", "interleaved_zb"]
                                     for R in range(2, 9) if name != "dualpipe" or R % 2 == 0])  # DualPipe: even R
def test_lowered_program_keeps_the_schedules_makespan(name, R):
    # The program a Pipeline runs (Schedule.lower()) must not lose the bubble the schedule has: an
    # input gradient another rank waits for leaves after I, not after a merged I+W.
    checked = 0
    for m in range(1, 4 * R + 1):
        try:
            s = pc.build_schedule(name, R, m)
        except ValueError:
            continue
        low = s.lower()
        for spec in _LOWERED_COSTS:
            costs = _costs(spec, s.num_stages)
            want, got = s.simulate(costs), low.simulate(costs)
            assert got.makespan == pytest.approx(want.makespan), (name, R, m, spec, want.makespan, got.makespan)
            assert got.bubble_ratio == pytest.approx(want.bubble_ratio), (name, R, m, spec)
        checked += 1
    assert checked >= R, (name, R, checked)  # the grid is not empty
