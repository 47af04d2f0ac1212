"""A small GPT (decoder-only transformer) written as a layer list, and byte-level text to train it on.

    model = build_gpt(GPTConfig(width=128, layers=6))      # nn.Sequential: embed, block0..5, head
    logits = model(ids)                                     # single process: the reference
    stages = pipeline_stages(model, schedule, rank)         # this rank's pc.PipelineStage's

The LM head is tied to the token embedding. In one process they are one Parameter; `pc.partition`
finds that the stage holding the embedding and the one holding the head share it and declares the
tie, so that pipecore keeps their copies equal (pipecore/training/ties.py).

The text is Python's own standard library source (it ships with every Python), read as bytes: a
vocabulary of 256 tokens and no tokenizer to install.
"""

from __future__ import annotations

import copy
import glob
import os
import sysconfig
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import pipecore as pc


@dataclass
class GPTConfig:
    vocab: int = 256  # bytes
    seq_len: int = 64
    width: int = 128
    heads: int = 4
    layers: int = 6
    dropout: float = 0.0


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq_len, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.tok(ids) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"width {cfg.width} must be a multiple of heads {cfg.heads}")
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.width)
        self.lm = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, x):
        return self.lm(self.ln(x))


def build_gpt(cfg: GPTConfig, seed: int = 0) -> nn.Sequential:
    """The whole model, tied head included (GPT-2's initialisation: N(0, 0.02))."""
    torch.manual_seed(seed)
    layers = OrderedDict([("embed", Embedding(cfg))])
    for i in range(cfg.layers):
        layers[f"block{i}"] = Block(cfg)
    layers["head"] = Head(cfg)
    model = nn.Sequential(layers)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    model.head.lm.weight = model.embed.tok.weight
    return model


def pipeline_stages(model: nn.Sequential, schedule: pc.Schedule, rank: int, *, method: str = "parameters",
                    device: torch.device | str | None = None, verbose: bool = False,
                    **stage_options) -> list[pc.PipelineStage]:
    """This rank's stages of `model` under `schedule`: the model is split into the schedule's model
    stages (`pc.partition`, which finds that the embedding's stage and the head's share the
    embedding), and each stage of this rank gets its own copy (dualpipe's mirrored stages hold
    copies of one model stage); the copies' tie is declared as partition found it."""
    topo = schedule.topology
    parts = pc.partition(model, len(set(topo.model_stage)), method=method, verbose=verbose)
    return [pc.PipelineStage(copy.deepcopy(parts[topo.model_stage[s]]).to(device or "cpu"), s, schedule.num_stages,
                             device, **stage_options)
            for s in schedule.rank_stages(rank)]


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| relative to want's largest entry: how the examples compare a pipeline's
    tensors with one process's (the tests' tests/exactness.py measures the same)."""
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def lm_loss(logits, targets):
    """Mean next-token cross entropy, in fp32 at least (bf16 logits are widened, float64 ones kept)."""
    return F.cross_entropy(at_least_fp32(logits.flatten(0, 1)), targets.flatten())


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def stdlib_bytes(max_bytes: int = 4_000_000) -> torch.Tensor:
    """Python's standard library source, as byte tokens (the same files in the same order on every
    machine with this Python version)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def get_batch(data: torch.Tensor, step: int, rows: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of the text at random places, the same on every rank for a given step: (inputs, next bytes)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq_len - 1, (rows,), generator=g)
    windows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
