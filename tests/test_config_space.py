"""The generated configuration space (tests/config_space.py): configurations drawn from a fixed seed, each
trained through pc.Pipeline and compared with one process in float64. `make test` runs SUITE_COUNT of the
seed's first draws, chosen to draw the most pairs of axis values (`config_space.covering`); `make soak`
CONFIG_SPACE_COUNT draws in turn, from another seed. A failing configuration is shrunk and printed as a
one-line reproducer."""

from __future__ import annotations

import functools
import os
import time

import pytest

import config_space as space
from config_space import Config
from exactness import note

SUITE_COUNT = 80
SEED = int(os.environ.get("CONFIG_SPACE_SEED", "58"))
SOAK_COUNT = int(os.environ.get("CONFIG_SPACE_COUNT", "0"))  # make soak: that many draws in turn
SHRINK_RUNS = 40  # configurations tried while shrinking a failure (each runs on a pool)


@functools.cache
def drawn() -> tuple[Config, ...]:
    return tuple(space.configurations(SEED, SOAK_COUNT) if SOAK_COUNT else space.covering(SEED, SUITE_COUNT))


def test_the_draw_covers_every_axis_value_and_most_pairs():
    """Every value of every axis is drawn within the suite's budget (an axis nobody draws is a gap), and 97%
    of the pairs of values that the first 1,000 draws hold (a bug that needs two choices together)."""
    configs = drawn()
    for axis, values in space.AXES.items():
        seen = {getattr(c, axis) for c in configs}
        assert set(values) <= seen, f"axis {axis}: {sorted(map(repr, set(values) - seen))} never drawn in {len(configs)}"
    assert all(space.problem(c) is None for c in configs)
    assert len({c.line() for c in configs}) == len(configs), "a configuration drawn twice"
    if not SOAK_COUNT:
        pairs = set().union(*map(space.value_pairs, configs))
        possible = set().union(*map(space.value_pairs, space.configurations(SEED, 1000)))
        assert len(pairs) >= 0.97 * len(possible), f"{len(pairs)} of {len(possible)} pairs of values drawn"


# Places that collect parameters, gradients or wrapper state from a module tree (wrappers, ties, clipping,
# checkpoints, dualpipe's mirrors, the data-parallel buckets), each in a configuration that reaches it, and
# what the search found, each with what it gave before its fix.
NAMED = {
    # issue 58's report: one fully_shard over [norm, head] is one FSDP state reached by two modules; its
    # set-aside gradients went back once per module (norm and head 0.6-0.9 of the largest entry off)
    "fsdp_over_a_list_accumulates_once": Config(wrapping="fsdp_list", accumulate=(2,), seed=1),
    "fsdp_over_a_list_token_loss_zbv": Config(schedule="zbv", stages_per_rank=2, microbatches=4, wrapping="fsdp_list",
                                              accumulate=(3,), loss="tokens", seed=2),
    # found by the search: tied copies that FSDP2 shards (ties exchanged DTensors: "c10d.send.default does not
    # have a sharding strategy", then a 60 s timeout on the peer)
    "tied_copies_sharded_by_fsdp": Config(tied=True, wrapping="fsdp_blocks", accumulate=(2,), seed=3),
    # ... and two of them on one rank (zbv's first and last stage: "index_select got mixed torch.Tensor and DTensor")
    "tied_sharded_copies_on_one_rank": Config(schedule="zbv", stages_per_rank=2, microbatches=3, dp=2, tied=True,
                                              wrapping="fsdp_list", accumulate=(1, 2), optimizer="adamw", seed=4),
    # found by the search: load_checkpoint of blocks under torch's checkpoint_wrapper (TorchTitan's activation
    # checkpointing): DCP names its optimizer state without the wrapper's prefix ("loaded nothing: TypeError")
    "checkpoint_of_checkpoint_wrapped_blocks": Config(checkpointing="selective", checkpoint=True, accumulate=(1, 2),
                                                      optimizer="adamw", seed=5),
    # found by the search: dualpipe's CSV read back without placement= was taken for a V schedule ("missing 0F4")
    "dualpipe_from_its_csv": Config(schedule="dualpipe", from_csv=True, stages_per_rank=2, microbatches=8, tied=True,
                                    wrapping="fsdp", accumulate=(2,), seed=11),
    # clipping and checkpoints with a parameter two blocks share and a tie
    "clip_and_checkpoint_with_shared_and_tied": Config(schedule="interleaved_1f1b", stages_per_rank=2, microbatches=4,
                                                       blocks_per_stage=2, shared=True, tied=True, clip=True,
                                                       checkpoint=True, accumulate=(2, 1), seed=6),
    # dualpipe's mirrors with a shared parameter and a tie
    "dualpipe_mirrors_with_shared_and_tied": Config(schedule="dualpipev", stages_per_rank=2, microbatches=4,
                                                    blocks_per_stage=2, shared=True, tied=True, accumulate=(2,), seed=7),
    # data-parallel buckets where experts are skipped by some replica's tokens (None on one, a gradient on
    # the other), with a parameter no forward uses
    "replicas_skipping_experts": Config(dp=2, microbatches=1, blocks=("moe",), experts="modules", unused=True,
                                        accumulate=(2,), zero_grad="zeros", seed=8),
    # DDP over two replicas with a shared parameter; FSDP2 per block over two replicas with a tie (uneven
    # shards: 11 rows of the tied embedding over 2 ranks are 6 and 5)
    "ddp_over_replicas_with_shared": Config(dp=2, blocks_per_stage=2, shared=True, wrapping="ddp", accumulate=(2,),
                                            clip=True, seed=9),
    "fsdp_blocks_over_replicas": Config(dp=2, schedule="interleaved_zb", stages_per_rank=2, microbatches=4,
                                        wrapping="fsdp_blocks", reshard="false", accumulate=(2, 1), tied=True, seed=10),
    # found by the soak: after an AdamW step, a norm's bias gradient 3.9e-12 off (over 2^-38): AdamW's
    # amplified rounding in the weights moves the next gradients too (the test's bound, after_adamw)
    "gradients_after_an_adamw_step": Config(microbatches=4, blocks=("attention", "mlp"), blocks_per_stage=2,
                                            tied=True, shared=True, accumulate=(2, 2), optimizer="adamw",
                                            loss="tokens", seed=572),
    # one FSDP state over a list of modules where the other places collect: clipping over replicas, a
    # checkpoint, dualpipe's mirrors; the list holding two blocks that share a Parameter
    "fsdp_list_clipped_over_replicas": Config(dp=2, wrapping="fsdp_list", tied=True, clip=True, accumulate=(2, 1),
                                              seed=12),
    "fsdp_list_checkpoint": Config(wrapping="fsdp_list", checkpointing="full", checkpoint=True, accumulate=(2, 1),
                                   optimizer="adamw", seed=13),
    "fsdp_list_dualpipe_mirrors_shared": Config(schedule="dualpipev", stages_per_rank=2, microbatches=4,
                                                blocks_per_stage=2, shared=True, wrapping="fsdp_list", accumulate=(2,),
                                                seed=14),
    # ties named when the PipelineStage was built, then fully_shard in place (new Parameter objects): the
    # ties follow the module's live parameters (before: the tie summed and compared stale tensors)
    "wrapped_in_place_after_the_stage": Config(tied=True, wrapping="fsdp_list", wrap_order="after_stage",
                                               accumulate=(2, 1), clip=True, seed=15),
}


@pytest.mark.exactness
@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_configurations_match_one_process(name):
    c = NAMED[name]
    assert space.problem(c) is None, space.problem(c)
    why = space.fails(c)
    assert why is None, f"python tests/config_space.py \"{c.line()}\"\n{why}"


def test_a_tie_sharded_on_one_side_only_is_refused_on_every_rank():
    from dist_pool import pool

    for rank, message in enumerate(pool(4).run(space.tie_sharded_on_one_side, timeout=120)):
        assert "sharded differently" in message and "shard every copy alike" in message, \
            (rank, message)


def test_a_line_names_its_configuration():
    for c in space.configurations(SEED, 20):
        assert space.parse(c.line()) == c


@pytest.mark.exactness
def test_generated_configurations_match_one_process():
    """Every gradient after each step(), every loss and every weight after each optimizer step of
    drawn configurations equals one process's (tests/config_space.py lists the axes)."""
    started = time.monotonic()
    results = space.run(list(drawn()))
    failures = [(c, why) for c, why in results if why is not None]
    note(
        f"config space: {len(results)} configurations (seed {SEED}) compared with one process in "
        f"{time.monotonic() - started:.0f} s, {len(failures)} failed")
    if failures:
        c, why = failures[0]
        small, small_why = space.shrink(c, why, budget=SHRINK_RUNS)
        lines = "\n".join(f"  {f.line()}" for f, _ in failures)
        pytest.fail(f"{len(failures)} of {len(results)} configurations differ from one process:\n{lines}\n"
                    f"the first, shrunk: python tests/config_space.py \"{small.line()}\"\n{small_why}")

