"""Every schedule trains exactly like one process: loss of every microbatch and every gradient."""

import pytest
import torch

import pipecore as pc
from pipecore.stage import pipeline_stage
from dist_pool import pool
from exactness import FLOAT64_BOUND
from pipeline_cases import (changing_batch_shapes, step_under_graph_capture, loss_divisor_over_scale_grads, output_only_loss, eval_matches, given_shapes, pipelines_on_subgroups, profiler_events,
                            sent_outputs_freed, split_backward_defers_weight_grads, train_and_compare,
                            view_outputs_are_copied)

CONFIGS = []
for name in pc.SCHEDULES:
    if name == "forward_only":
        continue
    for world, m in [(2, 4), (2, 6), (4, 8)]:
        for V in ((1, 2) if name == "zb_auto" else (None,)):
            try:
                V = pc.build_schedule(name, world, m, V).num_stages // world
            except ValueError:
                continue
            CONFIGS.append((name, world, m, V))


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["mlp", "transformer", "multi"])
@pytest.mark.parametrize("name, world, m, V", CONFIGS)
def test_matches_single_process(name, world, m, V, kind):
    rows = 3 * m + 1  # uneven: the last microbatch is smaller
    pool(world).run(train_and_compare, name, m, V, kind, rows)


@pytest.mark.parametrize("past_sends", [True, False], ids=["gloo", "in_order"])
@pytest.mark.parametrize("window, max_bytes", [(0, 1 << 30), (3, 1 << 30), (1000, 1 << 30), (1000, 1)],
                         ids=["0", "3", "1000", "1000_within_1_byte"])
@pytest.mark.parametrize("name, world, V", [("gpipe", 2, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 2, 2),
                                            ("zbv", 2, 2), ("dualpipe", 2, 2)])
def test_receives_posted_ahead(name, world, V, window, max_bytes, past_sends):
    # exact training at every receive window, each receive posted exactly when the window allows
    pool(world).run(train_and_compare, name, 2 * world, V, "multi", 4 * world + 1, 2, True, True, False,
                    (window, past_sends, max_bytes))


@pytest.mark.parametrize("name, world, V", [("gpipe", 4, 1), ("1f1b", 2, 1), ("interleaved_1f1b", 2, 2),
                                            ("interleaved_zb", 2, 2), ("zbv", 2, 2), ("dualpipe", 2, 2)])
@pytest.mark.parametrize("messages", ["large", "direct", "device"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_message_paths(name, world, V, messages, dtype):
    # every message as large ones go (tensors from their own storage, then a trailer), every send
    # and receive posted by the compute thread (as on NCCL), or the device path's protocol run by the
    # host (csrc/testing/host_device_comm.cpp): 2 steps with an optimizer; in fp32 too, as users send it (4-byte
    # elements in the messages' packing, sizes and alignment)
    pool(world).run(train_and_compare, name, 2 * world, V, "multi", 4 * world + 1, 2, True, True, False, None,
                    messages, None, dtype)


@pytest.mark.parametrize("name", ["1f1b", "interleaved_zb", "zbv", "dualpipev", "dualpipe"])
def test_two_steps_with_optimizer(name):
    V = 1 if name == "1f1b" else 2
    pool(2).run(train_and_compare, name, 4, V, "transformer", 16, 2, True, True)


@pytest.mark.parametrize("name", ["gpipe", "interleaved_zb", "dualpipe"])
def test_gradients_accumulate_across_steps(name):
    V = 1 if name == "gpipe" else 2
    pool(2).run(train_and_compare, name, 4, V, "mlp", 12, 2, True, False, True)


def test_sum_reduction_without_scaling():
    pool(2).run(train_and_compare, "1f1b", 4, 1, "mlp", 10, 1, False)


@pytest.mark.parametrize("scale_grads", [True, False])
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_loss_divisor_decides_the_weight_whatever_scale_grads_says(name, scale_grads):
    assert all(pool(2).run(loss_divisor_over_scale_grads, name, scale_grads))


@pytest.mark.parametrize("V", [1, 3])
def test_interleaved_stage_counts(V):
    pool(2).run(train_and_compare, "interleaved_1f1b", 4, V, "transformer", 9)


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b"])
def test_two_pipelines_on_subgroups(name):
    pool(4).run(pipelines_on_subgroups, name)


def test_split_backward_defers_weight_gradients():
    pool(1).run(split_backward_defers_weight_grads)


@pytest.mark.parametrize("name, world", [("gpipe", 2), ("1f1b", 2), ("interleaved_1f1b", 2), ("zbv", 2),
                                         ("1f1b", 4)])
@pytest.mark.parametrize("messages", ["default", "large", "direct", "device"])
def test_sent_outputs_are_freed(name, world, messages):
    pool(world).run(sent_outputs_freed, name, messages)


def test_profiler_sees_every_action():
    names = pool(2).run(profiler_events)
    assert "PP:0F0" in names[0] and "PP:1B1" in names[1]


@pytest.mark.parametrize("name, world", [("forward_only", 2), ("1f1b", 2), ("zbv", 2), ("dualpipe", 2),
                                         ("interleaved_1f1b", 4)])
def test_eval_matches_reference(name, world):
    pool(world).run(eval_matches, name)


def test_view_outputs_train_correctly():
    pool(2).run(view_outputs_are_copied)


@pytest.mark.parametrize("name", ["1f1b", "interleaved_zb", "dualpipe", "zbv"])
@pytest.mark.parametrize("messages", ["default", "large", "device"])
def test_batch_shape_changes_between_steps(name, messages):
    plans = pool(2).run(changing_batch_shapes, name, messages)
    # gloo: messages carry their shapes, one plan for training and one for eval; the device path:
    # one per shape, training at 12, 9, 16 rows and eval at 9
    assert plans[0] == (4 if messages == "device" else 2), plans


@pytest.mark.parametrize("kind", ["transformer", "multi"])
@pytest.mark.parametrize("name, world", [("gpipe", 2), ("1f1b", 4), ("interleaved_1f1b", 2), ("zbv", 2)])
def test_given_shapes_train_like_the_reference(name, world, kind):
    m = 2 * world
    for rows in (3 * m, 3 * m - 1):  # even; an uneven last microbatch (not shaped like input_args)
        for rank, (outcome, error) in enumerate(pool(world).run(given_shapes, name, kind, rows, False)):
            assert outcome == "ok", (rank, error)


@pytest.mark.parametrize("wrong, shape", [("rows", "(99, 16)"), ("width", "(3, 99)")])
def test_wrong_given_shapes_say_so(wrong, shape):
    # stage 0's first forward returns other shapes than its output_args declare
    results = pool(2).run(given_shapes, "1f1b", "mlp", 12, wrong)
    assert results[0][0] == "InputError" and "given as this stage's output_args" in results[0][1], results
    assert shape in results[0][1] and "(3, 16)" in results[0][1], results
    assert results[1][0] == "PeerFailedError" and "rank 0 failed" in results[1][1], results


def test_given_shapes_need_both_and_tensors():
    from torch import nn

    with pytest.raises(ValueError, match="give both input_args"):
        pc.PipelineStage(nn.Linear(2, 2), 0, 2, input_args=torch.empty(1, 2))
    with pytest.raises(TypeError, match="output_args must be a tensor or hold tensors"):
        pc.PipelineStage(nn.Linear(2, 2), 0, 2, input_args=torch.empty(1, 2), output_args=(3,))


@pytest.mark.parametrize("tie", [False, True], ids=["plain", "tied"])
@pytest.mark.parametrize("name, world", [("1f1b", 2), ("1f1b", 4), ("zbv", 2), ("dualpipev", 2), ("dualpipe", 2)])
def test_unused_parameters_keep_no_gradient(name, world, tie):
    """An MoE expert no token reached: one process leaves its .grad None (also a tied weight's)."""
    from pipeline_cases import unused_parameters_keep_no_gradient

    pool(world).run(unused_parameters_keep_no_gradient, name, 2 * world, tie)


@pytest.mark.parametrize("name, world, V", [("1f1b", 2, 1), ("interleaved_1f1b", 2, 2), ("zbv", 2, 2),
                                            ("dualpipe", 2, 2)])
def test_loss_without_target_weights_uneven_microbatches_by_rows(name, world, V):
    m = 2 * world
    pool(world).run(output_only_loss, name, m, V, 3 * m + 1)


@pytest.mark.parametrize("part", [False, True])
def test_a_weight_shared_by_three_ranks(part):
    """pc.partition finds a weight that layers on three ranks share: its gradient is the sum of the
    three (all-reduced), as in one process; copies an optimizer moves apart fail the step after
    the one that finds it, on every rank."""
    from pipeline_cases import shared_by_three_ranks
    results = pool(4).run(shared_by_three_ranks, part, timeout=120)
    for rank, (worst, outcomes, tied) in enumerate(results):
        assert tied == ([] if rank == 1 else ["0.weight"]), (rank, tied)
        if not part:
            assert worst <= FLOAT64_BOUND and outcomes == ["ok", "ok"], (rank, worst, outcomes)
        else:
            assert outcomes[:2] == ["ok", "ok"], (rank, outcomes)
            assert "tied weight '0.weight': the copies on 3 ranks differ" in outcomes[2], (rank, outcomes)


@pytest.mark.parametrize("name, tie", [("1f1b", False), ("zbv", True)])
def test_a_pipeline_is_freed_with_its_last_reference(name, tie):
    from pipeline_cases import freed_with_its_last_reference

    assert pool(2).run(freed_with_its_last_reference, name, tie) == [True, True]


@pytest.mark.skipif(pipeline_stage._TORCHS_STAGE_INFO is not None,
                    reason="from torch 2.15 pipecore takes torch's PipelineStageInfo, which imports its pipelining")
def test_a_step_imports_neither_torchs_pipelining_nor_dynamo():
    """Every rank's start: importing torch.distributed.pipelining (which imports torch._dynamo) cost 1.7 s
    of each process's start, for a class torch before 2.15 does not have."""
    import subprocess
    import sys

    from dist_pool import free_port

    code = (f"import sys, torch, torch.distributed as dist, pipecore as pc; from torch import nn;"
            f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1);"
            "stages = [pc.PipelineStage(nn.Linear(4, 4), s, 2) for s in range(2)];"
            "pipe = pc.Pipeline(stages, 'interleaved_1f1b', 2, loss_fn=nn.MSELoss());"
            "pipe.step(torch.randn(4, 4), target=torch.randn(4, 4));"
            "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.pipelining') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_a_step_under_cuda_graph_capture_is_refused_on_every_rank():
    """issue 61: a step posts NCCL groups and reads on the host what arrived, which a CUDA graph cannot
    hold (it was neither supported nor refused): every rank's step is refused, saying what to capture
    instead, and the next step is exact."""
    for rank, (error, worst) in enumerate(pool(2).run(step_under_graph_capture)):
        assert error is not None and error[0] == "InputError", (rank, error)
        assert "rank 1: step() was called while a CUDA graph is being captured" in error[1], (rank, error)
        assert "capture inside the stages' modules" in error[1], (rank, error)
        assert worst <= FLOAT64_BOUND, (rank, worst)
