"""A real client nobody here wrote: TorchTitan 0.3.0's own pipeline code (its llama3 split, its FSDP2 at dp=1
and selective activation checkpointing, its chunked loss, its schedule builder and its
`Trainer.pp_forward_backward_step`, unedited) trains on pipecore after the one line
`pipecore.compat.patch_torch_pipelining()`: torch's numbers bit for bit where torch's runtime is right,
one process's in float64 on every schedule (tests/torchtitan_cases.py says how it is driven on CPU).
Each run has processes of its own: the patch lasts for the process."""

import pytest
import torch

from dist_pool import run_fresh
from exactness import assert_matches

pytest.importorskip("torchtitan", reason="make install-test installs torchtitan==0.3.0 (--no-deps)")

import torchtitan_cases as cases  # noqa: E402 - after the skip: it names torchtitan's modules

# torch's runtime gives one process's gradients on these; a CSV schedule runs on the Interleaved1F1B layout
TORCH_RIGHT = [{"schedule": "1F1B"}, {"schedule": "Interleaved1F1B"}, {"schedule": "Interleaved1F1B", "csv": True}]


def _merged(results: list[dict], at: int) -> dict:
    """Run `at` of every rank: the gradients by parameter name (each rank holds its stages'), the step's
    loss and the eval losses where a rank computed them."""
    runs = [r["runs"][at] for r in results]
    for rank, run in enumerate(runs):
        assert "error" not in run, f"rank {rank}: {run['error']}"
    grads = {name: g for run in runs for name, g in run["grads"].items()}
    losses = [run["losses"] for run in runs if run["losses"][0] is not None]
    evals = [run["eval_losses"] for run in runs if run["eval_losses"] is not None]
    return {"grads": grads, "losses": losses, "evals": evals, "info": [run["info"] for run in runs]}


def _matches_one_process(run: dict, ref: dict, what: str) -> None:
    assert sorted(run["grads"]) == sorted(ref["grads"]), f"{what}: parameters {sorted(run['grads'])}"
    for name, want in ref["grads"].items():
        # None where one process has a gradient is torch's chunked-loss failure (norm.weight)
        assert_matches(run["grads"][name], want, f"{what}: gradient of {name}")
    assert run["losses"], f"{what}: no rank returned the step's loss"
    for losses in run["losses"]:
        assert_matches(losses, ref["losses"], f"{what}: the step's loss")


@pytest.mark.exactness
def test_torchtitan_runs_on_pipecore_with_torchs_numbers():
    """1F1B, Interleaved1F1B and a CSV schedule: pipecore's losses and every gradient equal torch's runtime's
    bit for bit, and both equal one process's within the float64 bound."""
    on_torch = run_fresh(2, cases.titan, "torch", TORCH_RIGHT, 1, timeout=300)
    on_pipecore = run_fresh(2, cases.titan, "pipecore", TORCH_RIGHT, timeout=300)
    ref = on_torch[0]["reference"]
    for at, options in enumerate(TORCH_RIGHT):
        what = f"{options['schedule']}{' from a CSV' if options.get('csv') else ''}"
        theirs, ours = _merged(on_torch, at), _merged(on_pipecore, at)
        assert all(i["schedule_class"].startswith("pipecore.compat.schedules.") and
                   i["stage_class"] == "pipecore.stage.pipeline_stage.PipelineStage" for i in ours["info"]), ours["info"]
        assert all(i["schedule_class"].startswith("torch.distributed.pipelining.") for i in theirs["info"])
        assert ours["losses"] == theirs["losses"], f"{what}: losses {ours['losses']} against torch's {theirs['losses']}"
        different = [n for n, g in theirs["grads"].items() if not torch.equal(ours["grads"][n], g)]
        assert not different, f"{what}: gradients not bitwise torch's: {different}"
        _matches_one_process(ours, ref, f"pipecore, {what}")
        _matches_one_process(theirs, ref, f"torch, {what}")


ZERO_BUBBLE = [{"schedule": "ZBVZeroBubble", "evaluate": True}, {"schedule": "InterleavedZeroBubble"},
               {"schedule": "DualPipeV", "evaluate": True},
               # without checkpointing: torch 2.13 leaves norm.weight's gradient None under the chunked loss
               {"schedule": "ZBVZeroBubble", "ac": "none"}, {"schedule": "InterleavedZeroBubble", "ac": "none"}]


@pytest.mark.exactness
def test_torchtitan_zero_bubble_schedules_with_its_fsdp2_at_dp1_give_one_process_gradients():
    """The schedules with the I/W split, where FSDP2 at dp=1 lost the W's after a stage's last I (issue 49)
    and where torch 2.13 fails (test_torchs_runtime_fails_where_pipecore_does_not): every gradient,
    norm.weight's included, and the loss equal one process's; eval() of the V schedules (TorchTitan's
    validator's call) gives one process's eval losses."""
    results = run_fresh(2, cases.titan, "pipecore", ZERO_BUBBLE, 1, timeout=300)
    ref = results[0]["reference"]
    for at, options in enumerate(ZERO_BUBBLE):
        what = f"{options['schedule']} (activation checkpointing: {options.get('ac', 'selective')})"
        run = _merged(results, at)
        _matches_one_process(run, ref, what)
        if options.get("evaluate"):
            assert run["evals"], f"{what}: no rank returned eval losses"
            for losses in run["evals"]:
                # V schedules: the last stage is on rank 0, whose microbatches are replica 0's (dp=1)
                assert_matches(losses, ref["eval_losses"][0], f"{what}: eval losses")


@pytest.mark.exactness
def test_torchtitan_with_two_data_parallel_replicas():
    """4 ranks, dp=2 x pp=2 (TorchTitan's partial_dtensor backend: its default spmd_types one fails at
    dp=2 on torch 2.13 itself, in fully_shard), FSDP2 over the dp dimension: one process's gradients."""
    runs = [{"schedule": "1F1B", "dp": 2, "spmd_backend": "partial_dtensor"},
            {"schedule": "ZBVZeroBubble", "dp": 2, "spmd_backend": "partial_dtensor"}]
    results = run_fresh(4, cases.titan, "pipecore", runs, 2, timeout=400)
    ref = results[0]["reference"]
    for at, options in enumerate(runs):
        _matches_one_process(_merged(results, at), ref, f"{options['schedule']} at dp=2")


def test_torchs_runtime_fails_where_pipecore_does_not():
    """What the docs say torch 2.13 does with TorchTitan's defaults, measured: under the chunked loss and the
    I/W split norm.weight gets no gradient, and with selective activation checkpointing the I/W split
    fails ("backward an extra time"). test_torchtitan_zero_bubble_schedules_... runs both on pipecore."""
    runs = [{"schedule": "ZBVZeroBubble", "ac": "none"}, {"schedule": "ZBVZeroBubble"}]
    results = run_fresh(2, cases.titan, "torch", runs, timeout=300)
    missing = sorted({name for r in results for name in r["runs"][0]["info"]["missing_grads"]})
    assert missing == ["norm.weight"], missing
    errors = [r["runs"][1].get("error", "") for r in results]
    assert any("backward an extra time" in e and "checkpoint" in e for e in errors), errors
