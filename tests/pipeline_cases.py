"""Cases run on every rank of a gloo pool: pipeline training against single-process training."""

from __future__ import annotations

import copy

import torch
from torch import nn

import pipecore as pc
from models import make_batch, make_stages, reference_forward


def _assert_grads_close(got: torch.Tensor | None, want: torch.Tensor | None, what: str, rtol=1e-6):
    if want is None:
        assert got is None or torch.count_nonzero(got) == 0, f"{what}: expected no gradient"
        return
    assert got is not None, f"{what}: gradient missing"
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= rtol * max(scale, 1e-30) + 1e-12, f"{what}: max abs error {err:.3e} against max |grad| {scale:.3e}"


def train_and_compare(rank, world, name, m, V, kind, rows, steps=1, scale_grads=True, optimizer=False,
                      accumulate=False):
    sched = pc.build_schedule(name, world, m, V)
    topo = sched.topology
    n_model = world if topo.style == "dualpipe" else topo.num_stages
    model = make_stages(kind, n_model)
    ref = copy.deepcopy(model)
    mine = [pc.PipelineStage(copy.deepcopy(model[topo.model_stage[s]]), s, sched.num_stages)
            for s in sched.rank_stages(rank)]
    reduction = "mean" if scale_grads else "sum"
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    pipe = pc.Pipeline(mine, sched, m, loss_fn=loss_fn, scale_grads=scale_grads, timeout=60)
    params = [p for s in mine for p in s.module.parameters()]
    ref_params = [p for s in ref for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.05) if optimizer else None
    ref_opt = torch.optim.SGD(ref_params, lr=0.05) if optimizer else None
    worst = 0.0
    for step in range(steps):
        x, y = make_batch(rows, seed=step + 1)
        losses: list = []
        with torch.no_grad():
            ref_chunks = [reference_forward(ref, xc) for xc in torch.tensor_split(x, m)]
            ref_mb_losses = [loss_fn(o, yc) for o, yc in zip(ref_chunks, torch.tensor_split(y, m))]
        out = pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None, losses=losses)
        ref_loss = loss_fn(reference_forward(ref, x), y)
        ref_loss.backward()
        # every parameter of this rank's stages
        for s in mine:
            ref_stage = ref[topo.model_stage[s.stage_index]]
            for (n, p), (_, q) in zip(s.module.named_parameters(), ref_stage.named_parameters()):
                _assert_grads_close(p.grad, q.grad, f"rank {rank} stage {s.stage_index} {n} step {step}")
                if q.grad is not None and q.grad.abs().max() > 0:
                    worst = max(worst, ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item())
        # losses and outputs where computed
        if pipe.has_last:
            assert len(losses) == m
            computed = [mb for mb in range(m) if losses[mb] is not None]
            assert computed, "no loss computed on a last-stage rank"
            for mb in computed:
                torch.testing.assert_close(losses[mb], ref_mb_losses[mb], rtol=1e-6, atol=1e-7)
            want = torch.cat([ref_chunks[mb] for mb in computed])
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
        else:
            assert out is None and losses == []
        if optimizer:
            opt.step()
            ref_opt.step()
        if not accumulate:
            for p in params + ref_params:
                p.grad = None
    return worst
