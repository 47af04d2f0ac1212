"""Train a Hugging Face causal LM with pipecore: `pc.partition` splits the transformers model itself.

    python examples/train_hf.py --family llama --ranks 2 --schedule zbv     # starts torchrun itself
    torchrun --nproc-per-node 4 examples/train_hf.py --family qwen3 --schedule 1f1b

The model is built from a small config of the chosen family (Llama, Qwen2, Qwen3, Mistral, GPT-2;
`--config PATH` takes a config.json instead; nothing is downloaded), on every rank alike. Each rank
keeps its stages of `pc.partition(model, num_stages)`: the embedding on the first, the decoder layers
spread evenly, the final norm and LM head on the last, a tied LM head tied across stages. The data
is Python's own source read as bytes (256 tokens), in rows of random length padded to the longest:
`attention_mask` goes to the first stage as a keyword input, labels are -100 on padding, and the
loss is the sum over target tokens divided by their count (`loss_divisor`), as one process would
average it. The first step's gradients are checked against the whole model in one process.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pipecore as pc  # noqa: E402
from gpt import relative_difference, stdlib_bytes  # noqa: E402
from launch import init_gloo, under_torchrun  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="llama", choices=FAMILIES)
    ap.add_argument("--config", default=None, help="a config.json (or a folder holding one) instead of --family")
    ap.add_argument("--schedule", default="1f1b", choices=[s for s in pc.SCHEDULES if s != "forward_only"])
    ap.add_argument("--ranks", type=int, default=2, help="processes to start when not launched by torchrun")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=64, help="the longest sequence")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    if args.rows % args.microbatches:
        ap.error(f"--rows {args.rows} must be a multiple of --microbatches {args.microbatches}")
    return args


def build_model(args):
    import transformers as t

    if args.config:
        config = t.AutoConfig.from_pretrained(args.config)
    else:
        common = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if args.family == "gpt2":
            config = t.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=4, n_positions=args.seq_len,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        else:
            cls = {"llama": t.LlamaConfig, "qwen2": t.Qwen2Config, "qwen3": t.Qwen3Config,
                   "mistral": t.MistralConfig}[args.family]
            config = cls(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **common)
    torch.manual_seed(0)  # every rank builds the same model
    return t.AutoModelForCausalLM.from_config(config)


def get_batch(text: torch.Tensor, step: int, rows: int, seq_len: int):
    """Rows of random length (a quarter of seq_len and up) from the text, right-padded with 0."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(text) - seq_len, (rows,), generator=g)
    lengths = torch.randint(seq_len // 4, seq_len + 1, (rows,), generator=g)
    ids = torch.stack([text[s:s + seq_len] for s in starts.tolist()]).long()
    mask = (torch.arange(seq_len) < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, pc.hf.IGNORE_INDEX)


def main() -> None:
    args = parse_args()
    under_torchrun(args.ranks)
    rank, world = init_gloo()
    sched = pc.build_schedule(args.schedule, world, args.microbatches)
    topo = sched.topology
    model = build_model(args)
    reference = copy.deepcopy(model)
    parts = pc.partition(model, len(set(topo.model_stage)))  # rank 0 prints the split and the ties
    stages = [pc.PipelineStage(parts[topo.model_stage[s]], s, sched.num_stages) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, args.microbatches, loss_fn=pc.hf.causal_lm_loss)
    params = pipe.parameters()  # each once: zbv puts the embedding and the tied head on rank 0
    opt = torch.optim.AdamW(params, lr=args.lr)
    text = stdlib_bytes(500_000)
    if rank == 0:
        print(f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters, {args.schedule} on "
              f"{world} ranks, {args.microbatches} microbatches of {args.rows // args.microbatches} rows", flush=True)
    for step in range(args.steps):
        start = time.perf_counter()
        ids, mask, labels = get_batch(text, step, args.rows, args.seq_len)
        tokens = (labels[:, 1:] != pc.hf.IGNORE_INDEX).sum()
        losses: list = []
        inputs = (ids,) if pipe.has_first else ()
        pipe.step(*inputs, **({"attention_mask": mask} if pipe.has_first else {}), target=labels, losses=losses,
                  loss_divisor=tokens)
        if step == 0:  # the same step in one process, on the whole batch: every gradient of this rank's stages
            loss = pc.hf.causal_lm_loss(reference(input_ids=ids, attention_mask=mask).logits, labels) / tokens
            loss.backward()
            by_id = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
            worst = max(relative_difference(p.grad, reference.get_parameter(by_id[id(p)]).grad) for p in params)
            worst_all = torch.tensor([worst])
            dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
            if rank == 0:
                print(f"step 0's gradients within {float(worst_all):.2e} of one process", flush=True)
        norm = pc.clip_grad_norm_(pipe, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if pipe.has_last and (step % 5 == 4 or step == args.steps - 1):
            mean = sum(float(v) for v in losses) / float(tokens)
            print(f"step {step + 1}: loss {mean:.4f} (mean over {int(tokens)} target tokens), grad norm {float(norm):.3f},"
                  f" {1e3 * (time.perf_counter() - start):.0f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
