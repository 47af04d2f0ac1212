"""Data parallel x pipeline parallel (issue 16), plain stages: pc.init_mesh(dp, pp) and
Pipeline(..., group=mesh pp group, dp_group=mesh dp group) train every replica on its own slice
of the global batch, and every rank's gradients equal single-process training of the whole model
on the whole batch (float64, within exactness.FLOAT64_BOUND of each tensor's largest entry): losses, outputs, gradients (averaged
over dp as DDP does, or summed with a global loss_divisor), accumulation, global-norm clipping,
weights after SGD-with-momentum steps, a failing replica, misbuilt meshes."""

import pytest

import data_parallel_cases as cases
from dist_pool import pool
from exactness import FLOAT64_BOUND as TOL

SCHEDULES = ["1f1b", "interleaved_1f1b", "zbv", "dualpipev"]


def check(results, tol=TOL):
    for rank, r in enumerate(results):
        assert r["grad"] <= tol, f"rank {rank}: gradients differ from one process by {r['grad']:.2e} ({r['where']})"
        assert r["loss"] <= tol, f"rank {rank}: losses differ from one process by {r['loss']:.2e}"
        assert r["output"] <= tol, f"rank {rank}: outputs differ from one process by {r['output']:.2e}"
        assert r["param"] <= tol, f"rank {rank}: weights after the optimizer differ by {r['param']:.2e}"
        assert r["norm"] <= tol, f"rank {rank}: the clipping norm differs by {r['norm']:.2e}"
    assert any(r["has_last"] for r in results)  # some rank compared losses and outputs
    print({k: max(r[k] for r in results) for k in ("grad", "loss", "output", "param", "norm")})


@pytest.mark.exactness
@pytest.mark.parametrize("name, m", [(name, m) for name in SCHEDULES for m in cases.microbatch_counts(name, 2)])
def test_dp2_pp2_matches_single_process(name, m):
    """Mean loss, gradients averaged over the 2 replicas; two SGD-with-momentum steps."""
    check(pool(4).run(cases.train, name, m, 2, timeout=120))


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zbv"])
def test_small_buckets(name):
    """bucket_bytes=512 (a Pipeline option beyond the contract): many buckets per stage, also under
    zbv's split backward; the same gradients and weights (when buckets launch is not checked)."""
    check(pool(4).run(cases.train, name, 4, 2, {"bucket_bytes": 512}, timeout=120))


@pytest.mark.parametrize("bucket_bytes", [None, 512], ids=["default_buckets", "small_buckets"])
def test_unused_and_frozen_parameters(bucket_bytes):
    """A parameter no forward uses and a frozen one get no gradient (None or zeros), the others
    the single-process ones."""
    check(pool(4).run(cases.train, "zbv", 2, 2, {"odd_params": True, "bucket_bytes": bucket_bytes}, timeout=120))


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_loss_divisor_counts_the_whole_data_parallel_batch(name):
    """loss_fn sums over rows (ignore_index rows, a different count on each replica); loss_divisor
    is the global count (all-reduced over dp by the user): gradients are summed over dp and equal
    single-process sum / count."""
    check(pool(4).run(cases.train, name, 4, 2, {"tokens": True}, timeout=120))


@pytest.mark.parametrize("tokens", [False, True], ids=["mean", "loss_divisor"])
def test_gradients_accumulate_across_steps(tokens):
    """Two steps without zero_grad: the sum of two single-process gradients (the dp reduction
    covers only the step's own contribution, also when it sums over dp)."""
    check(pool(4).run(cases.train, "interleaved_1f1b", 2, 2,
                      {"accumulate": True, "optimizer": False, "tokens": tokens}, timeout=120))


@pytest.mark.parametrize("name", ["1f1b", "dualpipev"])
def test_clip_grad_norm_over_the_whole_model(name):
    """pc.clip_grad_norm_ after the step: the norm over every stage, each replica's copy counted
    once, the same on all 4 ranks and equal to one process's; clipped gradients equal."""
    m = cases.microbatch_counts(name, 2)[0]
    results = pool(4).run(cases.train, name, m, 2, {"max_norm": 0.5}, timeout=120)
    check(results)
    norms = [r["norms"] for r in results]
    assert all(n == norms[0] for n in norms), f"the ranks' norms differ: {norms}"


@pytest.mark.parametrize("name, bad_rank, fail_step", [("1f1b", 0, 0), ("1f1b", 3, 1), ("zbv", 1, 1)],
                         ids=["1f1b_rank0_first_step", "1f1b_rank3_warm", "zbv_rank1_warm"])
def test_a_failing_replica_ends_the_step_on_every_rank(name, bad_rank, fail_step):
    """A forward that raises on one rank of one replica: all 4 ranks raise (the
    failing one its own error, the others PeerFailedError: its pipeline peer naming the error, the
    other replica saying a replica failed); .grad is kept as before; later steps match one process."""
    results = pool(4).run(cases.failing_replica, name, 2, bad_rank, fail_step, timeout=90)
    outcomes = "\n".join(f"rank {rank}: {kind} after {seconds:.2f} s: {message}"
                          for rank, ((kind, message, seconds), _) in enumerate(results))
    print(outcomes)
    for rank, ((kind, message, seconds), worst) in enumerate(results):
        # the clean steps after the failure (and before it) match one process
        assert worst["grad"] <= TOL and worst["loss"] <= TOL and worst["output"] <= TOL, (rank, worst)
        assert kind == ("RuntimeError" if rank == bad_rank else "PeerFailedError"), outcomes
        assert worst["grads_kept"], f"rank {rank}: the failed step changed .grad"
    # the failing pipeline's ranks carry its error (as without dp); the other replica's say why they stopped
    pp = 2
    for rank, ((_, message, _), _) in enumerate(results):
        if rank // pp == bad_rank // pp:
            assert f"boom in forward on rank {bad_rank}" in message, outcomes
        else:
            assert "data-parallel replica" in message, outcomes


def test_misbuilt_meshes_and_dp_groups_are_refused():
    p = pool(4)
    results = p.run(cases.bad_meshes, timeout=60)
    for rank, seen in enumerate(results):
        for what in ("dp*pp != world", "dp*pp != world, again"):
            if what in seen:
                kind, message, _ = seen[what]
                assert kind == "ValueError" and "world size" in message, (rank, what, kind, message)
        for what in ("dp_group = the pp group", "group = WORLD with the mesh's dp_group", "dp_group without this rank"):
            kind, message, seconds = seen[what]
            assert kind != "ok" and "dp_group" in message, (rank, what, kind, message)
        assert seen["the right groups"][0] == "ok", (rank, seen["the right groups"])
    # and the groups still train exactly
    check(p.run(cases.train, "1f1b", 2, 2, {"steps": 1}, timeout=60))


def test_eight_ranks_dp2_pp4():
    check(pool(8).run(cases.train, "interleaved_1f1b", 4, 2, {"width": 8}, timeout=120))


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zbv"])
def test_reduction_starts_inside_the_last_backward(name):
    """The trace of a step: buckets go from the last backward's accumulator hooks (before the stage's
    REDUCE_GRAD), the first of each stage before its last backward ends; with two stages per rank,
    the first-reduced stage's buckets are all out before the other stage's last backward begins."""
    for rank, r in enumerate(pool(4).run(cases.reduction_overlap, name, timeout=120)):
        assert r["buckets"] >= 2 and r["early"] >= 1 and r["in_order"], (rank, r)
        assert all(r["inside"].values()), (rank, r)
        if name != "1f1b":
            assert len(r["stages"]) == 2 and r["under_other"], (rank, r)


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_weight_with_a_deferred_closure_and_an_accumulator(name):
    for rank, worst in enumerate(pool(4).run(cases.deferred_shared_weight, name, timeout=120)):
        assert worst <= TOL, f"rank {rank}: gradients differ from one process by {worst:.2e}"


def test_replicas_with_different_models_are_refused_on_every_rank():
    for rank, (kind, message, seconds) in enumerate(pool(4).run(cases.replicas_differ, timeout=60)):
        assert kind == "InputError" and "replicas differ" in message and "buckets" in message, (rank, kind, message)


def test_checkpoint_round_trip(tmp_path):
    path = str(tmp_path / "ckpt")
    for rank, r in enumerate(pool(4).run(cases.checkpoint_round_trip, path, timeout=120)):
        assert r == {"extra": {"step": 1}, "weights": True, "momentum": True}, (rank, r)


@pytest.mark.parametrize("name, bad_rank", [("1f1b", 2), ("zbv", 0)])
def test_a_failure_in_the_last_backward_fails_every_rank(name, bad_rank):
    """The failing rank's pipeline peers already finished their part: they learn it from the step's
    outcome agreement, the other replica from the buckets' flags; nobody keeps half a step."""
    for rank, r in enumerate(pool(4).run(cases.late_failure, name, bad_rank, timeout=120)):
        kind, message, seconds = r["outcome"]
        assert kind != "ok", (rank, r)
        assert "boom in the last backward" in message, (rank, message)
        assert r["kept"], f"rank {rank}: .grad changed in the failed step"
        assert r["grad"] <= TOL, (rank, r)


def test_scalar_parameters_in_buckets():
    """A 0-dim parameter first in its bucket (bucket_bytes=64: a bucket per parameter or two)."""
    for rank, worst in enumerate(pool(4).run(cases.scalar_parameters, timeout=60)):
        assert max(worst.values()) <= TOL, (rank, worst)


def test_eval_on_one_replica_before_training():
    for rank, worst in enumerate(pool(4).run(cases.eval_on_one_replica_first, timeout=60)):
        assert worst <= TOL, (rank, worst)


def test_a_parameter_unfrozen_after_building_fails_the_step():
    for rank, (kind, message, _) in enumerate(pool(4).run(cases.unfrozen_after_building, timeout=60)):
        assert kind in ("InputError", "PeerFailedError"), (rank, kind, message)
        if kind == "InputError":
            assert "not reduced over the data-parallel replicas" in message, (rank, message)


def test_a_pipeline_with_wrapped_stages_is_freed():
    assert pool(4).run(cases.wrapped_pipeline_is_freed, timeout=60) == [True] * 4


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_tied_embedding_and_head(name):
    for rank, worst in enumerate(pool(4).run(cases.gpt_tied, name, 4, timeout=180)):
        assert worst <= TOL, f"rank {rank}: gradients differ from one process by {worst:.2e}"


@pytest.mark.parametrize("bucket_bytes", [None, 512])
def test_dualpipe_mirrored_stages(bucket_bytes):
    for rank, worst in enumerate(pool(4).run(cases.dualpipe_mirrors, bucket_bytes, timeout=120)):
        assert worst <= TOL, f"rank {rank}: gradients differ from one process by {worst:.2e}"


@pytest.mark.parametrize("rows, changed", [
    ([[9, 9], [9, 9], [6, 6], [9, 9]], "together"),
    ([[9, 9], [9, 9], [6, 9], [9, 9]], "on one replica"),
])
def test_batch_shape_changes_on_the_device_path_keep_the_replicas_paired(rows, changed):
    """dp=2 x pp=3 on the device path's protocol: the ranks after a first stage compute on stand-ins
    before they learn that the batch changed shape, and their reductions go to the other replica. That
    round is flagged and discarded on every rank of the replica that changed, so the replicas stay
    paired: changed together, every step counts; changed on one replica, the other replica's step
    fails once (PeerFailedError), and stepping again pairs it with the run that counts."""
    results = pool(6).run(cases.shape_changes_on_the_device_path, "1f1b", 3, rows, timeout=180)
    for rank, seen in enumerate(results):
        for step, (tries, worst) in enumerate(seen):
            replica_b = rank >= 3
            # on one replica: replica 0's batch changes shape at steps 2 and 3, replica 1's never
            want = ["PeerFailedError", "ok"] if changed == "on one replica" and step in (2, 3) and replica_b else ["ok"]
            assert [kind for kind, _, _ in tries] == want, (rank, step, tries)
            assert worst <= TOL, (rank, step, worst)
            for kind, seconds, message in tries:
                if kind == "PeerFailedError":  # saying why (the Pipelines' timeout is NEVER: it was sent)
                    assert "replica 0 changed shape" in message, (rank, step, tries)
