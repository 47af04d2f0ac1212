"""`make gpu-check` (.ci/gpu_check.py) on a machine without a GPU: every check is listed, each
skipped with its reason, the table is also written to a file, and the script succeeds. (Its --cpu dry run, the multi-rank cases on gloo,
takes minutes: run by hand, see docs/cuda.md.)"""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make gpu-check runs the checks")
def test_gpu_check_lists_every_check_with_why_it_is_skipped(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, ".ci", "gpu_check.py")], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "GPU_CHECK_OUT": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    with open(tmp_path / "table.txt") as f:  # the table, also in a file
        assert f.read().splitlines()[1:] == [line for line in out.stdout.splitlines() if line][:-1], out.stdout
    rows = [line for line in out.stdout.splitlines() if "  skipped  " in line]
    assert any(r.startswith("tests/test_cuda.py") and "no CUDA GPU" in r for r in rows), out.stdout
    for name in ("train_gpt 1f1b", "train_gpt dualpipev, no caching allocator", "stopped rank (kill -STOP)",
                 "growth past 8 MiB (64 MiB)", "complex64 and int16 boundary", "variable_shapes on one rank only"):
        assert any(r.startswith(name) and "needs 2 GPUs (this machine has 0)" in r for r in rows), (name, out.stdout)
    for name in ("probe self_wait", "probe group_end_first", "probe abort_first", "probe channel"):
        assert any(r.startswith(name) and "needs a CUDA GPU (NCCL)" in r for r in rows), (name, out.stdout)
    for name in ("train_gpt interleaved_zb, 3 ranks, lazy group", "train_gpt dualpipev, 3 ranks"):
        assert any(r.startswith(name) and "needs 3 GPUs (this machine has 0)" in r for r in rows), (name, out.stdout)
