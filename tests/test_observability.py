"""NVTX ranges (checked with an injection library, no GPU needed), traces, pictures, the CLI."""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

import pipecore as pc
from dist_pool import RankPool, pool
from pipeline_cases import nvtx_step, profiled_steps, traced_step


def _nvtx_include():
    from torch.utils import cpp_extension

    for home in (os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME, "/usr/local/cuda",
                 *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)):
        if home and os.path.exists(os.path.join(home, "include", "nvtx3", "nvToolsExt.h")):
            return os.path.join(home, "include")
    return None


@pytest.fixture(scope="module")
def injection(tmp_path_factory):
    from pipecore import _C

    if not _C.build_info()["nvtx"]:
        pytest.skip("pipecore._C was built without NVTX headers (no CUDA toolkit found)")
    include = _nvtx_include()
    d = tmp_path_factory.mktemp("nvtx")
    lib = d / "librecorder.so"
    src = os.path.join(os.path.dirname(__file__), "nvtx_injection", "recorder.c")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", f"-I{include}", src, "-o", str(lib)], check=True)
    return lib, d


def _records(log_base):
    per_pid = {}
    for path in glob.glob(f"{log_base}.*"):
        with open(path) as f:
            per_pid[path] = f.read().splitlines()
    return per_pid


def _balanced(lines):
    depth = 0
    for line in lines:
        depth += 1 if line.startswith("push") else -1
        assert depth >= 0, "pop without push"
    return depth == 0


def test_nvtx_ranges_of_a_multi_rank_step(injection, monkeypatch):
    lib, d = injection
    log = d / "step"
    monkeypatch.setenv("NVTX_INJECTION64_PATH", str(lib))
    monkeypatch.setenv("PIPECORE_NVTX_LOG", str(log))
    ranks = RankPool(2, spawn=True)  # fresh processes that see these variables: they read them at their first range
    try:
        expected = ranks.run(nvtx_step, False)
    finally:
        ranks.close()
    records = _records(log)
    assert len(records) == 2, records.keys()
    pushed = [set(line[5:] for line in lines if line.startswith("push")) for lines in records.values()]
    for exp in expected:  # every action of each rank appears as a range on one of the processes
        assert any(set(exp) <= p for p in pushed), (sorted(exp), [sorted(p) for p in pushed])
    for lines in records.values():
        assert _balanced(lines)
        names = [line[5:] for line in lines if line.startswith("push")]
        assert "pipecore.step" in names and "pipecore.split" in names
        # executor ranges nest inside the Python step range
        first_pp = next(i for i, n in enumerate(names) if n.startswith("PP:"))
        assert names.index("pipecore.step") < first_pp


def test_nvtx_ranges_stay_balanced_when_an_action_raises(injection, monkeypatch):
    lib, d = injection
    log = d / "raise"
    monkeypatch.setenv("NVTX_INJECTION64_PATH", str(lib))
    monkeypatch.setenv("PIPECORE_NVTX_LOG", str(log))
    ranks = RankPool(1, spawn=True)
    try:
        ranks.run(nvtx_step, True)
    finally:
        ranks.close()
    (lines,) = _records(log).values()
    assert any(line.startswith("push PP:") for line in lines)
    assert _balanced(lines)


def test_trace_and_chrome_export(tmp_path):
    results = pool(2).run(traced_step, str(tmp_path))
    events = results[0]
    names = {(e["rank"], e["name"]) for e in events}
    assert (0, "PP:0F0") in names and (1, "PP:1B3") in names and (0, "PP:0SEND_F0") in names
    assert all(e["end_us"] >= e["start_us"] for e in events)
    with open(tmp_path / "trace.json") as f:
        trace = json.load(f)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1} and len(xs) == len(events)
    assert os.path.getsize(tmp_path / "timeline.png") > 1000
    assert os.path.getsize(tmp_path / "timeline.svg") > 1000


def test_profile_charges_each_moment_of_a_step_to_one_part():
    """Rank 0's forwards sleep 5 ms, rank 1's backwards 3 ms (4 microbatches): the sleeps show in
    the parts that ran them, rank 1 waits for rank 0's activations, and the parts add up."""
    results = pool(2).run(profiled_steps)
    for rank, (stepped, evaluated, actions, refused) in enumerate(results):
        assert "trace=True" in refused
        for p in (stepped, evaluated):
            inside = p["loop"] + p["forward"] + p["backward"] + p["post"] + p["wait"]
            assert inside == pytest.approx(p["run"], rel=1e-6)
            assert p["before_run"] + p["run"] + p["tracing"] + p["after_run"] == pytest.approx(p["step"], rel=1e-9)
            assert min(p.values()) >= 0 and p["model"] <= p["forward"]
        assert stepped["actions"] == actions
    (r0, r0_eval, _, _), (r1, r1_eval, _, _) = results
    assert r0["model"] >= 4 * 5e3 and r0_eval["model"] >= 4 * 5e3  # microseconds
    assert r1["backward"] >= 4 * 3e3 and r1_eval["backward"] == 0
    assert r1["wait"] >= 5e3 and r1_eval["wait"] >= 5e3  # at least the first microbatch's forward
    assert r1["model"] < 4 * 5e3 and r0["backward"] < 4 * 3e3


def test_picture_of_a_simulated_schedule(tmp_path):
    from pipecore.tools.picture import draw_schedule

    for ext in ("png", "svg"):
        path = str(tmp_path / f"zbv.{ext}")
        draw_schedule(pc.build_schedule("dualpipev", 4, 8), path, {"F": 1, "B": 2})
        assert os.path.getsize(path) > 1000


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pipecore", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_show_simulate_validate(tmp_path):
    out = _cli("show", "zbv", "--ranks", "2", "--microbatches", "4", "--out", str(tmp_path / "z.png"))
    assert out.returncode == 0, out.stderr
    assert "Rank 0" in out.stdout and "0F0" in out.stdout and os.path.exists(tmp_path / "z.png")
    out = _cli("simulate", "1f1b", "-r", "4", "-m", "8", "--F", "1", "--B", "1")
    assert out.returncode == 0 and "bubble ratio      0.2727" in out.stdout
    assert "peak activations  4 3 2 1" in out.stdout
    pairs = {mode: _cli("simulate", "dualpipev", "-r", "4", "-m", "8", "--overlap", mode).stdout
             for mode in ("concurrent", "sequential")}  # F 1, B 2: a pair costs 2 or 3
    assert "makespan          44" in pairs["concurrent"] and "makespan          54" in pairs["sequential"], pairs
    pc.build_schedule("interleaved_1f1b", 2, 4).lower().to_csv(tmp_path / "s.csv")
    out = _cli("validate", str(tmp_path / "s.csv"))
    assert out.returncode == 0 and "valid" in out.stdout and "lowered" in out.stdout
    (tmp_path / "bad.csv").write_text("0F0,0B1\n1F0,1B0\n")
    out = _cli("validate", str(tmp_path / "bad.csv"))
    assert out.returncode == 1 and "error: rank 0" in out.stderr
    out = _cli("show", "nope", "-r", "2", "-m", "2")
    assert out.returncode == 1 and "choose one of" in out.stderr


def test_every_writer_creates_the_folders_it_needs(tmp_path):
    """CSV, Chrome trace, pictures and the CLI's --out, each under folders that do not exist yet."""
    from pipecore.tools.profiling import draw_trace, to_chrome_trace

    s = pc.build_schedule("1f1b", 2, 4)
    s.to_csv(tmp_path / "a" / "b" / "s.csv")
    assert pc.Schedule.from_csv(tmp_path / "a" / "b" / "s.csv").actions == s.actions
    events = [{"rank": r, "name": f"PP:{a}", "start_us": 10.0 * i, "end_us": 10.0 * i + 8, "step": 0}
              for r in range(2) for i, a in enumerate(s.actions[r])]
    to_chrome_trace(events, str(tmp_path / "c" / "trace.json"))
    assert os.path.getsize(tmp_path / "c" / "trace.json") > 0
    draw_trace(events, str(tmp_path / "d" / "e" / "t.png"), schedule=s)
    assert os.path.getsize(tmp_path / "d" / "e" / "t.png") > 1000
    out = _cli("show", "zbv", "--ranks", "2", "--microbatches", "4", "--out", str(tmp_path / "f" / "z.png"))
    assert out.returncode == 0, out.stderr
    assert os.path.getsize(tmp_path / "f" / "z.png") > 1000
