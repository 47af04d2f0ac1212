"""DTensors inside stages: no collective hidden in pipecore's own bookkeeping (tests/dtensor_cases.py)."""

import pytest

from dist_pool import pool
from dtensor_cases import (clipped_tensor_parallel_gradients, dtensor_activations_cross_stages,
                           dtensor_buffer_rebound_is_put_back, dtensor_microbatches_of_their_own_shapes,
                           dtensor_to_a_stage_without_its_mesh, tensor_parallel_checkpoint_is_refused,
                           dtensor_buffers_in_uneven_stages, sharded_gradient_norms)


@pytest.mark.exactness
@pytest.mark.parametrize("name, stage_blocks", [("1f1b", [3, 1]), ("zbv", [3, 1, 2, 1]),
                                                ("interleaved_1f1b", [1, 3, 2, 2]), ("dualpipev", [2, 1, 1, 3])])
def test_dtensor_buffers_in_uneven_stages_train_as_one_process(name, stage_blocks):
    """Pipeline ranks holding different numbers of DTensor buffers (TorchTitan's rope cache under tensor
    parallelism; here replicated over the world): the step learns which buffers forwards change without
    a collective of DTensor's (it hung on every rank for the whole timeout), and trains as one process."""
    pool(2).run(dtensor_buffers_in_uneven_stages, name, stage_blocks, timeout=120)


def test_a_rebound_dtensor_buffer_is_put_back_as_a_dtensor():
    assert pool(2).run(dtensor_buffer_rebound_is_put_back) == [True, True]


@pytest.mark.exactness
@pytest.mark.parametrize("name, stage_blocks", [("1f1b", [2, 1]), ("zbv", [1, 2, 1, 1])])
def test_clipping_tensor_parallel_gradients_is_one_process_clipping(name, stage_blocks):
    """TP=2 x PP=2 (4 ranks), weights sharded over the TP mesh: the norm pc.clip_grad_norm_ returns and
    the gradients it leaves are one process's."""
    norms = pool(4).run(clipped_tensor_parallel_gradients, name, stage_blocks, timeout=180)
    assert len(set(norms)) == 1, norms


@pytest.mark.exactness
def test_clipping_counts_every_gradient_layout_once():
    """Clipping's share of the norm over TP-sharded, uneven, empty, replicated-and-sharded, FSDP2-over-TP
    (_StridedShard) and Partial DTensor gradients on a dp=2 x tp=2 mesh: the norm of the whole tensors."""
    pool(4).run(sharded_gradient_norms, timeout=180)


@pytest.mark.parametrize("layout", ["replicate", "shard"])
@pytest.mark.parametrize("name, stage_blocks", [("1f1b", [2, 1]), ("interleaved_1f1b", [1, 1, 1, 1]),
                                                ("zbv", [1, 2, 1, 1]), ("dualpipev", [1, 1, 1, 1])])
def test_dtensor_activations_cross_stages_as_one_process(name, stage_blocks, layout):
    """TP=2 x PP=2 on 4 ranks: what a stage returns is a DTensor on its TP mesh (replicated, or sharded
    by rows as sequence parallel splits them); the next stage gets that DTensor on its own TP mesh, the
    gradients come back as DTensors, and every gradient matches one process, the I/W split and V
    schedules included."""
    worst = pool(4).run(dtensor_activations_cross_stages, name, stage_blocks, layout, timeout=240)
    assert len(worst) == 4


@pytest.mark.exactness
@pytest.mark.parametrize("name, stage_blocks, layout, messages", [
    ("1f1b", [2, 1], "shard", "device"), ("zbv", [1, 2, 1, 1], "replicate", "device"),
    ("interleaved_1f1b", [1, 1, 1, 1], "shard", "default")])
def test_tied_tensor_parallel_weights_and_the_device_paths_messages_match_one_process(name, stage_blocks, layout,
                                                                                     messages):
    """The same TP=2 x PP=2 model with a weight sharded over the TP mesh tied between the first and the last
    stage (summed between pipeline ranks, or on one rank under the V placement), its DTensor activations
    travelling as the NCCL path sends them (its CPU model: batches of exact sizes, no shapes in messages)
    or as gloo does: one process's gradients, the tied one's the sum of both uses."""
    worst = pool(4).run(dtensor_activations_cross_stages, name, stage_blocks, layout, messages, True, timeout=240)
    assert len(worst) == 4


def test_a_stage_without_the_senders_mesh_is_refused_naming_global_and_pipeline_ranks():
    """The receiving stage has no mesh of the DTensor's dimensions: it says so with the fix; every rank's
    error names ranks as "rank G (pp rank P)" where the pipeline group is not the world."""
    results = pool(4).run(dtensor_to_a_stage_without_its_mesh, timeout=120)
    for rank, (kind, text) in enumerate(results):
        if rank >= 2:  # pipeline rank 1: the receiver
            assert kind == "InputError" and "has no such mesh" in text and "get_mesh=" in text, text
            assert text.startswith(f"rank {rank} (pp rank 1): stage 1 receives a DTensor"), text
        else:
            assert kind == "PeerFailedError", (kind, text)
            assert text.startswith(f"rank {rank} (pp rank 0): step 0 aborted because rank "), text
            assert "(pp rank 1) failed in PP:1F" in text, text


@pytest.mark.parametrize("name, stage_blocks", [("1f1b", [2, 1]), ("zbv", [1, 1, 1, 1])])
def test_dtensor_activations_in_microbatches_of_their_own_shapes(name, stage_blocks):
    """step_microbatches with sequence-parallel DTensor activations and microbatches whose rows differ, new
    at every step: one process's gradients; a row count the TP mesh cannot split evenly is refused on every
    rank, saying why."""
    assert pool(4).run(dtensor_microbatches_of_their_own_shapes, name, stage_blocks,
                       [[2, 4, 2, 6], [6, 2, 4, 4]], timeout=180) == ["ok"] * 4
    for said in pool(4).run(dtensor_microbatches_of_their_own_shapes, name, stage_blocks,
                            [[2, 4, 2, 6], [2, 3, 4, 4]], timeout=180):
        assert said.startswith("step 1: ") and "sharded unevenly" in said and "rank " in said, said


def test_a_checkpoint_of_tensor_parallel_stages_is_refused_on_every_rank(tmp_path):
    """pc.save_checkpoint writes one pipeline's ranks' state: with TP the other pipeline's ranks hold other
    shards of the same parameters and would write into the same files. Refused on every rank, saying what
    to use; nothing is written."""
    path = str(tmp_path / "checkpoint")
    for rank, (said, written) in enumerate(pool(4).run(tensor_parallel_checkpoint_is_refused, path, timeout=120)):
        assert not written, rank
        for kind, text in said:
            assert kind == "InputError" and "outside this pipeline (tensor parallel)" in text, (rank, kind, text)
            assert "torch.distributed.checkpoint over the whole device mesh" in text, text
