"""The example GPT (examples/gpt.py) trained with pipecore on every rank of a pool, next to the same
training in one process: each rank returns how far its stages' gradients, norms and losses are from
the single-process run."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import pipecore as pc
from exactness import EXACT_DTYPE, FLOAT64_BOUND, FLOAT64_TERMS, difference, transformer_terms
from models import pipeline_step
from gpt import GPTConfig, at_least_fp32, build_gpt, get_batch, lm_loss, pipeline_stages, stdlib_bytes

_TEXT: torch.Tensor | None = None


def text() -> torch.Tensor:
    global _TEXT
    if _TEXT is None:
        _TEXT = stdlib_bytes(200_000)
    return _TEXT


def small_config(schedule: pc.Schedule, **overrides) -> GPTConfig:
    model_stages = len(set(schedule.topology.model_stage))
    options = dict(seq_len=16, width=32, heads=2, layers=max(2, model_stages))
    options.update(overrides)
    return GPTConfig(**options)


def gradient_terms(cfg: GPTConfig, tokens: int) -> int:
    """The longest sum behind one of the example GPT's gradient entries (exactness.transformer_terms)."""
    return transformer_terms(tokens=tokens, width=cfg.width, mlp_width=4 * cfg.width, layers=cfg.layers,
                             head_width=cfg.width // cfg.heads, seq_len=cfg.seq_len, vocab=cfg.vocab)


def sum_loss(logits, targets):
    """Token-level loss summed over a microbatch's tokens, padding (-100) ignored."""
    return F.cross_entropy(at_least_fp32(logits.flatten(0, 1)), targets.flatten(), ignore_index=-100, reduction="sum")


def padded(y: torch.Tensor, step: int) -> torch.Tensor:
    """Targets with a different number of padded positions per row (as in packed-free batches)."""
    y = y.clone()
    g = torch.Generator().manual_seed(step)
    keep = torch.randint(1, y.shape[1] + 1, (y.shape[0],), generator=g)
    y[torch.arange(y.shape[1]).unsqueeze(0) >= keep.unsqueeze(1)] = -100
    return y


def train_gpt(rank: int, world: int, name: str, m: int, options: dict | None = None) -> dict:
    return _train_gpt(rank, world, name, m, **(options or {}))


def _train_gpt(rank: int, world: int, name: str, m: int, steps: int = 3, max_norm: float = 0.05,
               tokens: bool = False, stages_per_rank: int | None = None, stage_options: dict | None = None,
               norm_type: float = 2.0, accumulate: bool = False, dtype: torch.dtype | None = None,
               by_microbatch: bool = False) -> dict:
    """`steps` AdamW steps with clipping through the pipeline and in one process. Returns the worst
    relative differences seen on this rank: gradients (after clipping) of every parameter of its
    stages, the clipping norm, and its losses. `accumulate`: the optimizer steps every second step,
    so the odd steps add their gradients to what .grad holds. `dtype`: the model's (the default dtype,
    float64 in the tests, when None). `by_microbatch`: one process runs the pipeline's microbatches one
    after another, a backward each (each loss weighted 1/m), so that each kernel sees the shapes it
    sees in the pipeline and the microbatches' gradients add up in .grad, as there."""
    sched = pc.build_schedule(name, world, m, stages_per_rank)
    stage_options = stage_options or {}
    cfg = small_config(sched)
    assert gradient_terms(cfg, 2 * m * cfg.seq_len) <= FLOAT64_TERMS  # within what FLOAT64_BOUND covers
    model = build_gpt(cfg, seed=1).to(dtype or torch.get_default_dtype())
    reference = copy.deepcopy(model)
    stages = pipeline_stages(model, sched, rank, **stage_options)
    loss_fn = sum_loss if tokens else lm_loss
    pipe = pc.Pipeline(stages, sched, m, loss_fn=loss_fn)
    params = list({id(p): p for s in stages for p in s.module.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
    def autocast():
        return torch.autocast("cpu", dtype=stage_options.get("autocast"), enabled="autocast" in stage_options)

    worst = {"grad": 0.0, "norm": 0.0, "loss": 0.0, "tied_equal": True}
    losses_by_step = []
    for step in range(steps):
        x, y = get_batch(text(), step, 2 * m, cfg.seq_len, seed=7)
        if tokens:
            y = padded(y, step)
        # single process: the whole batch, or its microbatches one after another
        for xc, yc in zip(x.tensor_split(m), y.tensor_split(m)) if by_microbatch else [(x, y)]:
            with autocast():
                logits = reference(xc)
                ref_loss = (sum_loss(logits, yc) / (y != -100).sum()) if tokens else lm_loss(logits, yc)
            (ref_loss / m if by_microbatch and not tokens else ref_loss).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type=norm_type)
        # the pipeline
        losses: list = []
        extra = {"loss_divisor": (y != -100).sum()} if tokens else {}
        pipeline_step(pipe, x, y, losses=losses, **extra)
        norm = pc.clip_grad_norm_(pipe, max_norm, norm_type=norm_type)
        worst["norm"] = max(worst["norm"], difference(norm, ref_norm))
        for s in stages:
            for pname, p in s.module.named_parameters():
                want = reference.get_parameter(pname).grad
                err = difference(p.grad, want)
                if err > worst["grad"]:
                    worst["grad"], worst["where"] = err, f"step {step} {pname}"
        losses_by_step.append([None if v is None else float(v) for v in losses])
        for mb, v in enumerate(losses):  # each microbatch's loss, as loss_fn gives it in one process
            if v is not None:
                rows = slice(2 * mb, 2 * mb + 2)
                with torch.no_grad(), autocast():
                    want = loss_fn(reference(x[rows]), y[rows])
                worst["loss"] = max(worst["loss"], difference(v.detach(), want))
        if accumulate and step % 2 == 0:
            continue
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        for s in stages:  # tied copies stay equal: the same as the reference's one parameter, bit for bit apart
            for p in s.tied.values():
                if p.dtype != EXACT_DTYPE:  # fp32 runs compare one step's gradients; AdamW would turn their
                    continue  # last bits into steps of +-lr (the copies' equality is checked across ranks)
                drift = difference(p.detach(), reference.embed.tok.weight.detach())
                worst["tied_drift"] = max(worst.get("tied_drift", 0.0), drift)
                worst["tied_equal"] &= drift <= FLOAT64_BOUND
    worst["losses"] = losses_by_step
    worst["tied_values"] = [p.detach().clone() for s in stages for p in s.tied.values()]
    worst["warnings"] = sorted({why for per in pipe.split_backward_fallbacks.values() for (_, why) in per})
    return worst


def tie_mismatch(rank: int, world: int, what: str) -> str:
    """Builds a Pipeline whose tied declarations are wrong; returns the error every rank raises."""
    sched = pc.build_schedule("zbv" if what in ("two_keys", "undeclared") else "1f1b", world, 2)
    cfg = small_config(sched)
    model = build_gpt(cfg)
    stages = pipeline_stages(model, sched, rank)
    if what == "two_keys" and rank == 0:  # rank 0 holds both ends, not copied: one Parameter under two keys
        parts = pc.partition(model, sched.num_stages, method="parameters", verbose=False)
        weight = parts[0].embed.tok.weight  # the head's too (build_gpt ties them)
        stages = [pc.PipelineStage(parts[s], s, sched.num_stages, tied={"embedding" if s == 0 else "head": weight})
                  for s in sched.rank_stages(rank)]
    if what == "undeclared" and rank == 0:  # the same, declaring nothing (tied={}: not even what partition found)
        parts = pc.partition(model, sched.num_stages, method="parameters", verbose=False)
        stages = [pc.PipelineStage(parts[s], s, sched.num_stages, tied={}) for s in sched.rank_stages(rank)]
    if what == "shape" and rank == world - 1:
        module = stages[0].module
        module.extra = torch.nn.Linear(3, 5, bias=False)
        stages = [pc.PipelineStage(module, stages[0].stage_index, sched.num_stages,
                                   tied={key: module.extra.weight for key in stages[0].tied})]
    if what == "alone" and rank == world - 1:
        stages = [pc.PipelineStage(stages[0].module, stages[0].stage_index, sched.num_stages, tied={})]
    try:
        pipe = pc.Pipeline(stages, sched, 2, loss_fn=lm_loss)  # not a collective: ties are learnt at the first step
    except pc.errors.InputError as exc:  # what this rank alone can see: it tells the others at their first step
        return [str(exc)]
    x, y = get_batch(text(), 0, 4, cfg.seq_len)
    errors = []
    for _ in range(2):  # and every later step says it again
        try:
            pipeline_step(pipe, x, y)
            errors.append("no error")
        except pc.errors.InputError as exc:
            errors.append(str(exc))
    return errors


def tied_copies_parted(rank: int, world: int, name: str) -> list:
    """The last stage's rank leaves its copy of the tied embedding out of its optimizer, so the copies
    part at the first optimizer step. Each step's outcome: the step after the one that finds it
    fails on every rank."""
    sched = pc.build_schedule(name, world, 2 * world)
    cfg = small_config(sched)
    stages = pipeline_stages(build_gpt(cfg), sched, rank)
    pipe = pc.Pipeline(stages, sched, sched.num_microbatches, loss_fn=lm_loss, timeout=60)
    last = {id(p) for s in stages if s.stage_index == sched.num_stages - 1 for p in s.tied.values()}
    params = [p for s in stages for p in s.module.parameters() if id(p) not in last]
    opt = torch.optim.AdamW(params, lr=1e-2)
    outcomes = []
    for step in range(4):
        x, y = get_batch(text(), step, 4 * world, cfg.seq_len)
        try:
            pipeline_step(pipe, x, y)
            outcomes.append("ok")
        except (pc.errors.InputError, pc.PeerFailedError) as exc:
            outcomes.append(str(exc))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outcomes


def tied_start_equal(rank: int, world: int, name: str) -> list:
    """A Pipeline built from copies whose tied weights differ: the lowest stage's value wins."""
    sched = pc.build_schedule(name, world, 4)
    model = build_gpt(small_config(sched))
    stages = pipeline_stages(model, sched, rank)
    for s in stages:
        for p in s.tied.values():
            with torch.no_grad():
                p.add_(torch.randn_like(p) if s.stage_index else 0.0)
    pipe = pc.Pipeline(stages, sched, 4, loss_fn=lm_loss)
    cfg = small_config(sched)
    x, y = get_batch(text(), 0, 8, cfg.seq_len)
    pipe.eval(*((x,) if pipe.has_first else ()))  # the first agreement makes the copies equal, before any forward
    return [(s.stage_index, torch.equal(p, model.embed.tok.weight)) for s in stages for p in s.tied.values()]


def tied_as_one_parameter(rank: int, world: int, name: str, declared: bool) -> dict:
    """The model's head *is* its embedding (one Parameter), split with pc.partition without copying;
    both ends declared tied by hand (`declared`) or as partition found them. Under a V placement
    both ends are on rank 0 and one Parameter there. Two AdamW steps with clipping against one
    process: the worst relative gradient and norm differences, and whether rank 0's ends were one
    Parameter."""
    m = 2 * world
    sched = pc.build_schedule(name, world, m)
    topo = sched.topology
    cfg = small_config(sched)
    model = build_gpt(cfg, seed=1)
    reference = copy.deepcopy(model)
    parts = pc.partition(model, len(set(topo.model_stage)), method="parameters", verbose=False)
    stages = []
    for s in sched.rank_stages(rank):
        module = parts[topo.model_stage[s]]
        embed, head = getattr(module, "embed", None), getattr(module, "head", None)
        tied = {"embedding": embed.tok.weight} if embed is not None else {"embedding": head.lm.weight} if head else {}
        stages.append(pc.PipelineStage(module, s, sched.num_stages, tied=tied if declared else None))
    ends = [p for s in stages for p in s.tied.values()]
    pipe = pc.Pipeline(stages, sched, m, loss_fn=lm_loss, timeout=60)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)  # the one Parameter of both ends once
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    worst = {"grad": 0.0, "norm": 0.0, "one_parameter": len(ends) == 2 and ends[0] is ends[1]}
    for step in range(2):
        x, y = get_batch(text(), step, 2 * m, cfg.seq_len, seed=7)
        lm_loss(reference(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        pipeline_step(pipe, x, y)
        norm = pc.clip_grad_norm_(pipe, 0.05)
        worst["norm"] = max(worst["norm"], difference(norm, ref_norm))
        for s in stages:
            for pname, p in s.module.named_parameters():
                worst["grad"] = max(worst["grad"], difference(p.grad, reference.get_parameter(pname).grad))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    return worst
