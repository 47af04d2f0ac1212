"""pipecore.compat: a loop written against torch.distributed.pipelining runs on pipecore by changing
its imports, with torch's numbers (and single-process training's)."""

import subprocess
import sys

import pytest
import torch

import pipecore as pc
from compat_cases import (chunk_specs, dw_builder_data_parallel, dw_builder_run, dw_reference, fsdp2_stages, misuse,
                          activation_liveness, finalize_gradients_on_fsdp2, forward_contexts, refused_215_option, torch_215_loop, torch_and_pipecore, torch_stage_objects, traced_pipeline)
from dist_pool import pool
from exactness import FLOAT64_BOUND, after_adamw, assert_matches

SHARED = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
# torch's eval() of a V-placed schedule (two adjacent stages on one rank) waits forever (torch 2.13)
TORCH_EVAL_HANGS = ("ZBVZeroBubble", "DualPipeV")


def _compare_runs(got: dict, want: dict, what: str, steps: int | None = None,
                  weights_bound: float = FLOAT64_BOUND) -> None:
    """Losses per step, every gradient of the first `steps` steps (all: None) and, when all steps are
    compared, the parameters after them (within `weights_bound`)."""
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"])):
        assert (g is None) == (w is None), f"{what}: step {step}: losses on one side only"
        if g is not None:
            assert_matches(g, w, f"{what}: step {step}: loss")
    for step, (g, w) in enumerate(zip(got["grads"][:steps], want["grads"][:steps])):
        for name in w:
            assert_matches(g.get(name), w[name], f"{what}: step {step}: {name}")
    if steps is None:
        for name, p in got["params"].items():
            assert_matches(p, want["params"][name], f"{what}: parameter {name} after the steps", weights_bound)


def _by_model_name(result: dict) -> dict:
    """Global names "stage.param" -> the model's parameter names (a chunk keeps the model's names)."""
    strip = lambda d: {k.split(".", 1)[1]: v for k, v in d.items()}  # noqa: E731
    return {"losses": result["losses"], "grads": [strip(g) for g in result["grads"]],
            "params": strip(result["params"])}


def _needs_torch_215():
    from pipecore.compat.schedules import torch_has_waits

    if not torch_has_waits():
        pytest.skip("torch 2.15's arguments and action kinds: this torch is older")


@pytest.mark.exactness
@pytest.mark.parametrize("schedule,options", [
    ("Interleaved1F1B", dict(max_active_stages=2, unshard_lookahead="auto", defer_reduce_grad_wait=True)),
    ("ZBVZeroBubble", dict(max_active_stages=1, unshard_lookahead=(1, 1))),
    ("DualPipeV", dict(defer_reduce_grad_wait=False, max_outstanding_sends=None)),
    ("LoopedBFS", dict(max_active_stages=3, unshard_lookahead="full", defer_reduce_grad_wait=True)),
])
def test_a_torch_215_loop_with_its_new_arguments_and_waits_runs_on_pipecore(schedule, options, tmp_path):
    """torch 2.15's schedule arguments, step(finalize_gradients=False) (no FSDP2 stage: nothing to
    defer, in torch and here) and its compute_comms CSV with WAIT_SEND_F/WAIT_SEND_B/WAIT_REDUCE_GRAD:
    torch's losses and gradients to the bit, from pipecore's own schedule and from torch's CSV."""
    _needs_torch_215()
    results = pool(2).run(torch_215_loop, schedule, 4, options, {"finalize_gradients": False},
                          str(tmp_path / "torch.csv"), timeout=300)
    text = (tmp_path / "torch.csv").read_text()
    assert "WAIT_SEND_F" in text and "WAIT_REDUCE_GRAD" in text  # torch's CSV holds the new kinds
    for rank, out in enumerate(results):
        want = out["torch"]
        for api in ("pipecore", "pipecore_csv"):
            got = out[api]
            _compare_runs(got, want, f"rank {rank}: {api} against torch")
            assert got["losses"] == want["losses"]
            assert all(torch.equal(g[n], w[n]) for g, w in zip(got["grads"], want["grads"]) for n in w)
        # what pipecore shows of its schedule holds torch's waits, where torch's rules place them
        shown = out["pipecore"]["order_with_comms"]
        assert any("WAIT_SEND" in a for a in shown) and any("WAIT_REDUCE_GRAD" in a for a in shown)
        pc.Schedule([shown if r == rank else [] for r in range(2)], num_stages=4, num_microbatches=4,
                    placement="v" if schedule in ("ZBVZeroBubble", "DualPipeV") else "loop")


@pytest.mark.parametrize("options,error,text", [
    (dict(max_outstanding_sends=2), "InputError", "pipecore's executor frees each send as soon as it completes"),
    (dict(max_outstanding_sends=-1), "ValueError", "max_outstanding_sends must be a non-negative integer"),
    (dict(unshard_lookahead=(1,)), "ValueError", "unshard_lookahead tuple length must equal the pipeline degree"),
    (dict(max_active_stages=2, unshard_lookahead=(3, 1)), "ScheduleError", r"unshard_lookahead\[0\] must be an integer"),
    (dict(max_active_stages=0), "ScheduleError", "max_active_stages must be a positive integer"),
    (dict(defer_reduce_grad_wait="yes"), "TypeError", "defer_reduce_grad_wait must be True or False"),
])
def test_torch_215_arguments_pipecore_does_not_take_are_refused_on_every_rank(options, error, text):
    import re

    for rank, got in enumerate(pool(2).run(refused_215_option, "Interleaved1F1B", options, timeout=120)):
        assert got is not None and got[0] == error and re.search(text, got[1]), (rank, got)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV",
                                      "LoopedBFS"])
def test_torch_215_activation_liveness_of_a_pipecore_schedule(schedule):
    """torch 2.15's analyze_pipeline_activation_liveness, given a pipecore.compat schedule, reads
    pipecore's order: each activation lives from its F to its B (or W) in that order, and the slots it
    needs are pipecore's own count of activations alive at once (one more where an OVERLAP_F_B pair
    starts one as it ends another: torch counts a pair's position for both)."""
    _needs_torch_215()
    from pipecore.schedule.simulate import peak_activations

    out = pool(2).run(activation_liveness, schedule, timeout=180)[0]
    built = pc.build_schedule({"Interleaved1F1B": "interleaved_1f1b", "ZBVZeroBubble": "zbv",
                               "InterleavedZeroBubble": "interleaved_zb", "DualPipeV": "dualpipev",
                               "LoopedBFS": "looped_bfs"}[schedule], 2, 4, 2)
    peaks = peak_activations(built.codes)
    for rank, (slots, lifetimes) in out.items():
        row = [str(a) for a in built.actions[rank]]
        for (stage, mb), (start, release) in lifetimes.items():
            assert f"{stage}F{mb}" in row[start]
            assert f"{stage}B{mb}" in row[release] or f"{stage}W{mb}" in row[release]
        overlaps = any(a.startswith("(") for a in row)
        assert slots == peaks[rank] or (overlaps and slots == peaks[rank] + 1), (rank, slots, peaks[rank])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_torch_215_forward_context_wraps_every_forward_of_the_stage(checkpointing):
    """register_forward_context (torch 2.15): the factory gets each forward's stage and microbatch, in
    step() and eval(), the module runs inside its context (the backward's recomputation too, under
    activation checkpointing), one context at a time, and remove() ends it."""
    for rank, out in enumerate(pool(2).run(forward_contexts, checkpointing, timeout=120)):
        again = 2 if checkpointing else 1  # the recomputation enters the context again
        wanted = sorted((s, mb, False) for s in (rank, rank + 2) for mb in range(4) for _ in range(again))
        assert out["step"] == wanted, out
        assert out["eval"] == sorted((s, mb, False) for s in (rank, rank + 2) for mb in range(4)), out
        assert out["removed"] == [] and "already registered" in out["second"]
        assert out["inside"] == [True] * (8 * again + 8) + [False] * 8 * again, out["inside"]


@pytest.mark.parametrize("wrapped_ranks", [(0, 1), (1,)])
def test_finalize_gradients_false_on_fsdp2_stages_is_refused_on_every_rank_and_loses_nothing(wrapped_ranks):
    """torch 2.15 would defer the FSDP2 stages' reduce-scatter: pipecore refuses it, on every rank
    (one rank's FSDP2 stage is enough), before anything runs, and the next step() works."""
    for rank, (raised, has_grads) in enumerate(pool(2).run(finalize_gradients_on_fsdp2, wrapped_ranks,
                                                            timeout=180)):
        assert raised is not None, f"rank {rank} ran step(finalize_gradients=False) over an FSDP2 stage"
        assert raised[0] == "InputError" and "finalize_gradients=False" in raised[1], (rank, raised)
        assert "pipecore reduces FSDP2 stages at every step's REDUCE_GRAD" in raised[1]
        assert has_grads


@pytest.mark.exactness
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", SHARED)
def test_a_torch_loop_runs_on_pipecore_by_changing_its_imports(schedule, world):
    m = 8  # >= the stage count at 4 ranks (DualPipeV's and ZBV's condition)
    results = pool(world).run(torch_and_pipecore, schedule, m, 3, 16, 0, True, schedule not in TORCH_EVAL_HANGS,
                              timeout=300)
    reference = results[0]["reference"]
    for rank, out in enumerate(results):
        torch_run, ours = out["torch"], out["pipecore"]
        assert ours["schedule_type"] == f"pipecore.compat.schedules.Schedule{schedule}", ours["schedule_type"]
        assert torch_run["schedule_type"].startswith("torch.distributed.pipelining"), torch_run["schedule_type"]
        assert sorted(ours["grads"][0]) == sorted(torch_run["grads"][0])
        _compare_runs(ours, torch_run, f"rank {rank}: pipecore against torch")
        # the same bits: the same per-microbatch computations, summed in the same order
        assert ours["losses"] == torch_run["losses"]
        assert all(torch.equal(g[n], w[n]) for g, w in zip(ours["grads"], torch_run["grads"]) for n in w)
        assert all(torch.equal(p, torch_run["params"][n]) for n, p in ours["params"].items())
        # and against one process training the whole model (names are the model's): every step's losses
        # and gradients; the weights after 3 AdamW steps of lr 1e-2 within AdamW's amplification of
        # rounding (the keys' bias: exactness.after_adamw)
        _compare_runs(_by_model_name(ours), _by_model_name_reference(reference, ours), f"rank {rank}: pipecore "
                      "against one process", weights_bound=after_adamw(lr=1e-2, steps=3))
        if ours["eval_losses"] is not None:
            assert_matches(ours["eval_losses"], reference["eval_losses"], f"rank {rank}: eval losses against one process")
            assert_matches(ours["eval_output"], reference["eval_output"], f"rank {rank}: eval output against one process")
            if schedule not in TORCH_EVAL_HANGS:
                assert ours["eval_losses"] == torch_run["eval_losses"]
                assert torch.equal(ours["eval_output"], torch_run["eval_output"])
    assert sum(out["pipecore"]["eval_losses"] is not None for out in results) >= 1


def _by_model_name_reference(reference: dict, ours: dict) -> dict:
    """The reference restricted to this rank's parameters, losses only where this rank has them."""
    names = {k.split(".", 1)[1] for k in ours["params"]}
    return {"losses": reference["losses"] if ours["losses"][0] is not None else ours["losses"],
            "grads": [{n: g[n] for n in names} for g in reference["grads"]],
            "params": {n: reference["params"][n] for n in names}}


def test_a_microbatch_count_not_a_power_of_two_matches_within_rounding():
    # pipecore weighs each microbatch's loss gradient by 1/3 where torch divides the summed .grad by 3:
    # not the same bits, the same gradients within rounding (and the same losses, computed before either)
    results = pool(2).run(torch_and_pipecore, "GPipe", 3, 2, 15, 0, True, True, timeout=300)
    for rank, out in enumerate(results):
        assert out["pipecore"]["losses"][0] == out["torch"]["losses"][0]
        _compare_runs(out["pipecore"], out["torch"], f"rank {rank}", steps=1)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_torchtitan_loss_rescaling_with_scale_grads_off(schedule):
    # TorchTitan passes loss_fn / n_microbatches and scale_grads=False
    results = pool(2).run(torch_and_pipecore, schedule, 4, 2, 8, 1, False, schedule not in TORCH_EVAL_HANGS,
                          timeout=300)
    for rank, out in enumerate(results):
        _compare_runs(out["pipecore"], out["torch"], f"rank {rank}")


def test_a_custom_csv_schedule_runs_as_torchtitan_loads_it(tmp_path):
    # TorchTitan's pipeline_parallel_schedule_csv: _PipelineScheduleRuntime(...)._load_csv(path)
    path = tmp_path / "custom.csv"
    pc.build_schedule("interleaved_1f1b", 2, 4, 2).to_csv(path)
    results = pool(2).run(torch_and_pipecore, "Interleaved1F1B", 4, 2, 8, 0, True, True, str(path), timeout=300)
    for rank, out in enumerate(results):
        assert out["pipecore"]["schedule_type"] == "pipecore.compat.schedules._PipelineScheduleRuntime"
        _compare_runs(out["pipecore"], out["torch"], f"rank {rank}")


@pytest.mark.parametrize("schedule, m", [("ZBVZeroBubble", 4), ("InterleavedZeroBubble", 4), ("1F1B", 4),
                                         ("DualPipeV", 4)])
def test_dw_builder_computes_the_weight_gradients_at_w(schedule, m):
    torch_out = pool(2).run(dw_builder_run, "torch", schedule, m, timeout=300)
    ours = pool(2).run(dw_builder_run, "pipecore", schedule, m, timeout=300)
    want = dw_reference(2, schedule, m)
    for rank in range(2):
        for step in range(2):
            # against one process only: torch's own weight gradients are wrong at the first step of a
            # dw_builder schedule built after another one in the same process (torch 2.13)
            for name, g in ours[rank]["grads"][step].items():
                assert_matches(g, want[name], f"rank {rank} step {step} {name} vs one process")
            assert_matches(ours[rank]["losses"][step], torch_out[rank]["losses"][step], f"rank {rank} step {step} loss")
        for stage, log in ours[rank]["log"].items():
            builds = [n for kind, n in log if kind == "build"]
            runs = [n for kind, n in log if kind == "run"]
            assert len(builds) == len(runs) == m and all(n == 1 for n in builds + runs), (stage, log)
            # made after the microbatch's backward (I or B), run at its W (B: at once): the same order as torch's
            assert log == torch_out[rank]["log"][stage], (stage, log, torch_out[rank]["log"][stage])


def test_dw_builder_under_concurrent_pairs():
    ours = pool(2).run(dw_builder_run, "pipecore", "DualPipeV", 4, {"overlap_f_b": "concurrent"}, timeout=300)
    want = dw_reference(2, "DualPipeV", 4)
    for rank in range(2):
        assert ours[rank]["overlapped_pairs"] > 0
        for step in range(2):
            for name, g in ours[rank]["grads"][step].items():
                assert_matches(g, want[name], f"rank {rank} step {step} {name}")


def test_dw_builder_with_data_parallel_replicas():
    # the runner's gradients are reduced over the replicas at REDUCE_GRAD (the hooks' buckets would go early)
    for result in pool(4).run(dw_builder_data_parallel, timeout=300):
        assert result <= FLOAT64_BOUND, result


def test_torch_stage_objects_are_converted_not_refused():
    for result in pool(2).run(torch_stage_objects):
        assert result["Pipeline"] <= FLOAT64_BOUND and result["schedule"] <= FLOAT64_BOUND, result


def test_torchs_tracing_front_end_feeds_pipecores_schedules():
    theirs = pool(2).run(traced_pipeline, "torch")
    ours = pool(2).run(traced_pipeline, "pipecore")
    assert ours[1][0] == theirs[1][0] and len(ours[1][0]) == 4
    for rank in range(2):
        assert ours[rank][1].keys() == theirs[rank][1].keys()
        assert all(torch.equal(g, theirs[rank][1][n]) for n, g in ours[rank][1].items())


def test_chunk_specs_mean_what_they_mean_in_torch():
    theirs = pool(2).run(chunk_specs, "torch")
    ours = pool(2).run(chunk_specs, "pipecore")
    assert_matches(ours[1]["out"], theirs[1]["out"], "rank 1 output")
    assert ours[1]["out"].shape == (3, 8, 8)
    for rank in range(2):
        for name, g in ours[rank]["grads"].items():
            assert_matches(g, theirs[rank]["grads"][name], f"rank {rank} {name}")


def test_get_schedule_class_matches_torch():
    from torch.distributed.pipelining import schedules as ts

    from pipecore.compat import schedules as ours

    for name in SHARED + ["PipelineScheduleSingle", "PipelineScheduleMulti"]:
        for spelling in (name, name.lower(), name.upper()):
            cls = ours.get_schedule_class(spelling)
            torch_cls = ts.get_schedule_class(spelling)
            assert cls.__name__ == torch_cls.__name__
            assert issubclass(cls, ours.PipelineScheduleMulti) == issubclass(torch_cls, ts.PipelineScheduleMulti)
            assert issubclass(cls, ours.PipelineScheduleSingle) == issubclass(torch_cls, ts.PipelineScheduleSingle)
    assert ours.get_schedule_class("dualpipe") is ours.ScheduleDualPipe
    assert issubclass(ours.ScheduleDualPipe, ours.PipelineScheduleMulti)
    with pytest.raises(ValueError, match="Unknown schedule name 'zb2p'. The valid options are"):
        ours.get_schedule_class("zb2p")
    # the same names at the top level
    assert pc.get_schedule_class is ours.get_schedule_class and pc.ScheduleZBVZeroBubble is ours.ScheduleZBVZeroBubble
    import pipecore.compat as compat

    assert compat.PipelineStage is pc.PipelineStage


@pytest.mark.parametrize("case", ["no_grad", "no_schedule", "list_to_single", "bad_dw_builder", "runner_not_callable",
                                  "csv_microbatches", "comms_as_compute_only", "dw_builder_with_ddp", "custom_function",
                                  "no_loss_fn", "losses_replaced", "torch_csv", "runner_raises", "builder_cycle_freed", "kwargs_on_later_rank",
                                  "dualpipe_roles", "options", "keyword_step", "submod_and_get_mesh",
                                  "dtensor_boundary"])
def test_misuse_and_options_say_what_to_do(case, tmp_path):
    results = pool(2).run(misuse, case, str(tmp_path), timeout=120)
    for rank, (kind, msg) in enumerate(results):
        if case == "no_grad":
            assert kind == "InputError" and "torch.no_grad()" in msg and "call eval()" in msg, msg
        elif case == "no_schedule":
            assert kind == "RuntimeError" and "_load_csv(path)" in msg, msg
        elif case == "list_to_single":
            assert kind == "TypeError" and "takes one stage" in msg and "ScheduleInterleaved1F1B" in msg, msg
        elif case == "bad_dw_builder":
            assert kind == "TypeError" and "dw_builder must be a callable" in msg, msg
        elif case == "runner_not_callable":
            # the rank whose builder misbehaves says why; the other learns it from that rank
            assert kind in ("TypeError", "PeerFailedError"), (kind, msg)
            assert "must return a callable" in msg, msg
        elif case == "csv_microbatches":
            assert kind == "ScheduleError" and "custom.csv" in msg and "microbatch" in msg, msg
        elif case == "comms_as_compute_only":
            assert kind == "ScheduleError" and 'format="compute_comms"' in msg, msg
        elif case == "dw_builder_with_ddp":
            assert kind == "ValueError" and "dw_builder and a DDP/FSDP2-wrapped module" in msg, msg
        elif case == "custom_function":
            assert kind == "NotImplementedError" and "overlap_f_b=" in msg and "overlap_handoff()" in msg, msg
        elif case == "kwargs_on_later_rank":
            assert kind == "InputError", (kind, msg)
            assert ("keyword arguments ['scale'] would reach no stage" in msg and "keyword_inputs='every_stage'" in msg
                    if rank == 1 else "rank 1 failed in input checks" in msg), msg
        elif case == "runner_raises":
            assert kind == "ok" and "runner failed on purpose" in msg, msg
        elif case == "dtensor_boundary":
            assert kind in ("InputError", "PeerFailedError"), (kind, msg)
            assert "receives a DTensor on a mesh of dimensions" in msg and "get_mesh=" in msg, msg
        elif case in ("no_loss_fn", "losses_replaced", "torch_csv", "builder_cycle_freed", "dualpipe_roles",
                      "options", "keyword_step", "submod_and_get_mesh"):
            assert kind == "ok", msg


PATCHED = """
import sys, torch, pipecore.compat
from torch.distributed.pipelining.schedules import ScheduleGPipe as torchs_own  # imported before: kept
pipecore.compat.patch_torch_pipelining()
pipecore.compat.patch_torch_pipelining()  # idempotent
import torch.distributed.pipelining as pp
import torch.distributed.pipelining.schedules as schedules
from torch.distributed.pipelining import PipelineStage, pipeline, build_stage
from torch.distributed.pipelining.schedules import (_PipelineSchedule, _PipelineScheduleRuntime, get_schedule_class,
    PipelineScheduleMulti, PipelineScheduleSingle, ScheduleDualPipeV, ScheduleZBVZeroBubble, _Action)
from torch.distributed.pipelining.stage import PipelineStage as stage_class, _normalize_model_output_as_tuple
from torch.distributed.pipelining.microbatch import TensorChunkSpec, split_args_kwargs_into_chunks
assert pp is pipecore.compat and torch.distributed.pipelining is pp and schedules is pipecore.compat.schedules
assert PipelineStage is stage_class is pipecore.compat.PipelineStage
assert ScheduleZBVZeroBubble is pipecore.compat.ScheduleZBVZeroBubble and get_schedule_class is pipecore.compat.get_schedule_class
assert torchs_own.__module__ == "torch.distributed.pipelining.schedules"
assert _Action.__module__ == build_stage.__module__.rsplit(".", 1)[0] + ".schedules"  # torch's own helpers
import torch.distributed.pipelining._schedule_visualizer  # a torch submodule not loaded before the patch
import warnings
assert hasattr(sys.modules["torch.distributed.pipelining.schedules"], "__getattr__")
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    try:  # torch 2.13 has it, pipecore does not: refused, not served by torch's runtime
        from torch.distributed.pipelining.schedules import _ScheduleForwardOnly
        raise SystemExit("a schedule pipecore does not run was served by torch")
    except ImportError:
        pass
assert any("torch schedule pipecore does not run" in str(w.message) for w in said), [str(w.message) for w in said]
try:
    schedules._ScheduleForwardOnly
    raise SystemExit("served by attribute")
except AttributeError as exc:
    assert "_ScheduleForwardOnly: it is a torch schedule pipecore does not run" in str(exc), exc
print("patched")
"""


def test_patch_torch_pipelining_makes_torchs_module_names_pipecores():
    """The one line for code the user does not edit (TorchTitan): torch.distributed.pipelining and its
    .schedules, .stage and .microbatch are pipecore.compat's in this process; names pipecore does not run
    are torch's own, a schedule class it does not have is refused (in a process of its own: the alias lasts)."""
    done = subprocess.run([sys.executable, "-c", PATCHED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "patched", done.stdout + done.stderr


@pytest.mark.parametrize("options", [dict(max_active_stages=1), dict(max_active_stages=2, unshard_lookahead="auto")])
def test_torch_215_fsdp2_residency_arguments_give_torchs_gradients(options):
    """torch 2.15's max_active_stages and unshard_lookahead on FSDP2 stages (dp=2 x pp=2, two stages per
    rank): each stage resharded and fetched again as torch's window says, the gradients torch's."""
    _needs_torch_215()
    for rank, worst in enumerate(pool(4).run(fsdp2_stages, "Interleaved1F1B", 2, 4, options, timeout=180)):
        assert worst <= FLOAT64_BOUND, f"rank {rank}: gradients differ from torch's by {worst:.2e}"


@pytest.mark.parametrize("schedule_name", ["1F1B", "Interleaved1F1B"])
def test_a_loop_with_fsdp2_stages_switches_by_import(schedule_name):
    """A loop written for torch.distributed.pipelining with FSDP2 stage modules (4 ranks, dp=2 x pp=2)
    runs on pipecore.compat by changing its imports, with torch's gradients."""
    for rank, worst in enumerate(pool(4).run(fsdp2_stages, schedule_name, timeout=180)):
        assert worst <= FLOAT64_BOUND, f"rank {rank}: gradients differ from torch's by {worst:.2e}"


def test_a_forward_context_that_swallows_the_modules_error_is_refused():
    """A context manager that suppresses the stage module's exception would make the forward return
    None, a silent hole in the step: refused, as torch 2.15 refuses it."""
    import contextlib

    from pipecore.compat import PipelineStage

    class Fails(torch.nn.Module):
        def forward(self, x):
            raise ValueError("the module's own error")

    stage = PipelineStage(Fails(), 0, 2)
    handle = stage.register_forward_context(lambda info: contextlib.suppress(ValueError))
    with pytest.raises(RuntimeError, match="forward context suppressed an exception"):
        stage.forward((torch.zeros(1),), {}, 0)
    handle.remove()
    with pytest.raises(ValueError, match="the module's own error"):
        stage.forward((torch.zeros(1),), {}, 0)
