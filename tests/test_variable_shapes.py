"""Microbatches of their own shapes: `Pipeline.step_microbatches` with lengths that differ per
microbatch and change at every step (tests/variable_shape_cases.py)."""

import pytest
import torch

import pipecore as pc
from dist_pool import pool
from exactness import FLOAT64_BOUND, assert_matches, rounding_bound, transformer_terms
from variable_shape_cases import keyword_microbatches, tagged_values, train_variable, wrong_count

TRAINING = [name for name in pc.SCHEDULES if name != "forward_only"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", TRAINING)
def test_every_schedule_with_lengths_new_at_every_step(name, world):
    """5 steps of the example GPT, each microbatch its own length, new at every step: every loss and
    gradient within exactness.FLOAT64_BOUND of one process running the same microbatches; the outputs come back one
    per microbatch, each its own shape."""
    results = pool(world).run(train_variable, name, 5, timeout=300)
    for rank, r in enumerate(results):
        assert r["grad"] <= FLOAT64_BOUND and r["loss"] <= FLOAT64_BOUND, (rank, r)
    holders = [r["outputs"] for r in results if r["outputs"]]  # dualpipe: two ranks, half the microbatches each
    assert holders and all(len(steps) == 5 for steps in holders), holders
    for step in range(5):  # every microbatch's output once, shaped by its own length
        got = [next(s for s in (steps[step][mb] for steps in holders) if s is not None) for mb in range(len(
            holders[0][step]))]
        assert all(sum(steps[step][mb] is not None for steps in holders) == 1 for mb in range(len(got))), holders
        assert [shape[1] for shape in got] == results[0]["lengths"][step], (got, results[0]["lengths"])


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_data_parallel_replicas_with_microbatches_of_their_own_lengths(name):
    for rank, r in enumerate(pool(4).run(train_variable, name, 3, 2, timeout=300)):
        assert r["grad"] <= FLOAT64_BOUND and r["loss"] <= FLOAT64_BOUND, (rank, r)


@pytest.mark.parametrize("name", TRAINING)
def test_every_schedule_on_the_device_path_with_shapes_in_the_messages(name):
    """The same on the device path's protocol, emulated, with variable_shapes (messages at their
    capacity, headers read by the host): exact; messages that outgrew their capacities followed
    on the follow-up channels (some did: lengths grow over the steps); no step ran twice; the stream
    contract holds."""
    results = pool(2).run(train_variable, name, 5, 1, True, timeout=300)
    for rank, r in enumerate(results):
        assert r["grad"] <= FLOAT64_BOUND and r["loss"] <= FLOAT64_BOUND and r["violations"] == [], (rank, r)
        assert r["extra_forwards"] == 0, (rank, r)
    assert any(r["grown"] > 0 for r in results), results


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_data_parallel_replicas_on_the_device_path_with_shapes_in_the_messages(name):
    """dp=2 replicas of their own lengths on the emulated device path, messages outgrowing their
    capacities in one replica and not the other: exact."""
    results = pool(4).run(train_variable, name, 3, 2, True, timeout=300)
    for rank, r in enumerate(results):
        assert r["grad"] <= FLOAT64_BOUND and r["loss"] <= FLOAT64_BOUND and r["violations"] == [], (rank, r)


@pytest.mark.parametrize("name, compat", [("1f1b", False), ("interleaved_1f1b", False), ("zbv", True)])
def test_a_python_value_per_microbatch_crosses_the_boundary(name, compat):
    """Also through pipecore.compat's `_step_microbatches`, torch's name."""
    for rank, worst in enumerate(pool(2).run(tagged_values, name, compat, timeout=120)):
        assert worst <= FLOAT64_BOUND, (rank, worst)


def test_a_wrong_number_of_microbatches_fails_every_rank():
    for rank, text in enumerate(pool(2).run(wrong_count, timeout=60)):
        assert "arg_mbs must be a list of one entry per microbatch (4), got 3" in text, (rank, text)


def test_a_packed_row_computes_what_its_documents_compute_one_by_one():
    """examples/train_packed.py's model: position ids restart and attention stays in its document."""
    import argparse

    import train_packed as ex

    model = ex.build(argparse.Namespace(width=32, layers=2, max_len=64))
    text = torch.arange(256, dtype=torch.uint8).repeat(8)
    ids, doc, pos, _ = ex.packed_row(text, torch.Generator().manual_seed(3), 64, 20)
    packed = ex._run(model, ids, doc, pos)
    for d in doc.unique().tolist():
        keep = doc[0] == d
        alone = ex._run(model, ids[:, keep], torch.zeros_like(doc[:, keep]), pos[:, keep])
        assert_matches(packed[:, keep], alone, f"document {d}")
    assert doc.unique().numel() > 2


def test_the_packed_example_trains():
    import os
    import re
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "train_packed.py")
    out = subprocess.run([sys.executable, script, "--ranks", "2", "--schedule", "zbv", "--steps", "5",
                          "--microbatches", "4", "--max-len", "48", "--layers", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    found = re.search(r"gradients within ([0-9.e+-]+) of one process", out.stdout)
    # fp32, as users run the example: 4 packed rows of at most 48 tokens, 2 blocks of width 64 (MLP 256,
    # 4 heads of 16), 256 tokens in the vocabulary: 5,376 terms in its longest sums, 6.4e-4
    bound = rounding_bound(torch.float32, transformer_terms(tokens=4 * 48, width=64, mlp_width=256, layers=2,
                                                            head_width=16, seq_len=48, vocab=256))
    assert found and float(found.group(1)) <= bound, out.stdout
    assert "step 5: loss" in out.stdout, out.stdout


def test_keyword_microbatches_reach_every_stage_and_eval_takes_microbatches():
    results = pool(2).run(keyword_microbatches, timeout=60)
    assert all(r["grad"] <= FLOAT64_BOUND for r in results), results
    assert results[0]["outputs"] is None and results[1]["outputs"] <= FLOAT64_BOUND, results
