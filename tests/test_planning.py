"""The first step of a batch shape follows the model (issue 14), and configuration slips fail at once."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from dist_pool import fresh_pool, pool
from planning_cases import (autocast_bf16, compiled_stage, fsdp2_stages, slipped_configuration, state_and_rng,
                            values_reach_the_next_stage)


@pytest.mark.parametrize("name, world, V, m", [("1f1b", 2, 1, 4), ("gpipe", 4, 1, 4), ("interleaved_1f1b", 2, 2, 4),
                                               ("zbv", 2, 2, 4), ("interleaved_zb", 2, 2, 6)])
def test_non_tensor_values_reach_the_next_stage_every_step(name, world, V, m):
    calls = pool(world).run(values_reach_the_next_stage, name, V, m)
    assert all(c == [3 * m] * V for c in calls), calls  # one forward per microbatch and step, no more


@pytest.mark.parametrize("name, world, V", [("1f1b", 2, 1), ("interleaved_1f1b", 2, 2), ("zbv", 2, 2)])
def test_bf16_autocast_stages_train_like_one_process(name, world, V):
    results = pool(world).run(autocast_bf16, name, V, 4)
    assert any(sent == ["torch.bfloat16"] for sent, _ in results), results  # what crossed the boundaries
    assert [out for _, out in results if out is not None] == ["torch.bfloat16"], results


@pytest.mark.parametrize("name, world", [("1f1b", 2), ("gpipe", 4), ("1f1b", 4)])
def test_first_step_moves_rng_and_module_state_as_one_process(name, world):
    calls = pool(world).run(state_and_rng, name, 4)
    assert calls == [4] * world, calls  # the forward counter: not counted twice


def test_fsdp2_stages_train_like_one_process():
    assert pool(2).run(fsdp2_stages, 4) == [True, True]


def test_compiled_block_is_compiled_on_real_tensors_only(tmp_path):
    seen = pool(2).run(compiled_stage, 4, str(tmp_path), timeout=300)
    assert seen == [["cpu"], ["cpu"]], seen
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def _slip_on_fresh_ranks(slip: str) -> list:
    """slipped_configuration on new processes: a slip must be met by a Pipeline's first step."""
    ranks = fresh_pool(2)
    try:
        return ranks.run(slipped_configuration, slip, timeout=60)
    finally:
        ranks.close()


@pytest.mark.parametrize("slip, needle", [
    ("schedule", "schedule: rank 0 '1f1b', rank 1 'gpipe'"),
    ("microbatches", "microbatches: rank 0 4, rank 1 8"),
    ("stages", "stages: rank 0 4, rank 1 6"),
    ("mode", "the ranks made different calls (rank 0 step(), rank 1 eval())"),
])
def test_ranks_built_differently_fail_at_once_and_say_what_differs(slip, needle):
    results = _slip_on_fresh_ranks(slip)
    advice = "every rank makes the same call" if slip == "mode" else "Build the same Pipeline on every rank"
    # later agreements of a mode mix-up only count the ranks that train
    needles = [needle, "1 of the 2 ranks called step() and the others eval()" if slip == "mode" else needle]
    for outcomes in results:
        for (kind, msg, seconds), want in zip(outcomes, needles):
            assert kind == "InputError", (kind, seconds, msg)
            assert want in msg and advice in msg, msg


def test_a_stage_returning_none_says_so_on_every_rank():
    results = _slip_on_fresh_ranks("none")
    ((kind0, msg0, t0), _), ((kind1, msg1, t1), _) = results
    assert kind0 == "InputError" and "stage 0's output for microbatch 0 is None" in msg0, msg0
    assert "miss a `return`" in msg0, msg0
    assert kind1 == "PeerFailedError" and "rank 0 failed" in msg1 and "is None" in msg1, msg1
    assert max(t0, t1) < 5, (t0, t1)


def test_an_input_computed_with_a_graph_says_what_to_do_on_every_rank():
    results = _slip_on_fresh_ranks("computed_input")
    ((kind0, msg0, t0), _), ((kind1, msg1, t1), _) = results
    assert kind0 == "InputError" and "input tensor 0 was computed with a gradient outside the pipeline" in msg0, msg0
    assert "x.detach().requires_grad_()" in msg0, msg0
    assert kind1 == "InputError" and "rank 0 failed in input checks" in msg1, msg1
    assert max(t0, t1) < 5, (t0, t1)


def test_show_lowered_prints_the_lowered_program(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pipecore", "show", "1f1b", "-r", "2", "-m", "3", "--lowered",
                          "--out", str(tmp_path / "s.png")], capture_output=True, text=True, check=True).stdout
    assert "0SEND_F0" in out and "1RECV_F0" in out and "0RECV_B0" in out, out
    plain = subprocess.run([sys.executable, "-m", "pipecore", "show", "1f1b", "-r", "2", "-m", "3",
                            "--out", str(tmp_path / "t.png")], capture_output=True, text=True, check=True).stdout
    assert "SEND" not in plain and "RECV" not in plain, plain


def test_boundary_values_round_trip_and_limits():
    from torch.utils._pytree import tree_flatten

    from pipecore.errors import InputError
    from pipecore.stage.boundary import Boundary

    out = (torch.ones(2, 3), 7, {"odd": True, "none": None, "scale": 1.5})
    b = Boundary.of(out, "stage 0's output")
    assert b.value_bytes >= 256 and [m.shape for m in b.metas()] == [(2, 3), (b.value_bytes,)]
    later = (torch.zeros(2, 3), 8, {"odd": False, "none": None, "scale": 1.75})
    assert b.mismatch(*tree_flatten(later)) is None
    msg = b.encode(tree_flatten(later)[0], torch.device("cpu"), "stage 0's output")
    got = b.decode(msg)
    assert got[1:] == later[1:] and torch.equal(got[0], later[0])
    # an aborted message (zeros, on a device whose status is read at the end of the step): the first
    # step's values stand in
    assert b.decode([msg[0], torch.zeros_like(msg[1])])[1:] == out[1:]
    assert "structured as" in b.mismatch(*tree_flatten((torch.ones(2, 3), 7)))
    assert "no grad" in b.mismatch(*tree_flatten((torch.ones(2, 3, dtype=torch.float16), 7, later[2])))
    with pytest.raises(InputError, match="at most"):
        b.encode(tree_flatten((torch.ones(2, 3), 7, {"odd": True, "none": None, "scale": "x" * 1000}))[0],
                 torch.device("cpu"), "s")
    with pytest.raises(InputError, match="cannot be pickled"):
        Boundary.of((torch.ones(1), lambda: 0), "stage 0's output")
    # a tensor inside an object pytree does not flatten would lose its gradient: refused, with the fix
    with pytest.raises(InputError, match="tensor inside a SimpleNamespace .*register_dataclass"):
        Boundary.of((types.SimpleNamespace(h=torch.ones(2, requires_grad=True)),), "stage 0's output")
