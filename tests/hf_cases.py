"""Hugging Face causal LMs (built from tiny configs, never downloaded) split by pc.partition and
trained with pipecore on every rank of a pool, next to the same training of the whole model in one
process: each rank returns how far its stages' gradients and the losses are from it."""

from __future__ import annotations

import copy

import torch

import pipecore as pc
from exactness import difference

VOCAB = 61


def tiny_config(family: str, layers: int):
    """A few-thousand-parameter config of `family`, dropout off (the comparison is exact)."""
    import transformers as t

    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    llama_like = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, **common)
    if family == "llama":
        return t.LlamaConfig(tie_word_embeddings=True, **llama_like)
    if family == "qwen2":
        return t.Qwen2Config(**llama_like)
    if family == "qwen3":
        return t.Qwen3Config(head_dim=8, **llama_like)
    if family == "mistral":  # a window shorter than the sequence: the sliding-window mask matters
        return t.MistralConfig(sliding_window=5, **llama_like)
    if family == "gpt2":
        return t.GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, **common)
    raise ValueError(family)


def tiny_model(family: str, layers: int, seed: int = 0):
    import transformers as t

    torch.manual_seed(seed)
    return t.AutoModelForCausalLM.from_config(tiny_config(family, layers))


def padded_batch(rows: int, seq: int, step: int, left: bool):
    """Token ids, the 2-D padding mask, position ids counting real tokens, and labels (-100 on
    padding); each row has its own length, different at every step."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    lengths = torch.randint(seq // 3, seq + 1, (rows,), generator=g)
    mask = (torch.arange(seq).expand(rows, seq) < lengths[:, None]).long()
    if left:
        mask = mask.flip(1)
    ids = ids.masked_fill(mask == 0, 0)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, positions, labels


def train_hf(rank: int, world: int, family: str, name: str, steps: int = 3, left: bool = False,
             positions: bool = True) -> dict:
    sched = pc.build_schedule(name, world, 2 * world)
    m = sched.num_microbatches
    topo = sched.topology
    model_stages = len(set(topo.model_stage))
    model = tiny_model(family, layers=max(4, model_stages))
    reference = copy.deepcopy(model)
    parts = pc.partition(model, model_stages, verbose=False)
    hf_name = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    stages, names = [], {}
    for s in sched.rank_stages(rank):
        part = parts[topo.model_stage[s]]
        names[s] = {n: hf_name[id(p)] for n, p in part.named_parameters()}
        stages.append(pc.PipelineStage(copy.deepcopy(part), s, sched.num_stages))
    pipe = pc.Pipeline(stages, sched, m, loss_fn=pc.hf.causal_lm_loss, timeout=120)
    params = list({id(p): p for s in stages for p in s.module.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    worst = {"grad": 0.0, "whole_batch_grad": 0.0, "loss": 0.0, "tied": sorted({k for s in stages for k in s.tied})}
    for step in range(steps):
        ids, mask, pos, labels = padded_batch(2 * m, 12, step, left)
        tokens = (labels[:, 1:] != -100).sum()
        kwargs = {"attention_mask": mask, **({"position_ids": pos} if positions else {})}
        if step == 0:  # the whole batch at once, before the runs can part
            whole = copy.deepcopy(reference)
            (pc.hf.causal_lm_loss(whole(input_ids=ids, **kwargs).logits, labels) / tokens).backward()
        # the same microbatches accumulated in one process: AdamW magnifies rounding differences
        # (a near-zero gradient's sign decides a step of lr), so later steps compare with this
        ref_loss = 0.0
        for rows in torch.arange(2 * m).chunk(m):
            loss = pc.hf.causal_lm_loss(reference(input_ids=ids[rows], **{k: v[rows] for k, v in kwargs.items()}).logits,
                                        labels[rows]) / tokens
            loss.backward()
            ref_loss += float(loss.detach())
        losses: list = []
        if pipe.has_first:
            pipe.step(input_ids=ids, **kwargs, target=labels, losses=losses, loss_divisor=tokens)  # as the README
        else:
            pipe.step(target=labels, losses=losses, loss_divisor=tokens)
        if losses:
            got = sum(float(v) for v in losses) / float(tokens)  # each microbatch's sum, as loss_fn gave it
            worst["loss"] = max(worst["loss"], difference(torch.tensor(got), torch.tensor(ref_loss)))
        for s in stages:
            for n, p in s.module.named_parameters():
                for key, ref in (("grad", reference), ("whole_batch_grad", whole if step == 0 else None)):
                    if ref is None:
                        continue
                    want = ref.get_parameter(names[s.stage_index][n]).grad
                    err = difference(p.grad, want)
                    if err > worst.get(key, 0.0):
                        worst[key], worst[f"{key}_where"] = err, f"step {step} stage {s.stage_index} {n}"
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    return worst
