"""Cost-aware and memory-controlled schedules: zb_auto, zbh2, v_half, v_min."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipecore as pc
from auto_cases import traced_zbv_step
from pipeline_cases import train_and_compare
from dist_pool import pool
from pipecore.tools.recommend import compare, costs_from_trace, load_trace, resample
from pipecore.schedule.builders import fixed_schedules
from pipecore.schedule.simulate import peak_activations

# every fixed schedule of pipecore a zb_auto schedule of 1 or 2 stages per rank is compared with:
# all that take that many stages per rank, but dualpipe (model stages mirrored: twice the weights)
FIXED = {V: [(name, V) for name in fixed_schedules(V)] for V in (1, 2)}
SAIL = {"F": 1, "I": 1.5, "W": 0.5}  # sail-sg's published ZB-V cases: costs per stage
assert {n for n, _ in FIXED[2]} >= {"zbv", "v_half", "v_min", "dualpipev", "looped_bfs", "interleaved_zb"}
assert {n for n, _ in FIXED[1]} >= {"gpipe", "1f1b", "interleaved_zb", "zbh2"}


def _fixed_that_fit(R, m, V, limit):
    for name, v in FIXED[V]:
        try:
            s = pc.build_schedule(name, R, m, v)
        except ValueError:
            continue
        if max(peak_activations(s.codes)) <= limit:
            yield name, s


def _check_auto(R, m, V, costs, limit):
    s = pc.build_schedule("zb_auto", R, m, V, costs=costs, memory_limit=limit)
    assert s.num_ranks == R and s.num_microbatches == m and s.num_stages == R * V
    s.validate()
    s.lower().validate()  # lowers deadlock-free
    result = s.simulate(costs)
    assert max(result.peak_activations) <= limit
    for name, fixed in _fixed_that_fit(R, m, V, limit):
        assert result.makespan <= fixed.simulate(costs).makespan + 1e-9, name
    return result


@pytest.mark.parametrize("R, m, sail_makespan", [(8, 32, 205.5), (4, 8, 53.5)])
def test_zb_auto_v_no_worse_than_sail_sg_zbv_heuristic(R, m, sail_makespan):
    # sail-sg's cost-tuned ZB-V (zbv.py) at 1F1B's memory: bubble 0.0657 and 0.1028, i.e. these
    # makespans (each rank works 2 x 3 x m); pipecore's fixed zbv: 206 (0.0680) and 54 (0.1111)
    result = _check_auto(R, m, 2, SAIL, 2 * R)
    assert result.makespan <= sail_makespan
    assert round(result.bubble_ratio, 4) <= round(1 - 6 * m / sail_makespan, 4)
    assert pc.build_schedule("zbv", R, m).simulate(SAIL).makespan > sail_makespan


@settings(max_examples=100, deadline=None)
@given(R=st.integers(1, 8), m=st.integers(1, 24), V=st.sampled_from([1, 2]),
       f=st.sampled_from([0.5, 1, 1.5, 2, 3]), i=st.sampled_from([0.5, 1, 1.5, 2]),
       w=st.sampled_from([0, 0.1, 0.5, 1, 2]), comm=st.sampled_from([0, 0.25, 1, 5]), data=st.data())
def test_property_zb_auto(R, m, V, f, i, w, comm, data):
    limit = data.draw(st.integers(V, 4 * R * V), label="memory_limit")
    _check_auto(R, m, V, {"F": f, "I": i, "W": w, "comm": comm}, limit)


@pytest.mark.parametrize("R, m, V, costs, limit", [
    (8, 16, 2, {"F": 1, "I": 2, "W": 0.1, "comm": 5}, 32),  # looped BFS wins: slow messages, room for all
    (32, 256, 2, {"F": 3, "I": 1, "W": 0.1}, 64),  # past the search budget: the fixed ones still count
    (32, 256, 1, {"F": 1, "I": 1.5, "W": 0.5, "comm": 0.1}, 32),
])
def test_zb_auto_no_worse_than_fixed_at_the_edges(R, m, V, costs, limit):
    _check_auto(R, m, V, costs, limit)


def test_zb_auto_per_stage_costs_and_defaults():
    # a slow last stage (the loss): the generator sees it, the default costs do not
    costs = {"F": [1, 1, 1, 2], "I": [1, 1, 1, 2], "W": 1}
    tuned = _check_auto(4, 12, 1, costs, 4)
    default = pc.build_schedule("zb_auto", 4, 12).simulate(costs)
    assert tuned.makespan <= default.makespan
    s = pc.build_schedule("zb_auto", 4, 12)
    assert s.num_stages == 4 and max(s.simulate().peak_activations) <= 4  # 1F1B's memory by default
    assert pc.build_schedule("zb_auto", 4, 12, 2).placement == "v"


def test_zb_auto_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="an integer of at least 2 for 2 stage.*1F1B's is 8"):
        pc.build_schedule("zb_auto", 4, 8, 2, memory_limit=1)
    with pytest.raises(ValueError, match="unknown cost keys"):
        pc.build_schedule("zb_auto", 4, 8, costs={"X": 1})
    with pytest.raises(ValueError, match="one number per stage"):
        pc.build_schedule("zb_auto", 4, 8, costs={"F": [1, 2]})
    with pytest.raises(ValueError, match="memory_limit applies to zb_auto, not to zbv"):
        pc.build_schedule("zbv", 4, 8, memory_limit=8)
    with pytest.raises(ValueError, match="runs 1 or 2 stage"):
        pc.build_schedule("zb_auto", 4, 8, 3)
    for bad in ({"comm": float("nan")}, {"F": float("inf")}, {"W": -1}):
        with pytest.raises(ValueError, match="must be finite and not negative"):
            pc.build_schedule("zb_auto", 4, 8, costs=bad)
    with pytest.raises(ValueError, match=r"'I' \(3\) exceeds 'B' \(2\), so W = B - I would be negative"):
        pc.build_schedule("zb_auto", 4, 8, costs={"B": 2, "I": 3})


@pytest.mark.parametrize("R", [2, 3, 4, 5, 6, 8, 12, 16])
@pytest.mark.parametrize("name, paper", [("v_half", lambda p: (p + 2) // 2), ("v_min", lambda p: (p + 4) // 3),
                                         ("zbh2", lambda p: 2 * p - 1)])
def test_memory_the_papers_state(name, paper, R):
    # V-Half and V-Min (controllable memory, Table 1: (p+2)//2 and (p+4)//3 microbatches of a
    # rank's layers, half of a stage each on a V) and ZB-H2 (zero bubble: 2p-1)
    for m in (R, 2 * R + 1, 4 * R):
        s = pc.build_schedule(name, R, m)
        s.validate()
        s.lower().validate()
        peak = max(s.simulate().peak_activations)
        units = peak / 2 if s.placement == "v" else peak
        assert units <= paper(R)
        if m >= 2 * R:
            assert units == paper(R)


# makespans of the authors' generator (sail-sg zbv_greedy.py, with its reordering), costs per stage
AUTHORS = {(8, 32, "F=I=W"): (209, 219), (16, 64, "F=I=W"): (425, 443), (4, 8, "F=I=W"): (53, 59),
           (8, 32, "I=1.5F"): (474, 636), (8, 32, "I=1.5F+comm"): (511.6, 708.8)}
COST_SETS = {"F=I=W": {"F": 1, "I": 1, "W": 1}, "I=1.5F": {"F": 2, "I": 3, "W": 1},
             "I=1.5F+comm": {"F": 2, "I": 3, "W": 1, "comm": 0.4}}


@pytest.mark.parametrize("R, m, costs", sorted(AUTHORS))
def test_v_half_and_v_min_are_the_authors(R, m, costs):
    half, vmin = AUTHORS[(R, m, costs)]
    assert pc.build_schedule("v_half", R, m).simulate(COST_SETS[costs]).makespan == pytest.approx(half)
    assert pc.build_schedule("v_min", R, m).simulate(COST_SETS[costs]).makespan == pytest.approx(vmin)


@pytest.mark.parametrize("R, m", [(8, 32), (16, 64)])
def test_controllable_memory_bubbles(R, m):
    # at F = I = W: V-Half's and V-Min's bubbles below the paper's ~R/2m and ~2R/3m, each with
    # its memory; zbh2 no slower than ZB-H1
    half = pc.build_schedule("v_half", R, m).simulate()
    vmin = pc.build_schedule("v_min", R, m).simulate()
    zbv = pc.build_schedule("zbv", R, m).simulate()
    assert half.bubble_ratio <= R / (2 * m) and vmin.bubble_ratio <= 2 * R / (3 * m)
    assert max(vmin.peak_activations) < max(half.peak_activations) < max(zbv.peak_activations)
    zbh2 = pc.build_schedule("zbh2", R, m).simulate()
    assert zbh2.makespan <= pc.build_schedule("interleaved_zb", R, m, 1).simulate().makespan


@pytest.mark.parametrize("name, V", [("zb_auto", 1), ("zb_auto", 2), ("zbh2", 1), ("v_half", 2), ("v_min", 2),
                                     ("interleaved_1f1b", 2), ("zbv", 2)])
def test_builds_at_32_ranks_256_microbatches(name, V):
    # the times are bench/schedules.py's business (zb_auto's search is bounded by actions placed,
    # SEARCH_BUDGET, not by seconds)
    s = pc.build_schedule(name, 32, 256, V)
    assert s.num_stages == 32 * V
    s.validate()


def test_costs_from_a_trace():
    events = [{"name": f"PP:{s}{k}{mb}", "start_us": 0.0, "end_us": float(d)}
              for s, (f, i, w) in enumerate([(100, 150, 50), (200, 300, 100)])
              for mb in range(3) for k, d in (("F", f + mb), ("I", i), ("W", w))]
    events += [{"name": "PP:0SEND_F0", "start_us": 0.0, "end_us": 9e9},
               {"name": "PP:(0F1;1I0)OVERLAP_F_B", "start_us": 0.0, "end_us": 9e9}]
    assert costs_from_trace(events) == {"F": [0.101, 0.201], "I": [0.15, 0.3], "W": [0.05, 0.1]}
    chrome = [{"ph": "X", "name": e["name"], "ts": 5.0, "dur": e["end_us"]} for e in events]
    assert costs_from_trace(chrome) == costs_from_trace(events)
    # a merged backward (B) alone is kept; beside split ones it is split in their I : W ratio
    assert costs_from_trace([{"name": "0F0", "ts": 0, "dur": 1000}, {"name": "0B0", "ts": 0, "dur": 2000}]) == {
        "F": [1.0], "B": [2.0]}
    merged = [e for e in events if not e["name"].startswith(("PP:0I", "PP:0W"))]
    merged += [{"name": f"PP:0B{mb}", "start_us": 0.0, "end_us": 400.0} for mb in range(3)]
    split = costs_from_trace(merged)
    assert split["I"][0] == pytest.approx(0.3) and split["W"][0] == pytest.approx(0.1) and "B" not in split
    with pytest.raises(ValueError, match="no F/I/W/B action with a duration"):
        costs_from_trace([{"name": "PP:0SEND_F0", "ts": 0, "dur": 1}])
    with pytest.raises(ValueError, match=r"no F for stages \[1\]: trace a whole training step"):
        costs_from_trace([{"name": n, "ts": 0, "dur": 1} for n in ("0F0", "2F0", "0B0", "1B0", "2B0")])


def test_resample_keeps_the_model_cost():
    assert resample([1, 2], 4) == [0.5, 0.5, 1.0, 1.0]
    assert resample([1, 1, 2, 2], 2) == [2.0, 4.0]
    assert sum(resample([1.0, 2.0, 4.0], 5)) == pytest.approx(7.0)


@pytest.mark.parametrize("memory", [0.5, 0.75, 1.0, 2.0])
def test_compare_recommends_the_fastest_that_fits(memory):
    costs = {"F": 1, "I": 1.5, "W": 0.5, "comm": 0.1}
    rows = compare(8, 32, costs, memory)
    fits = [c for c in rows if c.fits]
    assert fits and rows[: len(fits)] == fits  # within memory first
    assert all(c.memory <= memory + 1e-9 for c in fits) and all(c.memory > memory for c in rows[len(fits):])
    # each row is the schedule simulated under its share of the costs
    from pipecore.tools.recommend import per_rank_costs, stage_costs

    for c in rows:
        if c.name != "zb_auto":
            s = pc.build_schedule(c.name, 8, 32, c.stages_per_rank)
            again = s.simulate(stage_costs(s.topology.model_stage, per_rank_costs(costs, 8)))
            assert c.makespan == pytest.approx(again.makespan), c.name
    names = {(c.name, c.stages_per_rank) for c in rows}
    assert ("zb_auto", 1) in names and ("zb_auto", 2) in names and ("v_min", 2) in names
    by_name = {(c.name, c.stages_per_rank): c for c in rows}
    assert by_name[("1f1b", 1)].memory == 1.0 and by_name[("zbv", 2)].memory == 1.0
    assert by_name[("v_half", 2)].memory == (8 + 2) // 2 / 8 and by_name[("v_min", 2)].memory == (8 + 4) // 3 / 8
    # Megatron's interleaved 1F1B holds 1 + (p-1)/(pv) of 1F1B's; DualPipe p+1 microbatches
    assert by_name[("interleaved_1f1b", 2)].memory == 1 + 7 / 16 and by_name[("dualpipe", 2)].memory == 9 / 8
    # zb_auto of each stage count is no slower than a fixed schedule of that count that fits
    for V in (1, 2):
        auto = by_name[("zb_auto", V)]
        assert auto.fits
        assert all(auto.makespan <= c.makespan + 1e-9 for c in fits if c.stages_per_rank == V)


def test_cli_recommends_from_a_real_trace(tmp_path):
    path = str(tmp_path / "trace.json")
    pool(2).run(traced_zbv_step, path)
    out = subprocess.run([sys.executable, "-m", "pipecore", "simulate", "-r", "4", "-m", "16", "--profile", path,
                          "--memory", "1.0"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "measured in" in text and "4 stages" in text
    for kind in ("F", "I", "W"):
        assert any(line.split()[:1] == [kind] and len(line.split()) == 5 for line in text.splitlines()), text
    assert "recommended: " in text and "zb_auto" in text and "v_min" in text
    measured = costs_from_trace(load_trace(path))
    best = compare(4, 16, {"comm": 0.0, **measured}, 1.0)[0]
    assert f"recommended: {best.name} with {best.stages_per_rank} stage(s)" in text
    out = subprocess.run([sys.executable, "-m", "pipecore", "simulate", "-r", "4", "-m", "16"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "needs a schedule name, or --compare" in out.stderr


@pytest.mark.parametrize("name, options, world, m, V", [
    ("interleaved_1f1b", {}, 2, 5, 2),  # torch refuses 5 on 2 ranks; Megatron's groups 3 + 2
    ("interleaved_zb", {}, 2, 7, 2),
    ("interleaved_1f1b", {"group_size": 3}, 2, 6, 3),
    ("zb_auto", {"costs": {"F": 1, "I": 2, "W": 0.5, "comm": 0.5}, "memory_limit": 3}, 2, 6, 2),
    ("zb_auto", {"costs": {"F": [1, 3], "I": [1, 3], "W": [2, 1]}, "memory_limit": 3}, 2, 6, 1),
])
def test_new_orders_train_like_one_process(name, options, world, m, V):
    pool(world).run(train_and_compare, (name, options), m, V, "multi", 3 * m + 1)


def test_policies_that_reserve_room_never_deadlock():
    # zb_auto's last resort: on a V the first leg's forward leaves room for the second's; one
    # stage per rank needs no room kept. Every memory limit from the least (one per stage)
    from pipecore.schedule.builders.auto import POLICIES, generate
    from pipecore.schedule.simulate import cost_table
    from pipecore.schedule.topology import Topology

    reserving = [p for p in POLICIES if p.reserve]
    for R in range(1, 6):
        for m in range(1, 9):
            for V in (1, 2):
                topo = Topology.loop(R, R, m) if V == 1 else Topology.v(R, 2 * R, m)
                table = cost_table({"F": 1, "I": 2, "W": 0.5, "comm": 0.5}, topo.num_stages)
                for limit in range(V, 2 * R * V + 1):
                    for policy in reserving[(R + m + limit) % 9::9]:
                        rows, makespan, _ = generate(topo, table, limit, policy)
                        s = pc.Schedule.from_codes(rows, topo)
                        assert s.simulate(table).makespan == makespan
                        assert max(s.simulate().peak_activations) <= limit


@pytest.mark.parametrize("p", [8, 16])
def test_the_zero_bubble_papers_closed_forms(p):
    # Zero Bubble Pipeline Parallelism, Table 2: bubble per rank of 1F1B (p-1)(F+B+W), ZB-H1
    # (p-1)(F+B-W), ZB-H2 (p-1)(F+B-2W), B being our I; one step's makespan = work + bubble
    # wherever that is above the stagger every step has, (p-1)F
    m = 4 * p
    for f, i, w in ((1, 1, 1), (1, 1.5, 0.5), (1, 2, 1)):
        costs = {"F": f, "I": i, "W": w}
        work = m * (f + i + w)
        for name, bubble in (("1f1b", (p - 1) * (f + i + w)), ("interleaved_zb", (p - 1) * (f + i - w)),
                             ("zbh2", (p - 1) * (f + i - 2 * w))):
            makespan = pc.build_schedule(name, p, m, 1).simulate(costs).makespan
            assert makespan == pytest.approx(work + max(bubble, (p - 1) * f)), (name, costs)
    # the papers' zero for ZB-H2 and ZB-V at F = I = W: no rank idles within its own span
    for name in ("zbh2", "zbv"):
        r = pc.build_schedule(name, p, m).simulate({"F": 1, "I": 1, "W": 1})
        for busy, row in zip(r.busy, r.timeline):
            assert row[-1][2] - row[0][1] == pytest.approx(busy), name


def test_v_rounds_times_are_the_simulators():
    # the V built in rounds places every action at the time the simulator gives it, within memory
    from pipecore.schedule.builders.v_rounds import Stuck, build_rounds
    from pipecore.schedule.simulate import cost_table
    from pipecore.schedule.topology import Topology

    built = 0
    for R in (1, 2, 3, 5, 8):
        for m in (1, R, 2 * R + 1, 4 * R):
            topo = Topology.v(R, 2 * R, m)
            for costs in ({"F": 1, "I": 1, "W": 1}, {"F": 2, "I": 3, "W": 1, "comm": 0.5}, {"F": 3, "I": 1, "W": 2}):
                table = cost_table(costs, 2 * R)
                for limit in (2, R + 1, 2 * R):
                    for flags in ((True, True, True), (False, True, False), (True, False, True)):
                        try:
                            rows, makespan, _ = build_rounds(topo, table, limit, *flags)
                        except Stuck:
                            continue
                        built += 1
                        s = pc.Schedule.from_codes(rows, topo)
                        s.validate()
                        result = s.simulate(table)
                        assert result.makespan == pytest.approx(makespan)
                        assert max(result.peak_activations) <= limit
    assert built > 300


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbh2", "zbv",
                                  "v_half", "v_min", "dualpipev", "dualpipe"])
def test_fast_makespan_is_the_simulators(name):
    from pipecore.schedule.builders.auto import makespan
    from pipecore.schedule.simulate import cost_table

    for R, m in ((1, 4), (2, 6), (4, 8), (8, 20)):
        try:
            s = pc.build_schedule(name, R, m)
        except ValueError:
            continue
        for costs in ({"F": 1, "I": 1, "W": 1}, {"F": [1 + s_ % 3 for s_ in range(s.num_stages)], "I": 2, "W": 0.5,
                                                  "comm": 0.3}):
            table = cost_table(costs, s.num_stages)
            assert makespan(s.codes, s.topology, table) == pytest.approx(s.simulate(costs).makespan)


def test_costs_of_a_dualpipe_trace_fold_its_mirrored_stages():
    # dualpipe's stages R..2R-1 compute model stages 0..R-1 again: the trace's 4 stages are 2
    from pipecore.tools.recommend import traced_model_stages

    model_f = [1.0, 3.0]
    events = [{"name": f"PP:{s}{kind}{mb}", "ts": 0.0, "dur": 1000 * model_f[s % 2] * scale}
              for s in range(4) for mb in range(2) for kind, scale in (("F", 1), ("I", 1), ("W", 0.5))]
    mirrored = traced_model_stages("dualpipe", 2)
    assert mirrored == [0, 1, 0, 1]
    costs = costs_from_trace(events, model_stage=mirrored)
    assert costs == {"F": [1.0, 3.0], "I": [1.0, 3.0], "W": [0.5, 1.5]}
    assert costs_from_trace(events)["F"] == [1.0, 3.0, 1.0, 3.0]  # read as a chain: 4 stages
    with pytest.raises(ValueError, match="forwards only: trace a training step"):
        costs_from_trace([e for e in events if "F" in e["name"]])
    with pytest.raises(ValueError, match="no F/I/W/B action with a duration"):
        costs_from_trace([{"name": "0F0", "ts": 0}])
    with pytest.raises(ValueError, match="objects with a name and times"):
        costs_from_trace(["0F0"])


def test_compare_says_what_is_wrong():
    unlimited = {(c.name, c.stages_per_rank): c for c in compare(4, 8, {}, float("inf"))}
    assert all(c.fits for c in unlimited.values()) and unlimited[("gpipe", 1)].memory == 2.0
    for args, needle in (((0, 8), "num_ranks must be a positive integer"),
                         ((4, 8, {"F": float("nan")}), "must be finite and not negative"),
                         ((4, 8, {"B": 2, "I": 3}), "W = B - I would be negative"),
                         ((4, 8, {"comm": [1, 2]}), "comm is the cost of one message"),
                         ((4, 8, {}, float("nan")), "fraction of 1F1B's activation memory"),
                         ((4, 8, {}, 0), "fraction of 1F1B's activation memory")):
        with pytest.raises(ValueError, match=needle):
            compare(*args)


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "pipecore", *args], capture_output=True, text=True)


def test_cli_simulate_builds_zb_auto_for_the_costs_given():
    costs = {"F": 1, "I": 2, "W": 0.1, "comm": 5}
    out = _run_cli("simulate", "zb_auto", "-r", "8", "-m", "32", "-v", "2", "--F", "1", "--I", "2", "--W", "0.1",
                   "--comm", "5")
    assert out.returncode == 0, out.stderr
    tuned = pc.build_schedule("zb_auto", 8, 32, 2, costs=costs).simulate(costs).makespan
    assert f"makespan          {tuned:.6g}" in out.stdout
    assert tuned < pc.build_schedule("zb_auto", 8, 32, 2).simulate(costs).makespan
    for args, needle in ((("--compare", "-r", "4", "-m", "8", "-v", "2"), "--stages-per-rank: not with --compare"),
                         (("1f1b", "-r", "4", "-m", "8", "--memory", "0.5"), "go with --compare or --profile"),
                         (("--compare", "-r", "4", "-m", "8", "--comm", "nan"), "must be finite"),
                         (("--compare", "-r", "4", "-m", "8", "--traced-schedule", "dualpipe"), "describes the trace")):
        out = _run_cli("simulate", *args)
        assert out.returncode == 1 and needle in out.stderr, (args, out.stderr)
