"""Hugging Face causal language models as a layer list that `pc.partition` splits into stages.

    model = transformers.AutoModelForCausalLM.from_config(config)    # Llama, Qwen2/3, Mistral, GPT-2, ...
    parts = pc.partition(model, num_stages)     # embedding | decoder layers | final norm and LM head
    pipe.step(input_ids, attention_mask=mask, position_ids=pos, target=labels,
              loss_divisor=(labels[:, 1:] != -100).sum())      # with loss_fn=pc.hf.causal_lm_loss

`causal_lm_layers(model)` reads the model's own modules (no copies) into three kinds of layer:
`Embedding` (the token embedding; GPT-2's position embedding and dropout too), one `DecoderLayer`
per decoder layer, and `Head` (the final norm and the LM head). Each layer takes
`(hidden_states or input_ids, attention_mask=None, position_ids=None)` and passes the mask and the
position ids on with the hidden states (a dict: a Pipeline boundary hands it over as keyword
arguments), so only the first stage takes the batch's keyword inputs and every stage has what it
needs: each decoder layer computes its rotary embeddings and its attention mask (causal, or sliding
window as the config says for that layer) from the position ids and the 2-D padding mask with the
model's own functions. Position ids default to 0..seq-1, as the model's forward does. A tied LM
head is the embedding's Parameter, so `partition` finds and declares the tie.

What the layers compute is checked against the model's own forward when the model is split (a
batch of 2 rows of 8 tokens, one of them padded, in eval mode): a family that computes something
else (an embedding scale, logit soft-capping) is refused with an error rather than trained wrong.
Models on the meta device cannot be run: only the families listed in `VERIFIED` are accepted there.
Generation caches are not used (training). Tested with transformers 5.24.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipecore.errors import InputError

# model_type of the families the tests train through this module (tests/test_hf.py)
VERIFIED = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
IGNORE_INDEX = -100  # Hugging Face's label for "no loss here" (padding)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross entropy of a causal LM, as Hugging Face computes it (position t
    predicts labels[t + 1], labels equal to -100 ignored, bf16 and fp16 logits widened to fp32),
    except that float64 logits stay float64 (Hugging Face casts them to fp32). A sum: give the step `loss_divisor=(labels[:, 1:] != -100).sum()`
    for the mean over the batch's target tokens."""
    logits = logits[:, :-1].flatten(0, 1)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels[:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def is_causal_lm(model: Any) -> bool:
    """Is `model` a transformers model with an LM head over a decoder stack this module knows?"""
    return _structure(model) is not None


def causal_lm_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of a transformers causal LM, in order: ("embed", Embedding), ("layers.i",
    DecoderLayer) for each decoder layer, ("head", Head). They hold the model's own modules."""
    found = _structure(model)
    if found is None:
        raise TypeError(f"{type(model).__name__} is not a Hugging Face causal LM that pipecore can split: it needs a "
                        "decoder stack (model.model.layers or GPT-2's model.transformer.h) and model.lm_head; pass "
                        "the layer list instead")
    family, base = found
    config = model.config
    _refuse_what_the_layers_drop(model, config)
    rotary = getattr(base, "rotary_emb", None)
    if family == "gpt2":
        embed = Embedding(base.wte, config, positions=base.wpe, dropout=base.drop)
        blocks, norm = base.h, base.ln_f
    else:
        embed = Embedding(base.embed_tokens, config)
        blocks, norm = base.layers, base.norm
    layers = [("embed", embed)]
    shared = PerForward()
    layers += [(f"layers.{i}", DecoderLayer(block, config, i, rotary, shared))
               for i, block in enumerate(blocks[:config.num_hidden_layers])]
    layers.append(("head", Head(norm, model.lm_head)))
    return layers


def _refuse_what_the_layers_drop(model: nn.Module, config) -> None:
    """What a padded 2 x 8 check in eval mode cannot see: attention kinds other than full and
    sliding-window (chunked, linear, ...), a mixture of experts' router loss, dropout on the
    embedding of a family whose Embedding layer here applies none."""
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    why = None
    if kinds:
        why = f"its layers use attention of kinds {sorted(kinds)}, whose masks pipecore's layers do not build"
    elif getattr(config, "output_router_logits", False):
        why = ("its config asks for the router's auxiliary loss (output_router_logits), which pipecore's layers do not "
               "add to the loss; set output_router_logits=False to train without it")
    elif any(float(getattr(config, name, 0.0) or 0.0) > 0 for name in ("embedding_dropout", "emb_pdrop")):
        why = "its config has dropout on the embedding, which pipecore's Embedding layer does not apply"
    if why is not None:
        raise InputError(f"pc.partition cannot split {type(model).__name__} ({getattr(config, 'model_type', '?')!r}): "
                         f"{why}. Pass a layer list instead: modules that compose to the model's forward")


def decoder_layer_counts(num_layers: int, num_stages: int) -> list[int] | None:
    """Layer counts per stage for `partition`'s "uniform" split of an LM: the decoder layers spread
    evenly (earlier stages take one more), the embedding joins the first stage and the head the
    last. None when there are fewer decoder layers than stages."""
    if num_layers < num_stages:
        return None
    size, extra = divmod(num_layers, num_stages)
    counts = [size + (s < extra) for s in range(num_stages)]
    counts[0] += 1
    counts[-1] += 1
    return counts


def check_layers(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> None:
    """Raises InputError unless the layers, run in order, give the model's own logits (a padded
    batch of 2 x 8 tokens, eval mode, no gradient; training modes and RNG states left as they were).
    A model on the meta device is accepted for the VERIFIED families only."""
    param = next(model.parameters(), None)
    family = getattr(model.config, "model_type", "?")
    if param is None or param.device.type == "meta":
        if family not in VERIFIED:
            raise InputError(f"pc.partition cannot check that it splits a {family!r} model correctly while the model is "
                             f"on the meta device (it checks by running it); families checked by its tests: "
                             f"{', '.join(VERIFIED)}. Build the model on a real device to split it")
        return
    device = param.device
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 8), generator=generator).to(device)
    mask = torch.ones(2, 8, dtype=torch.long, device=device)
    mask[1, :3] = 0  # left padding
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            want = model(input_ids=ids, attention_mask=mask).logits
            value: Any = {"input_ids": ids, "attention_mask": mask}
            try:
                for _, layer in layers:
                    value = layer(**value) if isinstance(value, dict) else layer(value)
                failure = None
            except Exception as exc:  # noqa: BLE001 - reported below, with what to do
                failure = f"running them fails: {type(exc).__name__}: {exc}"
    finally:
        for m, training in modes.items():
            m.training = training
    if failure is None:
        ok = isinstance(value, torch.Tensor) and value.shape == want.shape
        diff = float((value - want).abs().nan_to_num(0).max()) if ok else float("inf")
        scale = float(want.abs().nan_to_num(0).max()) or 1.0
        if not ok or diff > 1e-6 * scale:  # the same operations in the same order: equal, up to rounding
            failure = (f"they do not compute what the model computes (logits differ by {diff:.3g}, the largest is "
                       f"{scale:.3g})")
    if failure is not None:
        raise InputError(f"pc.partition split a {type(model).__name__} ({family!r}) into embedding, decoder layers and "
                         f"head, but {failure}: this family does something pipecore's layers do not repeat (families "
                         f"checked by its tests: {', '.join(VERIFIED)}). Pass a layer list instead: modules that "
                         "compose to the model's forward")


class Embedding(nn.Module):
    """The first layer: token embeddings (GPT-2: plus position embeddings, then dropout)."""

    def __init__(self, tokens: nn.Embedding, config, positions: nn.Embedding | None = None,
                 dropout: nn.Module | None = None):
        super().__init__()
        self.embed_tokens = tokens
        self.embed_positions = positions
        self.dropout = dropout

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> dict[str, Any]:
        hidden = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(position_ids)
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        return {"hidden_states": hidden, "attention_mask": attention_mask, "position_ids": position_ids}


class PerForward:
    """What the decoder layers of one forward share: their rotary embeddings and masks, made by the
    first layer that sees these position ids and this padding mask, reused by the next ones (as
    Hugging Face makes them once per forward: one per layer would cost time, and memory where
    attention keeps its mask for the backward). Holds the last one of each kind; a layer reuses it
    only for the very same tensors (identity), so microbatches and threads never mix."""

    def __init__(self):
        self._last: dict[str, tuple[tuple, tuple, Any]] = {}

    def get(self, kind: str, tensors: tuple, facts: tuple, make):
        last = self._last.get(kind)  # (one read: another thread may replace it meanwhile)
        if last is not None and last[1] == facts and len(last[0]) == len(tensors) and all(
                a is b for a, b in zip(last[0], tensors)):
            return last[2]
        value = make()
        self._last[kind] = (tensors, facts, value)
        return value


class DecoderLayer(nn.Module):
    """One decoder layer of the model, with the rotary embeddings and attention mask it needs,
    computed from the position ids and the 2-D padding mask (once per forward: `PerForward`)."""

    def __init__(self, layer: nn.Module, config, index: int, rotary: nn.Module | None, shared: PerForward):
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary  # no parameters: every stage may hold it
        self.config = config
        self._shared = shared
        types = getattr(config, "layer_types", None)
        sliding = types[index] == "sliding_attention" if types else getattr(config, "sliding_window", None) is not None
        from transformers import masking_utils

        self._mask_kind = "sliding" if sliding else "causal"
        self._make_mask = (masking_utils.create_sliding_window_causal_mask if sliding
                           else masking_utils.create_causal_mask)
        self._mask_args = set(inspect.signature(self._make_mask).parameters)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> dict[str, Any]:
        if position_ids is None:
            position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
        facts = (tuple(hidden_states.shape[:2]), hidden_states.dtype, hidden_states.device)
        extra = {}
        if self.rotary_emb is not None:
            extra["position_embeddings"] = self._shared.get(
                "rotary", (position_ids,), facts, lambda: self.rotary_emb(hidden_states, position_ids))
        mask = self._shared.get(self._mask_kind, (attention_mask, position_ids), facts,
                                lambda: self._mask(hidden_states, attention_mask, position_ids))
        out = self.layer(hidden_states, attention_mask=mask, position_ids=position_ids, **extra)
        if isinstance(out, tuple):  # older transformers return (hidden_states, ...)
            out = out[0]
        return {"hidden_states": out, "attention_mask": attention_mask, "position_ids": position_ids}

    def _mask(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor):
        offered = {"config": self.config, "inputs_embeds": hidden, "input_embeds": hidden,
                   "attention_mask": attention_mask, "cache": None, "past_key_values": None,
                   "position_ids": position_ids,
                   "cache_position": torch.arange(hidden.shape[1], device=hidden.device)}
        return self._make_mask(**{k: v for k, v in offered.items() if k in self._mask_args})


class Head(nn.Module):
    """The last layer: the final norm and the LM head; returns the logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_states))


def _structure(model: Any) -> tuple[str, nn.Module] | None:
    """(family, the decoder stack's module) of a transformers causal LM, or None."""
    if not (isinstance(model, nn.Module) and type(model).__module__.startswith("transformers.")):
        return None
    if not isinstance(getattr(model, "lm_head", None), nn.Module) or getattr(model, "config", None) is None:
        return None
    for family, attribute, parts in (("llama-like", "model", ("embed_tokens", "layers", "norm")),
                                     ("gpt2", "transformer", ("wte", "wpe", "drop", "h", "ln_f"))):
        base = getattr(model, attribute, None)
        if base is not None and all(isinstance(getattr(base, n, None), nn.Module) for n in parts):
            return family, base
    return None
