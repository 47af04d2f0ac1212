"""Every benchmark runs end to end on tiny sizes and prints its table (the numbers are the
benchmarks' business; this keeps them from rotting): one schedule and the fewest ranks and processes each
allows, since starting processes is most of what these runs cost."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

CASES = {
    "gpt": ["--schedules", "1f1b", "--ranks", "2", "--width", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
            "--microbatches", "4", "--rows", "8", "--steps", "1", "--warmup", "0", "--blocks", "1",
            "--memory-blocks", "1"],
    "build": ["--schedules", "1f1b", "zbv", "--ranks", "4", "--microbatches", "8", "--repeats", "1"],
    "schedules": ["--ranks", "4", "--microbatches", "8"],
    "overhead": ["--stages", "2", "--microbatches", "4", "--repeats", "2", "--runs", "1",
                 "--flight-iterations", "1000"],
    "vs_torch": ["--schedules", "zbv", "--microbatches", "4", "--blocks", "1", "--steps", "1"],
    "memory": ["--schedules", "1f1b", "--microbatches", "2", "--rows", "64", "--width", "64", "--steps", "1"],
    "zero_bubble": ["--schedules", "zbv", "--ranks", "2", "--microbatches", "4", "--ms", "1", "1", "1",
                    "--blocks", "1", "--steps", "1"],
    "data_parallel": ["--quick", "--timeline", "{out}/timeline.png"],
    "compat": ["--schedules", "ZBVZeroBubble", "--microbatches", "4", "--dim", "16", "--seq", "8",
               "--rows", "8", "--blocks", "1", "--steps", "1"],
    "overlap": ["--schedules", "1f1b", "--microbatches", "4", "--forward-ms", "1", "--backward-ms", "1",
                "--mib", "0.1", "--steps", "1", "--pair-schedules", "dualpipev", "--comm-ms", "1"],
}
# pictures a bench writes beyond its --plot ({out}: a folder that does not exist yet)
PICTURES = {"data_parallel": "{out}/timeline.png"}
# what a bench prints beyond its first table: overlap's OVERLAP_F_B table, with its lockstep rows (the bench
# itself fails unless every pair of concurrent and lockstep ran overlapped); overhead's flight record table
PRINTS = {"overlap": "lockstep", "overhead": "its writes alone"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_prints_its_table(name, tmp_path):
    """Run from an empty working directory, writing under folders that do not exist yet: a bench writes
    nothing into the source tree and creates the folders it writes to."""
    out_dir = str(tmp_path / "new" / "folder")
    plot = os.path.join(out_dir, f"{name}.png")
    args = [a.format(out=out_dir) for a in CASES[name]]
    work = tmp_path / "cwd"
    work.mkdir()
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", f"{name}.py"), *args, "--plot", plot],
                         capture_output=True, text=True, timeout=300, cwd=work)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) >= 4 and set(lines[2].replace(" ", "")) == {"-"}, out.stdout  # title, header, rule, rows
    assert PRINTS.get(name, "") in out.stdout, out.stdout
    assert os.path.getsize(plot) > 0
    if name in PICTURES:
        assert os.path.getsize(PICTURES[name].format(out=out_dir)) > 0
    assert not os.listdir(work), os.listdir(work)


# benchmarks that print a table only (no --plot)
TABLES = {
    "variable_shapes": ["--schedules", "1f1b", "--microbatches", "4", "--max-len", "16", "--width", "16",
                        "--blocks", "1", "--steps", "1"],
    "shape_change": ["--schedules", "1f1b", "--microbatches", "4", "--rows", "8", "--other-rows", "4",
                     "--blocks", "1", "--steps", "1"],
    "step_profile": ["--configs", "wire-1f1b", "--steps", "2"],
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_benchmark_prints_its_table_only(name, tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", f"{name}.py"), *TABLES[name]],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) >= 4 and set(lines[2].replace(" ", "")) == {"-"}, out.stdout  # title, header, rule, rows
    assert not os.listdir(tmp_path), os.listdir(tmp_path)
