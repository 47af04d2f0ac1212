"""A real client nobody here wrote: TorchTitan 0.3.0's own pipeline code (its llama3, deepseek_v3 and
qwen3-MoE split by its pipeline_llm, its FSDP2 at dp=1 and selective activation checkpointing, its chunked
loss, its schedule builder, its optimizer and its `Trainer.train_step` with the methods it calls, unedited)
trains on pipecore after the one line `pipecore.compat.patch_torch_pipelining()`: torch's numbers bit for
bit where torch's runtime is right, one process's in float64 on every schedule (tests/torchtitan_cases.py
says how it is driven on CPU). Each run has processes of its own: the patch lasts for the process."""

import pytest
import torch

from dist_pool import run_fresh
from exactness import FLOAT64_TERMS, after_adamw, assert_matches, rounding_bound

pytest.importorskip("torchtitan", reason="make install-test installs torchtitan==0.3.0 (--no-deps)")

import torchtitan_cases as cases  # noqa: E402 - after the skip: it names torchtitan's modules

# torch's runtime gives one process's gradients on these; a CSV schedule runs on the Interleaved1F1B layout
TORCH_RIGHT = [{"schedule": "1F1B"}, {"schedule": "Interleaved1F1B"}, {"schedule": "Interleaved1F1B", "csv": True}]


def _merged(results: list[dict], at: int) -> dict:
    """Run `at` of every rank: the gradients (after each accumulation group, and after the last), the
    weights after the optimizer step and the MoE biases by parameter name (each rank holds its stages'),
    the step's loss and the eval losses where a rank computed them, the gradient norm of every rank."""
    runs = [r["runs"][at] for r in results]
    for rank, run in enumerate(runs):
        assert "error" not in run, f"rank {rank}: {run['error']}"

    def by_name(key):
        return {name: g for run in runs for name, g in run[key].items()}

    groups = [{name: g for run in runs for name, g in run["grads_by_group"][i].items()}
              for i in range(len(runs[0]["grads_by_group"]))]
    losses = [run["losses"] for run in runs if run["losses"][0] is not None]
    evals = [run["eval_losses"] for run in runs if run["eval_losses"] is not None]
    return {"grads": by_name("grads"), "grads_by_group": groups, "weights": by_name("weights"),
            "expert_biases": by_name("expert_biases"), "losses": losses, "evals": evals,
            "grad_norms": [run["grad_norms"] for run in runs], "lrs": runs[0]["lrs"],
            "info": [run["info"] for run in runs]}


def _loss_bound(ref: dict) -> float:
    """TorchTitan's losses are float32 whatever the model's dtype (its cross entropy casts the logits with
    .float(), its chunked loss sums the chunks in float32): the step's loss is a float32 sum of one loss per
    row (per microbatch), the same on both sides row by row, added in another order (the pipeline sums a
    group's microbatches, then the groups; the reference row after row), so the float32 bound for as many
    terms as rows."""
    rows = len(ref["eval_losses"]) * len(ref["eval_losses"][0]) * len(ref["grads_by_group"])
    return rounding_bound(torch.float32, rows)


def _matches_one_process(run: dict, ref: dict, what: str, grads: str = "grads", bound: float | None = None) -> None:
    """`grads` ("grads", after the last step's accumulation, or "grads_by_group") within `bound` (the float64
    bound if None) and the step's loss."""
    want_groups = [ref["grads"]] if grads == "grads" else ref["grads_by_group"]
    got_groups = [run["grads"]] if grads == "grads" else run["grads_by_group"]
    assert len(got_groups) == len(want_groups), f"{what}: {len(got_groups)} accumulation groups"
    for group, (got, want_group) in enumerate(zip(got_groups, want_groups)):
        after = f" after {group + 1} of {len(want_groups)} step() calls" if grads != "grads" else ""
        assert sorted(got) == sorted(want_group), f"{what}: parameters {sorted(got)}"
        for name, want in want_group.items():
            # None where one process has a gradient is torch's chunked-loss failure (norm.weight)
            assert_matches(got[name], want, f"{what}: gradient of {name}{after}", bound=bound)
    assert run["losses"], f"{what}: no rank returned the step's loss"
    for losses in run["losses"]:
        float32 = [torch.tensor(v, dtype=torch.float32) for v in (losses, ref["losses"])]  # exact: float32 values
        assert_matches(*float32, f"{what}: the step's loss", bound=_loss_bound(ref))


_SHARED: dict[str, list[dict]] = {}


def _shared(key: str, world: int, api: str, runs: list[dict], reference=None, timeout: float = 400) -> list[dict]:
    """cases.titan's results for `runs`, computed once for the tests that read them (starting processes that
    import TorchTitan is most of what a run costs: 10-20 s for 2 or 4 ranks on 2 cores). A run that raises ends
    its list, so runs that fail on purpose go last."""
    if key not in _SHARED:
        _SHARED[key] = run_fresh(world, cases.titan, api, runs, reference, timeout=timeout)
    return _SHARED[key]


def _on_both(runs: list[dict], on_pipecore: list[dict], on_torch: list[dict]) -> list[tuple[dict, dict, dict]]:
    """Per run of `runs`, the first runs of both results: (its options, pipecore's `_merged` run, torch's)."""
    return [(options, _merged(on_pipecore, at), _merged(on_torch, at)) for at, options in enumerate(runs)]


def _bit_for_bit(ours: dict, theirs: dict, what: str) -> None:
    """pipecore's losses and every gradient (`_merged` runs) are torch's runtime's, bit for bit."""
    assert ours["losses"] == theirs["losses"], f"{what}: losses {ours['losses']} against torch's {theirs['losses']}"
    different = [n for n, g in theirs["grads"].items() if not torch.equal(ours["grads"][n], g)]
    assert not different, f"{what}: gradients not bitwise torch's: {different}"


@pytest.mark.exactness
def test_torchtitan_runs_on_pipecore_with_torchs_numbers():
    """1F1B, Interleaved1F1B and a CSV schedule: pipecore's losses and every gradient equal torch's runtime's
    bit for bit, and both equal one process's within the float64 bound."""
    ours_all = _shared("pipecore, 2 ranks", 2, "pipecore", TORCH_RIGHT + ZERO_BUBBLE, 1)
    ref = ours_all[0]["reference"]
    for options, ours, theirs in _on_both(TORCH_RIGHT, ours_all, _shared("torch, 2 ranks", 2, "torch", TORCH_ALL)):
        what = f"{options['schedule']}{' from a CSV' if options.get('csv') else ''}"
        assert all(i["schedule_class"].startswith("pipecore.compat.schedules.") and
                   i["stage_class"] == "pipecore.stage.pipeline_stage.PipelineStage" for i in ours["info"]), ours["info"]
        assert all(i["schedule_class"].startswith("torch.distributed.pipelining.") for i in theirs["info"])
        _bit_for_bit(ours, theirs, what)
        _matches_one_process(ours, ref, f"pipecore, {what}")
        _matches_one_process(theirs, ref, f"torch, {what}")


ZERO_BUBBLE = [{"schedule": "ZBVZeroBubble", "evaluate": True}, {"schedule": "InterleavedZeroBubble"},
               {"schedule": "DualPipeV", "evaluate": True},
               # without checkpointing: torch 2.13 leaves norm.weight's gradient None under the chunked loss
               {"schedule": "ZBVZeroBubble", "ac": "none"}, {"schedule": "InterleavedZeroBubble", "ac": "none"}]
# where torch's runtime fails (test_torchs_runtime_fails_where_pipecore_does_not): the second raises, so last
TORCH_FAILS = [{"schedule": "ZBVZeroBubble", "ac": "none"}, {"schedule": "ZBVZeroBubble"}]
TORCH_ALL = TORCH_RIGHT + TORCH_FAILS


@pytest.mark.exactness
def test_torchtitan_zero_bubble_schedules_with_its_fsdp2_at_dp1_give_one_process_gradients():
    """The schedules with the I/W split, where FSDP2 at dp=1 lost the W's after a stage's last I (issue 49)
    and where torch 2.13 fails (test_torchs_runtime_fails_where_pipecore_does_not): every gradient,
    norm.weight's included, and the loss equal one process's; eval() of the V schedules (TorchTitan's
    validator's call) gives one process's eval losses."""
    results = _shared("pipecore, 2 ranks", 2, "pipecore", TORCH_RIGHT + ZERO_BUBBLE, 1)
    ref = results[0]["reference"]
    for at, options in enumerate(ZERO_BUBBLE, start=len(TORCH_RIGHT)):
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
    results = _shared("torch, 2 ranks", 2, "torch", TORCH_ALL)
    first = len(TORCH_RIGHT)
    missing = sorted({name for r in results for name in r["runs"][first]["info"]["missing_grads"]})
    assert missing == ["norm.weight"], missing
    errors = [r["runs"][first + 1].get("error", "") for r in results]
    assert any("backward an extra time" in e and "checkpoint" in e for e in errors), errors


# TorchTitan's MoE models (issue 58): its deepseek_v3 and qwen3-MoE, as its trainer trains them with
# training.global_batch_size twice local_batch_size (gradient_accumulation_steps=2: two schedule step() calls
# before one optimizer step), one zero-bubble and one looped schedule, the latter with
# pipeline_parallel_layers_per_stage=1 (6 stages: the embedding alone, one layer each, norm and head alone)
MOE_SCHEDULES = {"ZBVZeroBubble": {"schedule": "ZBVZeroBubble"},
                 "Interleaved1F1B": {"schedule": "Interleaved1F1B", "layers_per_stage": 1}}
ACCUMULATE = 2


@pytest.mark.exactness
@pytest.mark.parametrize("schedule", sorted(MOE_SCHEDULES))
@pytest.mark.parametrize("model", ["deepseek_v3", "qwen3_moe"])
def test_torchtitan_moe_gradient_accumulation_with_its_fsdp2_at_dp1_gives_one_process_numbers(model, schedule):
    """Issue 58: under TorchTitan's FSDP2 at dp=1, whose one fully_shard([norm, lm_head]) makes one FSDP
    state for two modules, the second step() call left norm's and lm_head's gradients holding the first
    call's gradient twice (0.6-0.95 of the largest entry off), with no error. Every parameter's gradient
    after each step() call, the step's loss and the clipping's gradient norm, every weight after
    TorchTitan's AdamW step and the MoE load-balancing biases its hook updates, and the eval losses
    through its validator's eval(arg_mbs=...) after the step, equal one process's (TorchTitan's
    non-pipeline train_step), the MoE experts in float64 (tests/torchtitan_cases.py: their bf16 GEMMs
    swapped)."""
    order = sorted(MOE_SCHEDULES)  # both schedules of a model in one set of processes
    runs = [{"model": model, "accumulate": ACCUMULATE, "evaluate": True, **MOE_SCHEDULES[s]} for s in order]
    results = _shared(f"pipecore, {model}", 2, "pipecore", runs, {"model": model, "accumulate": ACCUMULATE})
    ref = results[0]["reference"]
    options = runs[order.index(schedule)]
    run = _merged(results, order.index(schedule))
    what = f"{model}, {schedule}"
    info = run["info"]
    # the configuration the test is about: TorchTitan's wrapping of its last stage, its accumulation, the layout
    assert [["lm_head", "norm"]] in [sorted(map(sorted, i["shared_fsdp_states"])) for i in info], info
    assert all(i["gradient_accumulation_steps"] == ACCUMULATE for i in info), info
    assert all(i["schedule_class"].startswith("pipecore.compat.schedules.") for i in info), info
    assert sum(len(i["stages"]) for i in info) == (6 if options.get("layers_per_stage") == 1 else 4), info
    assert run["expert_biases"], f"{what}: no MoE layer"
    assert cases.gradient_terms(ACCUMULATE) <= FLOAT64_TERMS  # what FLOAT64_BOUND covers
    _matches_one_process(run, ref, what, grads="grads_by_group")
    for norms in run["grad_norms"]:
        assert_matches(norms, ref["grad_norms"], f"{what}: the gradient norm clipping computes")
    assert run["lrs"] == ref["lrs"], (run["lrs"], ref["lrs"])
    (lr,) = ref["lrs"][0]
    for name, want in ref["weights"].items():
        assert_matches(run["weights"][name], want, f"{what}: {name} after the optimizer step",
                       bound=after_adamw(lr, 1))
    assert sorted(run["expert_biases"]) == sorted(ref["expert_biases"])
    for name, want in ref["expert_biases"].items():
        assert_matches(run["expert_biases"][name], want, f"{what}: {name} after the load-balancing hook")
    assert run["evals"], f"{what}: no rank returned eval losses"
    for losses in run["evals"]:
        # float32 losses (TorchTitan's cross entropy) of weights that agree within after_adamw: a microbatch's
        # loss is a float32 mean over its tokens, which may round either way
        assert_matches(losses, ref["eval_losses"][0], f"{what}: eval losses after the optimizer step",
                       bound=rounding_bound(torch.float32, cases.SEQ * cases.MICROBATCH))


# TorchTitan's tensor x pipeline parallel (issue 63): TP=2 x PP=2 on 4 ranks, its FSDP2 at dp=1 and selective
# checkpointing. Its DTensor TP backends hand DTensors from stage to stage (sharded by sequence with sequence
# parallel, replicated without), which pipecore rebuilds on the receiving stage's TP mesh; before, it refused
# them, and with the conversion done by hand ZBV and an uneven split hung (a DTensor buffer's comparison in
# the step's rollback ran a collective on some pipeline ranks only).
UNEVEN = [["tok_embeddings", "layers.0", "layers.1", "layers.2"], ["layers.3", "norm", "lm_head"]]
UNEVEN_V = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2"], ["layers.3"], ["norm", "lm_head"]]
# bitwise torch's where the activations are sharded (sequence parallel): replicated ones (without it) have
# their gradient reduced over the TP group on the receiving stage, where torch sends each rank's partial
# sums and its sender's graph reduces them later (another order: one process's numbers either way)
TP_TORCH_RIGHT = [{"schedule": "1F1B", "tp": 2, "spmd_backend": "partial_dtensor"},
                  {"schedule": "Interleaved1F1B", "tp": 2, "spmd_backend": "full_dtensor"}]
TP_ONE_PROCESS = [{"schedule": "ZBVZeroBubble", "tp": 2, "spmd_backend": "partial_dtensor"},
                  {"schedule": "1F1B", "tp": 2, "spmd_backend": "partial_dtensor", "sequence_parallel": False,
                   "parts": UNEVEN},
                  {"schedule": "ZBVZeroBubble", "tp": 2, "spmd_backend": "full_dtensor", "parts": UNEVEN_V}]


def _tensor_parallel_bound() -> float:
    """Tensor parallelism splits the model's float64 sums over two ranks (another order: apart within the
    float64 bound), and TorchTitan computes its loss head in float32 (the logits cast, the softmax over the
    vocabulary and its gradient's sum, the hidden states' gradient in float32 buffers: module docstring of
    torchtitan_cases), where values that differ in their last float64 bits may round to neighbouring float32
    values. So every gradient, which flows back from that head, may differ by the float32 rounding of the
    head's chain of sums (transformer_terms' head: 3 x width + 2 x vocabulary)."""
    return rounding_bound(torch.float32, 3 * cases.DIM + 2 * cases.VOCAB)


@pytest.mark.exactness
def test_torchtitan_tensor_parallel_runs_on_pipecore_with_torchs_numbers():
    """TP=2 x PP=2 with sequence parallel, 1F1B (partial_dtensor) and Interleaved1F1B (full_dtensor): DTensor
    activations cross stages; losses and every gradient equal torch's runtime's bit for bit, and one
    process's within the float32 bound of TorchTitan's loss head."""
    ours_all = _shared("pipecore, TP", 4, "pipecore", TP_TORCH_RIGHT, 1)
    ref = ours_all[0]["reference"]
    for options, ours, theirs in _on_both(TP_TORCH_RIGHT, ours_all, _shared("torch, TP", 4, "torch", TP_TORCH_RIGHT)):
        what = f"{options['schedule']}, TP=2 ({options['spmd_backend']})"
        assert all(i["schedule_class"].startswith("pipecore.compat.schedules.") for i in ours["info"]), ours["info"]
        _bit_for_bit(ours, theirs, what)
        _matches_one_process(ours, ref, f"pipecore, {what}", bound=_tensor_parallel_bound())


@pytest.mark.exactness
def test_torchtitan_tensor_parallel_zero_bubble_and_uneven_splits_give_one_process_gradients():
    """TP=2 x PP=2 on ZBV (the I/W split, V stages) and on uneven splits (3 layers and 1; a V of 2, 1, 1 and
    the head alone), both DTensor backends, sequence parallel on and off: every gradient and the loss equal
    one process's within the float32 bound of TorchTitan's loss head. These hung before (rollback)."""
    # processes of their own: after TP_TORCH_RIGHT's runs in the same processes, TorchTitan's full_dtensor
    # backend fails in fully_shard ("Expected param's DTensor mesh to be the same mesh passed to fully_shard")
    results = run_fresh(4, cases.titan, "pipecore", TP_ONE_PROCESS, 1, timeout=400)
    ref = results[0]["reference"]
    for at, options in enumerate(TP_ONE_PROCESS):
        run = _merged(results, at)
        layout = "uneven" if options.get("parts") else "even"
        what = f"{options['schedule']}, TP=2 ({options['spmd_backend']}, {layout})"
        assert sum(len(i["stages"]) for i in run["info"]) == 2 * len(options.get("parts") or [0, 0]) or \
            options["schedule"] == "ZBVZeroBubble", run["info"]
        _matches_one_process(run, ref, what, bound=_tensor_parallel_bound())
