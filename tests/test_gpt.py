"""The example GPT (tied embedding/head, causal attention, LayerNorm) through pipecore equals
single-process training: losses, every gradient after global-norm clipping, the clipping norm,
over 3 AdamW steps; tied copies stay equal; token-normalised losses; checkpointing; autocast."""

import pytest
import torch

import gpt_cases
import pipecore as pc
from dist_pool import pool
from exactness import FLOAT64_BOUND, rounding_bound
from gpt import GPTConfig

SCHEDULES = ["1f1b", "interleaved_1f1b", "zbv", "dualpipev", "dualpipe"]


def check(results, grad=FLOAT64_BOUND, loss=FLOAT64_BOUND, norm=FLOAT64_BOUND):
    for rank, r in enumerate(results):
        assert r["grad"] <= grad, (f"rank {rank}: gradients differ from one process by {r['grad']:.2e} (relative, "
                                   f"{r.get('where')})")
        assert r["norm"] <= norm, f"rank {rank}: clipping norm differs by {r['norm']:.2e}"
        assert r["loss"] <= loss, f"rank {rank}: losses differ by {r['loss']:.2e}"
        assert r["tied_equal"], f"rank {rank}: a tied copy drifted from the single-process weight ({r['tied_drift']:.2e})"
    # every microbatch's loss exists on exactly one rank
    for step in range(len(results[0]["losses"])):
        per_mb = list(zip(*(r["losses"][step] for r in results if r["losses"][step])))
        assert per_mb and all(sum(v is not None for v in col) == 1 for col in per_mb)
    # the tied copies are equal bit for bit, across ranks too
    tied = [t for r in results for t in r["tied_values"]]
    assert len(tied) >= 2 and all(torch.equal(t, tied[0]) for t in tied)


@pytest.mark.exactness
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", SCHEDULES)
def test_gpt_matches_single_process(name, world):
    check(pool(world).run(gpt_cases.train_gpt, name, 2 * world, timeout=300))


@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipev", "dualpipe"])
def test_gradients_accumulate_over_steps(name):
    """Two steps before each optimizer step: the second adds its gradients to .grad, the tied
    embedding/head and dualpipe's mirrored copies included, as loss.backward() twice would."""
    check(pool(2).run(gpt_cases.train_gpt, name, 4, {"steps": 4, "accumulate": True}, timeout=300))


@pytest.mark.parametrize("name", ["1f1b", "dualpipe"])
def test_token_normalised_loss_matches_whole_batch_mean(name):
    """loss_fn sums over a microbatch's tokens (padding ignored, different counts per row) and
    loss_divisor is the batch's token count: gradients equal the single-process token mean."""
    check(pool(2).run(gpt_cases.train_gpt, name, 4, {"tokens": True}, timeout=300))


@pytest.mark.parametrize("norm_type", [1.0, float("inf")])
def test_clip_norm_types(norm_type):
    check(pool(2).run(gpt_cases.train_gpt, "zbv", 4, {"steps": 2, "norm_type": norm_type},
                         timeout=300))


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_activation_checkpointing_matches(name):
    results = pool(2).run(gpt_cases.train_gpt, name, 4,
                          {"steps": 2, "stage_options": {"activation_checkpointing": True}}, timeout=300)
    check(results)
    if name == "zbv":  # the checkpoint's node cannot be split: reported, not hidden
        assert any(r["warnings"] for r in results)


@pytest.mark.exactness
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_the_example_in_fp32_as_users_run_it(name):
    """The example GPT in fp32, one step: within the rounding of its longest sums (gpt_cases.gradient_terms:
    3,200 terms for 1f1b's 2 blocks, 5,056 for zbv's 4: 3.8e-4 and 6.0e-4), which kernel ran aside."""
    cfg = gpt_cases.small_config(pc.build_schedule(name, 2, 4))
    bound = rounding_bound(torch.float32, gpt_cases.gradient_terms(cfg, tokens=8 * cfg.seq_len))
    check(pool(2).run(gpt_cases.train_gpt, name, 4, {"steps": 1, "dtype": torch.float32}, timeout=300),
          grad=bound, loss=bound, norm=bound)


@pytest.mark.exactness
def test_bf16_autocast_through_the_pipeline():
    """Forward and loss under bf16 autocast on every stage (fp32 weights, as users train), compared with
    one process running the same microbatches under the same autocast: each kernel sees the batch it
    sees in the pipeline, so bf16 rounds alike, and what is left is fp32's sum of the microbatches'
    gradients in another order (m = 4 terms, within the fp32 bound of the whole chain's sums). One
    step: AdamW would turn those last bits into steps of +-lr."""
    cfg = gpt_cases.small_config(pc.build_schedule("1f1b", 2, 4))
    bound = rounding_bound(torch.float32, gpt_cases.gradient_terms(cfg, tokens=8 * cfg.seq_len))
    results = pool(2).run(gpt_cases.train_gpt, "1f1b", 4, {"steps": 1, "stage_options": {"autocast": torch.bfloat16},
                                                          "dtype": torch.float32, "by_microbatch": True}, timeout=300)
    check(results, grad=bound, loss=bound, norm=bound)


@pytest.mark.parametrize("what, message", [
    ("shape", "different shapes or dtypes"),
    ("alone", "is declared on stage 0 only"),
    ("two_keys", "stage 0 (tied 'embedding'), stage 3 (tied 'head') hold one Parameter object (embed.tok.weight) "
                 "that they do not declare as one tied weight"),
    ("undeclared", "stage 0, stage 3 hold one Parameter object (embed.tok.weight) that they do not declare as one "
                   "tied weight"),
])
def test_tie_errors_on_every_rank(what, message):
    results = pool(2).run(gpt_cases.tie_mismatch, what)
    for rank, texts in enumerate(results):
        assert all(message in text for text in texts), f"rank {rank}: {texts}"


@pytest.mark.parametrize("name, world", [("1f1b", 2), ("zbv", 2), ("interleaved_1f1b", 4)])
def test_tied_copies_that_part_fail_the_next_step_on_every_rank(name, world):
    """An optimizer that leaves one copy of the tied embedding out: the copies part at the first
    optimizer step, the second step's gradient sum finds it (exchange between two ranks, or on one
    rank under zbv), and the third and fourth steps fail on every rank, naming the tie and what to do."""
    for rank, outcomes in enumerate(pool(world).run(gpt_cases.tied_copies_parted, name, timeout=120)):
        assert outcomes[:2] == ["ok", "ok"], (rank, outcomes)
        for failed in outcomes[2:]:  # and every later step, until the Pipeline is built again
            assert "tied weight 'embed.tok.weight':" in failed and "differ" in failed, (rank, outcomes)
            assert "give every copy to the optimizer with the same settings" in failed, (rank, outcomes)


@pytest.mark.parametrize("name, world", [("1f1b", 2), ("zbv", 2), ("dualpipe", 2), ("interleaved_1f1b", 4)])
def test_tied_copies_start_equal(name, world):
    for rank, rows in enumerate(pool(world).run(gpt_cases.tied_start_equal, name)):
        assert all(equal for _, equal in rows), f"rank {rank}: {rows}"


def test_example_script_with_data_parallel_replicas():
    """examples/train_gpt.py --ranks 4 --dp 2 (torchrun, 2 replicas of a 2-rank pipeline): it trains,
    and its first step's gradients equal one process's on the whole batch."""
    import os
    import re
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "train_gpt.py")
    out = subprocess.run([sys.executable, script, "--ranks", "4", "--dp", "2", "--steps", "2", "--width", "32",
                          "--layers", "2", "--heads", "2", "--seq-len", "16", "--rows", "16", "--microbatches", "4",
                          "--check-steps", "1", "--sample-tokens", "4", "--timeline", ""],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "2 data-parallel replicas of 2" in out.stdout, out.stdout
    found = re.search(r"gradients of step 0 within ([0-9.e+-]+)", out.stdout)
    bound = rounding_bound(torch.float32, gpt_cases.gradient_terms(GPTConfig(seq_len=16, width=32, heads=2, layers=2),
                                                                    tokens=16 * 16))
    assert found and float(found.group(1)) <= bound, out.stdout


@pytest.mark.parametrize("name, declared", [("1f1b", True), ("zbv", True), ("dualpipev", True),
                                            ("1f1b", False), ("zbv", False), ("dualpipe", False)])
def test_a_head_that_is_the_embedding_ties_on_every_schedule(name, declared):
    # declared by hand or found by pc.partition; V placements put both ends on rank 0 as one
    # Parameter: one copy there, counted once
    results = pool(2).run(gpt_cases.tied_as_one_parameter, name, declared, timeout=120)
    for rank, r in enumerate(results):
        assert r["grad"] <= FLOAT64_BOUND and r["norm"] <= FLOAT64_BOUND, (rank, r)
    assert results[0]["one_parameter"] == (name != "1f1b")


def test_the_tie_sample_stays_inside_a_real_vocabulary():
    """The 64 entries compared between tied copies are in bounds above 2**24 entries (GPT-2's
    50257 x 768, Llama 3.2's 128256 x 2048), where float indices would round past the end."""
    from types import SimpleNamespace

    from pipecore.training.ties import SAMPLE, TiedWeights

    for n in (2**24 + 4, 50257 * 768, 7):
        weight = torch.arange(n, dtype=torch.float32)
        fake = SimpleNamespace(_params={("embedding", 0): weight})
        sample = TiedWeights._sample(fake, "embedding", SimpleNamespace(stage=0))
        assert sample.shape == (SAMPLE,) and sample[0] == 0 and sample[-1] == weight[-1], n
