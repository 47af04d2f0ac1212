"""Messages that carry their shapes (csrc/comm.h): on gloo, a step whose microbatches change shapes
learns no new plan and sends no extra message; a message that outgrows its boundary's capacity goes
once more at its own size, after which the capacity has grown (tests/shaped_message_cases.py)."""

import pytest

from dist_pool import pool
from shaped_message_cases import step_lengths

# step 0 learns the plan (shapes exact); 1 stays within what step 0 had; 2 outgrows it (microbatch 0
# and the last); 3 and 4 stay within the grown capacity, 4 with a microbatch of length 0
LENGTHS = [[5, 3, 4, 2], [1, 5, 2, 3], [9, 2, 3, 12], [12, 9, 1, 4], [0, 7, 12, 2]]


def _steps(lengths, world):
    """`lengths` for `world` ranks' microbatches (2 per rank)."""
    m = 2 * world
    return [(row * m)[:m] for row in lengths]


@pytest.mark.parametrize("large", [None, 0])
@pytest.mark.parametrize("name, world", [("1f1b", 2), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2),
                                         ("interleaved_zb", 4)])
def test_new_shapes_need_no_plan_and_no_extra_message(name, world, large):
    """Packed and per-part (`large` 0) layouts: one plan for every step; each steady step sends one
    message per SEND action and nothing more; only the step that outgrows the capacity sends
    messages again; gradients within 1e-6 of one process throughout."""
    results = pool(world).run(step_lengths, name, _steps(LENGTHS, world), large, timeout=180)
    for rank, r in enumerate(results):
        assert not r["failed"], (rank, r)
        assert r["grad"] <= 1e-6, (rank, r)
        assert r["plans"] == [1] * len(LENGTHS), (rank, r)
        for step, (messages, parts, grown) in enumerate(r["counts"]):
            assert messages == r["sends"], (rank, step, r)
            if step != 2:
                assert grown == 0, (rank, step, r)
    assert sum(r["counts"][2][2] for r in results) > 0, results  # step 2 outgrew the first step's shapes


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_a_step_that_fails_while_messages_grow_leaves_the_capacities_agreed(name):
    """Rank 1's forward fails in the step whose messages outgrow their capacity, with random delays
    before every post: every rank fails that step, and the steps after it run, exact, with no
    message sent twice once the capacities grew (both sides of each boundary widened alike)."""
    lengths = _steps(LENGTHS, 2)
    results = pool(2).run(step_lengths, name, lengths, None, (2, 1), 300, timeout=180)
    for rank, r in enumerate(results):
        assert [f.split(":")[0] for f in r["failed"]] == ["2"], (rank, r)
        assert r["grad"] <= 1e-6, (rank, r)
        # step 3 may still outgrow what crossed before the failure stopped step 2; step 4 cannot
        assert r["counts"][4][2] == 0, (rank, r)
        assert all(c[0] == r["sends"] for c in r["counts"][3:]), (rank, r)
