"""A training loop written against torch.distributed.pipelining's names only, as TorchTitan writes
one: a GPT cut into stage chunks (unused parts deleted), stages placed loop- or V-style, the
schedule class from get_schedule_class, step() with return_outputs=False and loss_kwargs, eval().

The tests run this file as it is (torch) and with its two imports changed to pipecore.compat
(tests/compat_cases.py), and compare the numbers. Nothing below may mention pipecore.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineScheduleRuntime, get_schedule_class

VOCAB, DIM, HEADS, SEQ = 32, 16, 2, 8
V_STYLE = ("ZBVZeroBubble", "DualPipeV")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, h):
        mask = torch.triu(torch.ones(h.shape[1], h.shape[1], dtype=torch.bool, device=h.device), 1)
        x = self.norm1(h)
        h = h + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.norm2(h))


class GPT(nn.Module):
    def __init__(self, n_layers: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, pos_bias=None):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if pos_bias is not None:  # a per-step input every stage takes (as TorchTitan's attention masks)
            h = h + pos_bias
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def make_model(n_layers: int, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(n_layers)


def model_chunk(whole: GPT, stage: int, num_stages: int) -> GPT:
    """TorchTitan's split: a copy of the model with what other stages hold deleted."""
    chunk = copy.deepcopy(whole)
    per = len(whole.layers) // num_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(chunk.layers):
        if name not in keep:
            del chunk.layers[name]
    if stage != 0:
        chunk.tok_embeddings = None
    if stage != num_stages - 1:
        chunk.norm = None
        chunk.output = None
    return chunk


def stage_ids(rank: int, world: int, stages_per_rank: int, v_style: bool) -> list[int]:
    if v_style:
        return [rank, 2 * world - 1 - rank]
    return [rank + s * world for s in range(stages_per_rank)]


def cross_entropy(pred, labels, ignore_index=-100):
    return F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1), ignore_index=ignore_index)


def batches(steps: int, rows: int, seed: int):
    """(tokens, labels, pos_bias) per step, and one more for eval."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps + 1):
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[:, :2] = -1  # ignored through loss_kwargs
        pos_bias = 0.1 * torch.randn(rows, SEQ, DIM, generator=g)
        out.append((tokens[:, :-1].contiguous(), labels, pos_bias))
    return out


class Run:
    """One rank's part of the training: its stages, the schedule and the optimizer."""

    def __init__(self, schedule_name: str, n_microbatches: int, seed: int = 0, scale_grads: bool = True,
                 csv: str | None = None, options: dict | None = None, step_options: dict | None = None,
                 csv_format: str = "compute_only"):
        rank, world = dist.get_rank(), dist.get_world_size()
        looped = issubclass(get_schedule_class(schedule_name), PipelineScheduleMulti)
        # csv: TorchTitan's pipeline_parallel_schedule_csv (stages placed as schedule_name places them)
        schedule_class = _PipelineScheduleRuntime if csv else get_schedule_class(schedule_name)
        stages_per_rank = 2 if looped else 1
        num_stages = world * stages_per_rank
        whole = make_model(2 * num_stages, seed)
        self.ids = stage_ids(rank, world, stages_per_rank, schedule_name in V_STYLE)
        self.chunks = {s: model_chunk(whole, s, num_stages) for s in self.ids}
        stages = [PipelineStage(self.chunks[s], s, num_stages, torch.device("cpu"), group=dist.group.WORLD)
                  for s in self.ids]
        loss_fn = cross_entropy if scale_grads else (lambda pred, labels, **kw: cross_entropy(pred, labels, **kw)
                                                     / n_microbatches)
        self.schedule = schedule_class(stages if looped else stages[0], n_microbatches=n_microbatches,
                                       loss_fn=loss_fn, scale_grads=scale_grads, **(options or {}))
        if csv:
            self.schedule._load_csv(csv, format=csv_format)
        self.step_options = step_options or {}  # e.g. torch 2.15's finalize_gradients
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.opt = torch.optim.AdamW([p for s in self.ids for p in self.chunks[s].parameters()], lr=1e-2)

    def named_parameters(self):
        return [(f"{s}.{n}", p) for s in self.ids for n, p in self.chunks[s].named_parameters()]

    def train_step(self, tokens, labels, pos_bias) -> list | None:
        """One optimizer step; the microbatches' losses on a rank with a last stage. `pos_bias` goes to
        every stage as a keyword argument (TorchTitan's extra_kwargs)."""
        self.opt.zero_grad()
        losses = [] if self.has_last else None
        target = labels if self.has_last else None
        if self.has_first:
            self.schedule.step(tokens, pos_bias=pos_bias, target=target, losses=losses, return_outputs=False,
                               loss_kwargs={"ignore_index": -1}, **self.step_options)
        else:
            self.schedule.step(pos_bias=pos_bias, target=target, losses=losses, return_outputs=False,
                               loss_kwargs={"ignore_index": -1}, **self.step_options)
        self.opt.step()
        return losses

    def evaluate(self, tokens, labels, pos_bias):
        """eval(): (the microbatches' losses, the merged outputs) where this rank has a last stage."""
        losses = [] if self.has_last else None
        out = self.schedule.eval(*((tokens,) if self.has_first else ()), pos_bias=pos_bias,
                                 target=labels if self.has_last else None, losses=losses,
                                 loss_kwargs={"ignore_index": -1})
        return losses, out


def train(schedule_name: str, n_microbatches: int, steps: int = 3, rows: int = 16, seed: int = 0,
          scale_grads: bool = True, evaluate: bool = True, csv: str | None = None, options: dict | None = None,
          step_options: dict | None = None, csv_format: str = "compute_only", dump_csv: str | None = None) -> dict:
    """Trains `steps` optimizer steps; returns this rank's losses, gradients per step (by global
    parameter name "stage.name"), final parameters, and eval()'s losses and outputs. `options` go to
    the schedule class, `step_options` to every step(); `dump_csv`: rank 0 writes the schedule's
    compute_comms CSV there."""
    run = Run(schedule_name, n_microbatches, seed, scale_grads, csv, options, step_options, csv_format)
    if dump_csv is not None and dist.get_rank() == 0:
        run.schedule._dump_csv(dump_csv, format="compute_comms")
    result = {"losses": [], "grads": [],
              "schedule_type": f"{type(run.schedule).__module__}.{type(run.schedule).__name__}",
              "order_with_comms": [str(a) for a in getattr(run.schedule, "pipeline_order_with_comms", {}).get(
                  dist.get_rank(), [])]}
    data = batches(steps, rows, seed + 1)
    for batch in data[:steps]:
        grads = {}

        def keep_grads():  # the gradients of this step, before the optimizer uses them
            grads.update({n: p.grad.clone() for n, p in run.named_parameters() if p.grad is not None})

        hook = run.opt.register_step_pre_hook(lambda *_: keep_grads())
        losses = run.train_step(*batch)
        hook.remove()
        result["losses"].append([float(x.detach()) for x in losses] if losses is not None else None)
        result["grads"].append(grads)
    result["params"] = {n: p.detach().clone() for n, p in run.named_parameters()}
    if evaluate:
        losses, out = run.evaluate(*data[steps])
        result["eval_losses"] = [float(x.detach()) for x in losses] if losses is not None else None
        result["eval_output"] = out.detach().clone() if out is not None else None
    return result
