"""Stages wrapped in torch DDP or FSDP2, driven by hand through pipecore.training.wrapped_stages the way the
executor drives them (2 gloo ranks = the data-parallel group; every stage of a schedule on each rank,
each stage in its rank's order of that schedule): every gradient, loss and weight equals one process
training the whole batch, DDP and FSDP2 reduce only in the stage's last backward / REDUCE_GRAD, and
misconfigured wrappers fail with the fix."""

import pytest

import wrapped_stage_cases as cases
from dist_pool import pool
from exactness import FLOAT64_BOUND

ORDERS = ["1f1b", "interleaved_1f1b", "zbv", "dualpipev", "reversed"]  # reversed: last backward is microbatch 0


def check(results, kind, grad=FLOAT64_BOUND, weight=FLOAT64_BOUND, flat_fsdp=True):
    for rank, r in enumerate(results):
        for step, g in enumerate(r["grad_by_step"]):
            assert g <= grad, f"rank {rank} step {step}: gradients differ from one process by {g:.2e} (relative)"
        assert r["worst"]["loss"] <= FLOAT64_BOUND, f"rank {rank}: losses differ by {r['worst']['loss']:.2e}"
        assert r["worst"]["weight"] <= weight, f"rank {rank}: weights differ by {r['worst']['weight']:.2e}"
        assert not r["comm_outside"], f"rank {rank}: a gradient reduction ran before the last backward: {r['comm_outside']}"
        at = r["comm_at"]
        stages = {key[0] for key in at}
        if kind == "ddp":
            # the bucket all-reduces run inside the last backward; REDUCE_GRAD only checks and scales
            assert all(at[f"{s}B_last"] >= 1 and at[f"{s}REDUCE_GRAD"] == 0 for s in stages), at
            assert all(tag == 0.0 for tags in r["tags"] for tag in tags), f"rank {rank}: buffers not broadcast: {r['tags']}"
        else:
            assert all(at[f"{s}REDUCE_GRAD"] >= 1 for s in stages), at
            if flat_fsdp:  # one all-gather per stage and step (at UNSHARD), no reduce-scatter in backward
                assert all(at[f"{s}UNSHARD"] == 1 and at[f"{s}B_last"] == 0 for s in stages), at


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_matches_single_process(kind, order):
    check(pool(2).run(cases.train, kind, order, 4, timeout=120), kind)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_summed_gradients(kind):
    """reduce_grad(average=False): a summed loss divided by the global element count."""
    check(pool(2).run(cases.train, kind, "dualpipev", 4, {"sum": True}, timeout=120), kind)


@pytest.mark.parametrize("kind, options", [
    ("ddp", {"bucket_view": True, "bucket_cap_mb": 0.0005, "steps": 3}),  # several buckets, grads as bucket views
    ("fsdp", {"nested": True, "steps": 3}),  # a group per layer, resharded after each forward
    ("fsdp", {"nested": True, "reshard_after_forward": False}),
])
def test_wrapper_options(kind, options):
    check(pool(2).run(cases.train, kind, "zbv", 4, options, timeout=120), kind, flat_fsdp=False)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_adamw(kind):
    """AdamW (FSDP2: on the sharded parameters): gradients, weights and losses of 3 steps within the
    float64 bound (AdamW's amplification of rounding: tests/exactness.py)."""
    check(pool(2).run(cases.train, kind, "interleaved_1f1b", 4, {"optim": "adamw", "steps": 3}, timeout=120), kind)


@pytest.mark.parametrize("kind, options", [
    ("ddp", {}),
    ("ddp", {"sum": True, "bucket_view": True}),
    ("fsdp", {"sum": True, "nested": True}),
])
def test_gradients_accumulate_across_steps(kind, options):
    """No zero_grad between steps: .grad is the sum of the steps' gradients, as backward() twice."""
    options = {"accumulate": True, "steps": 3, **options}
    check(pool(2).run(cases.train, kind, "1f1b", 4, options, timeout=120), kind, flat_fsdp=not options.get("nested"))


@pytest.mark.parametrize("kind, where", [("ddp", "forward"), ("ddp", "armed"), ("ddp", "reduced"),
                                         ("fsdp", "forward"), ("fsdp", "armed"), ("fsdp", "reduced")])
def test_failed_step_leaves_grads_and_wrapper_as_before(kind, where):
    """Step 1 of 3 fails (in a forward after some backwards, after DDP's reducer was armed, or after
    a stage's REDUCE_GRAD) and end_step(failed=True): .grad is as after step 0 (checked in the case),
    and step 2 adds exactly its own gradients, reducing only at its end (FSDP2's unsharded gradients
    of the failed step are dropped; DDP's reducer is disarmed)."""
    options = {"fail_step": 1, "fail_where": where, "accumulate": True, "steps": 3, "nested": kind == "fsdp"
               and where == "armed"}
    check(pool(2).run(cases.train, kind, "zbv", 4, options, timeout=120), kind, flat_fsdp=not options["nested"])


@pytest.mark.parametrize("what, message", [
    ("no_dp_group", "no dp_group was given"),
    ("ddp_other_group", "process_group=mesh.get_group('dp')"),
    ("fsdp_other_mesh", "fully_shard(module, mesh=mesh['dp'])"),
    ("find_unused", "find_unused_parameters=False"),
    ("static_graph", "static_graph=False"),
    ("nested_ddp", "Wrap the stage module itself"),
    ("nested_fsdp", "Wrap the stage module itself"),
])
def test_misconfigured_wrapper(what, message):
    for rank, text in enumerate(pool(2).run(cases.misconfigured, what, timeout=60)):
        assert message in text, f"rank {rank}: {text!r}"


def test_wrapped_stages_over_different_groups_need_a_dp_group():
    for rank, text in enumerate(pool(4).run(cases.different_dp_groups, timeout=60)):
        pair, other = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]  # its two groups' ranks
        assert f"wrapped stage modules reduce over different groups (ranks {pair} and {other})" in text, (rank, text)
        assert "pass Pipeline(..., dp_group=)" in text, f"rank {rank}: {text!r}"
    for rank, text in enumerate(pool(4).run(cases.hsdp_without_dp_group, timeout=60)):
        assert "fully_shard over a mesh of several dimensions" in text, (rank, text)


def test_plain_module_has_no_adapter():
    assert all(pool(2).run(cases.plain_is_none, timeout=60))


def test_ddp_parameter_without_gradient():
    for r in pool(2).run(cases.ddp_unused_parameter, timeout=60):
        assert "did not finish its gradient reduction" in r["message"], r["message"]
        assert r["grads"]


def test_ddp_armed_after_last_backward_fails_the_step():
    for rank, r in enumerate(pool(2).run(cases.ddp_armed_late, timeout=60)):
        assert "found no gradient accumulated since before_last_backward" in r["message"], f"rank {rank}: {r['message']!r}"
        assert r["early"] == 0, f"rank {rank}: the next step all-reduced before its last backward"
        assert r["grad"] <= FLOAT64_BOUND, f"rank {rank}: the next step's gradients differ by {r['grad']:.2e}"


def test_fsdp_adapter_made_while_unsharded():
    assert all(pool(2).run(cases.fsdp_adapter_made_while_unsharded, timeout=60))


@pytest.mark.exactness
@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zbv", "dualpipev"])
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_through_the_pipeline_matches_single_process(kind, name):
    """4 ranks, dp=2 x pp=2, every stage module wrapped (DDP over the dp group, FSDP2 over the mesh's
    dp dimension), pc.Pipeline(..., dp_group=): every gradient, loss and weight over two SGD steps
    equals one process training the whole model on the whole global batch."""
    for rank, r in enumerate(pool(4).run(cases.pipeline_train, kind, name, 4, timeout=180)):
        for step, (g, loss, w) in enumerate(zip(r["grad"], r["loss"], r["weight"])):
            assert g <= FLOAT64_BOUND, f"rank {rank} step {step}: gradients differ from one process by {g:.2e} (relative)"
            assert loss <= FLOAT64_BOUND, f"rank {rank} step {step}: losses differ by {loss:.2e}"
            assert w <= FLOAT64_BOUND, f"rank {rank} step {step}: weights differ by {w:.2e}"
        # every step but the first (which learns shapes, in program order) met each pair once
        steps = len(r["grad"])
        assert r["overlapped"] == 0 and r["overlap_fallbacks"] == (
            {"stage_events": r["pairs"] * (steps - 1)} if r["pairs"] else {}), r["overlap_fallbacks"]


WRAPPERS = {"ddp": ("ddp", {}), "fsdp": ("fsdp", {}),
            "fsdp_kept_unsharded": ("fsdp", {"reshard_after_forward": False})}


@pytest.mark.exactness
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev", "dualpipe",
                                  "weights_last"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_every_schedule_and_dp_size_matches_single_process(wrapper, name, dp):
    """2 pipeline ranks, dp in {1, 2}, every stage module wrapped (DDP; FSDP2 resharding after each
    forward or not) and no dp_group given, as TorchTitan builds them (it wraps in FSDP2 at dp=1 too):
    under every schedule, the zero-bubble ones (whose W actions run after a stage's last I) and a
    user's CSV schedule with the I/W split included, each gradient, loss and weight of two SGD steps
    equals one process's."""
    kind, options = WRAPPERS[wrapper]
    options = {**options, "dp": dp, "infer_dp_group": True}
    for rank, r in enumerate(pool(2 * dp).run(cases.pipeline_train, kind, name, 4, options, timeout=180)):
        for step, (g, loss, w) in enumerate(zip(r["grad"], r["loss"], r["weight"])):
            assert g <= FLOAT64_BOUND, f"rank {rank} step {step}: gradients differ from one process by {g:.2e} (relative)"
            assert loss <= FLOAT64_BOUND, f"rank {rank} step {step}: losses differ by {loss:.2e}"
            assert w <= FLOAT64_BOUND, f"rank {rank} step {step}: weights differ by {w:.2e}"


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_wrapper_over_one_rank_adds_no_collective_and_keeps_what_worked(kind, tmp_path):
    """dp=1: the wrappers are driven by the step's events, and nothing else changes: no data-parallel
    replicas (no collective of theirs: the pipeline's other rank holds plain stages here), clipping
    over FSDP2's shards, a checkpoint saved and loaded, and a step that fails on rank 0 fails on every
    rank with the error named, leaving .grad as it was, the next step right."""
    options = {"dp": 1, "infer_dp_group": True, "plain_positions": [1], "max_norm": 0.05, "fail_first_step": True,
               "checkpoint_dir": str(tmp_path / "checkpoint")}
    for rank, r in enumerate(pool(2).run(cases.pipeline_train, kind, "zbv", 4, options, timeout=180)):
        assert not r["dp_replicas"], f"rank {rank}: a DataParallel over one rank"
        said = r["first_step"]
        # (torch 2.15 says "addmm: mat1 and mat2 ...")
        assert (said.startswith("RuntimeError: ") and "mat1 and mat2" in said) if rank == 0 else (
            said.startswith("PeerFailedError") and "rank 0" in said and "mat1 and mat2" in said), (rank, said)
        assert max(r["grad"]) <= FLOAT64_BOUND and max(r["weight"]) <= FLOAT64_BOUND, (rank, r)
        assert max(r["norm"]) <= FLOAT64_BOUND, (rank, r["norm"])
        assert r["checkpoint"] == 0.0, (rank, r["checkpoint"])


@pytest.mark.parametrize("kind, name", [("ddp", "1f1b"), ("fsdp", "zbv")])
def test_the_wrappers_group_is_the_data_parallel_group_when_none_is_given(kind, name):
    """As torch's schedules: pc.Pipeline(...) without dp_group takes the group DDP/FSDP2 reduce over."""
    for rank, r in enumerate(pool(4).run(cases.pipeline_train, kind, name, 4, {"infer_dp_group": True},
                                         timeout=180)):
        assert max(r["grad"]) <= FLOAT64_BOUND and max(r["weight"]) <= FLOAT64_BOUND, (rank, r)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_clip_grad_norm_over_pipeline_and_replicas(kind):
    """pc.clip_grad_norm_ after the step: the norm over the whole model (FSDP2's gradient shards
    summed over the dp group), equal to one process's, and the clipped gradients match."""
    for rank, r in enumerate(pool(4).run(cases.pipeline_train, kind, "interleaved_1f1b", 4, {"max_norm": 0.05},
                                         timeout=180)):
        assert max(r["norm"]) <= FLOAT64_BOUND, f"rank {rank}: clipping norms differ from one process by {max(r['norm']):.2e}"
        for step, g in enumerate(r["grad"]):
            assert g <= FLOAT64_BOUND, f"rank {rank} step {step}: clipped gradients differ by {g:.2e}"


def test_ddp_stage_gradients_are_the_exact_sum_over_three_replicas():
    for rank, r in enumerate(pool(3).run(cases.ddp_sums_exactly, timeout=120)):
        assert r["exact"], f"rank {rank}: .grad differs from the replicas' exact sum by up to {r['worst']}"
