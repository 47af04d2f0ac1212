"""Hugging Face causal LMs through `pc.partition` (pipecore/stage/hf.py): tiny models built from
configs, trained on 2 and 4 gloo ranks against the whole model in one process."""

import re

import pytest

pytest.importorskip("transformers")

from dist_pool import pool  # noqa: E402
from exactness import FLOAT64_BOUND, rounding_bound, transformer_terms  # noqa: E402
from hf_cases import train_hf  # noqa: E402


@pytest.mark.exactness
@pytest.mark.parametrize("family, name, world, left", [
    ("llama", "1f1b", 2, False), ("qwen2", "interleaved_1f1b", 2, True), ("mistral", "zbv", 2, False),
    ("gpt2", "dualpipev", 2, True), ("qwen3", "1f1b", 4, True), ("llama", "interleaved_1f1b", 4, False),
    ("gpt2", "zbv", 4, False), ("llama", "dualpipev", 4, True),
])
def test_a_causal_lm_trains_as_in_one_process(family, name, world, left):
    """3 AdamW steps on padded batches (right or left padding, lengths new every step), the loss
    summed and divided by the batch's target tokens (loss_divisor): every gradient (float64) within
    exactness.FLOAT64_BOUND of one process accumulating the same microbatches, the first step's also of the whole batch at
    once; the LM head tied to the embedding where the config ties them."""
    results = pool(world).run(train_hf, family, name, 3, left, timeout=300)
    for rank, r in enumerate(results):
        assert r["grad"] <= FLOAT64_BOUND and r["whole_batch_grad"] <= FLOAT64_BOUND, (rank, r)
        assert r["loss"] <= FLOAT64_BOUND, (rank, r)
    tied = sorted({k for r in results for k in r["tied"]})
    assert tied == (["embed.embed_tokens.weight"] if family in ("llama", "gpt2") else []), tied


def test_partition_reads_the_model_and_finds_the_tied_head(capsys):
    """Embedding, decoder layers and head, the layers spread evenly; the stages compose to the
    model's own logits; the tied LM head is declared and printed."""
    import torch

    import pipecore as pc
    from hf_cases import tiny_model

    model = tiny_model("llama", layers=5)
    parts = pc.partition(model, 3)
    assert [list(p._modules) for p in parts] == [["embed", "layers_0", "layers_1"], ["layers_2", "layers_3"],
                                                 ["layers_4", "head"]]
    assert parts[0].tied == {"embed.embed_tokens.weight": "embed.embed_tokens.weight"}
    assert parts[2].tied == {"embed.embed_tokens.weight": "head.lm_head.weight"} and parts[1].tied == {}
    assert "tied: embed.embed_tokens.weight [61, 32], one weight in stage 0" in capsys.readouterr().out
    ids = torch.randint(3, 61, (2, 9))
    value = {"input_ids": ids}
    for p in parts:
        value = p(**value) if isinstance(value, dict) else p(value)
    assert torch.equal(value, model(input_ids=ids).logits)
    stage = pc.PipelineStage(parts[2], 2, 3)
    assert stage.tied == {"embed.embed_tokens.weight": model.lm_head.weight}


REFUSED = [  # (config class, its options, words of the refusal)
    ("Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 0.5}, "do not compute what the model computes"),
    ("CohereConfig", {}, "do not compute what the model computes"),  # a logit scale
    ("Gemma3TextConfig", {"head_dim": 8}, "running them fails"),  # rotary embeddings per layer kind
    ("Llama4TextConfig", {"attention_chunk_size": 16}, "attention of kinds ['chunked_attention']"),
    ("MixtralConfig", {"output_router_logits": True}, "router's auxiliary loss"),
    ("Starcoder2Config", {"embedding_dropout": 0.1}, "dropout on the embedding"),
]


@pytest.mark.parametrize("config, options, words", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_family_whose_layers_compute_something_else_is_refused(config, options, words):
    """Logit soft-capping or scaling, per-layer rotary embeddings (caught by running the split against
    the model), chunked attention, a router loss, embedding dropout (read off the config, which a
    short check in eval mode cannot see): refused with pc.InputError, never trained wrong."""
    import transformers as t

    import pipecore as pc

    model = t.AutoModelForCausalLM.from_config(getattr(t, config)(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, **options))
    with pytest.raises(pc.InputError, match=re.escape(words)):
        pc.partition(model, 2, verbose=False)


def test_a_model_on_the_meta_device_is_split_only_for_a_family_the_tests_train():
    import torch
    import transformers as t

    import pipecore as pc
    from hf_cases import tiny_config

    with torch.device("meta"):
        llama = t.AutoModelForCausalLM.from_config(tiny_config("llama", 4))
        olmo = t.AutoModelForCausalLM.from_config(t.Olmo2Config(
            vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            pad_token_id=0))
    assert len(pc.partition(llama, 2, verbose=False)) == 2
    with pytest.raises(ValueError, match="'olmo2' model correctly while the model is on the meta device"):
        pc.partition(olmo, 2, verbose=False)


def test_the_example_trains_a_causal_lm():
    """examples/train_hf.py (torchrun, 2 ranks, zbv): it trains, its first step's gradients equal one
    process's on the whole batch."""
    import os
    import re
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "train_hf.py")
    out = subprocess.run([sys.executable, script, "--ranks", "2", "--schedule", "zbv", "--steps", "5",
                          "--family", "qwen3", "--seq-len", "24"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    found = re.search(r"step 0's gradients within ([0-9.e+-]+)", out.stdout)
    # fp32, as users run the example: its rows of up to 24 tokens, qwen3 of its layers and width (its
    # config: an MLP twice as wide, 4 heads, 256 tokens in the vocabulary): 7,744 terms in its longest
    # sums with the defaults, 9.2e-4
    import torch
    import train_hf

    args = train_hf.parse_args(["--family", "qwen3", "--seq-len", "24"])
    bound = rounding_bound(torch.float32, transformer_terms(
        tokens=args.rows * args.seq_len, width=args.hidden, mlp_width=2 * args.hidden, layers=args.layers,
        head_width=args.hidden // 4, seq_len=args.seq_len, vocab=256))
    assert found and float(found.group(1)) <= bound, out.stdout
    assert "step 5: loss" in out.stdout, out.stdout


def test_the_layers_of_a_stage_share_one_mask_and_one_rotary_embedding():
    """As Hugging Face makes them once per forward: the decoder layers of a stage get the very same
    mask and rotary tensors for one microbatch, and new ones for the next."""
    import torch

    import pipecore as pc
    from hf_cases import padded_batch, tiny_model

    model = tiny_model("qwen2", layers=4)
    part = pc.partition(model, 1, verbose=False)[0]
    seen = []
    for block in model.model.layers:
        block.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append((kwargs["attention_mask"], kwargs["position_embeddings"][0])),
            with_kwargs=True)
    for step in range(2):
        ids, mask, pos, _ = padded_batch(2, 9, step, left=True)
        seen.clear()
        logits = part(input_ids=ids, attention_mask=mask, position_ids=pos)
        assert torch.equal(logits, model(input_ids=ids, attention_mask=mask, position_ids=pos).logits)
        masks, rotaries = {id(m) for m, _ in seen[:4]}, {id(r) for _, r in seen[:4]}
        assert len(seen) == 8 and len(masks) == 1 and len(rotaries) == 1 and seen[0][0] is not None, seen


def test_causal_lm_loss_widens_low_precision_and_keeps_float64():
    import torch

    import pipecore as pc

    labels = torch.tensor([[1, 2, -100, 3]])
    for dtype, want in [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                        (torch.float32, torch.float32), (torch.float64, torch.float64)]:
        logits = torch.randn(1, 4, 5, dtype=torch.float64).to(dtype)
        loss = pc.hf.causal_lm_loss(logits, labels)
        assert loss.dtype == want, (dtype, loss.dtype)
        wide = torch.nn.functional.cross_entropy(logits[0, :-1].double(), labels[0, 1:], reduction="sum")
        assert float(loss) == pytest.approx(float(wide), rel=torch.finfo(want).eps * 10)
