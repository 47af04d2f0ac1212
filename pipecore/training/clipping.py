"""`pc.clip_grad_norm_(pipe, max_norm)`: `torch.nn.utils.clip_grad_norm_` over the whole model: the
norm over every stage on every rank, a tied weight and a dualpipe stage's mirrored copy counted
once, equal on every rank. With data parallel replicas (`dp_group=`) the replicas' gradients are
equal after the step. A DTensor gradient (FSDP2's, tensor parallelism's) counts as this rank's part
of it, summed over the mesh dimensions it is sharded on (FSDP2's data-parallel ranks, the TP ranks)
and not over those it is replicated on; the pipeline's ranks then sum their stages'.
"""

from __future__ import annotations

import torch

from pipecore.stage.dtensor import is_dtensor, local_part


def clip_grad_norm_(pipe, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scales the gradients of every stage on every rank of `pipe` so that their global norm is at
    most `max_norm`, as `torch.nn.utils.clip_grad_norm_` does for the whole model in one process;
    returns the global norm before clipping (the same on every rank). A collective: call it on
    every rank of the pipeline's group, after `step()`. Tied weights and dualpipe's mirrored
    stages are counted once; every copy is scaled alike, so copies stay equal."""
    if not _is_pipeline(pipe) and _is_pipeline(getattr(pipe, "pipeline", None)):
        pipe = pipe.pipeline  # a pipecore.compat schedule
    if not _is_pipeline(pipe):
        raise TypeError(f"clip_grad_norm_ takes the pipecore.Pipeline (or pipecore.compat schedule) whose gradients "
                        f"to clip, got {type(pipe).__name__} (for plain parameters use torch.nn.utils.clip_grad_norm_)")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (2.0, 1.0 or inf), got {norm_type}")
    counted, every = _grads_to_norm(pipe)
    comm = pipe.comm
    inf = norm_type == float("inf")
    local = stages_norm_part(counted, norm_type, comm).reshape(1)
    if pipe.world > 1:
        local = comm.all_reduce_tensor(local, "max" if inf else "sum",
                                       "clip_grad_norm_: summing the gradient norms of every rank (call it on every rank)")
    dtype = counted[0].dtype if counted else torch.float32
    total = (local[0] if inf else local[0].pow(1.0 / norm_type)).to(dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the pipeline's gradients is non-finite ({total}), "
                           "so it cannot be clipped (error_if_nonfinite=True)")
    clip = (max_norm / (total.double() + 1e-6)).clamp(max=1.0)
    for g in every:
        g = local_part(g.detach())
        g.mul_(clip.to(device=g.device, dtype=g.dtype))
    return total.to(local_part(every[0]).device) if every else total


def stages_norm_part(grads: list[torch.Tensor], norm_type: float, comm) -> torch.Tensor:
    """This rank's stages' share of the global norm of `grads` (max |g| for inf, else the sum of |g|^p),
    a float64 scalar on the pipeline's collective device: each DTensor gradient's parts summed over the
    mesh groups it is sharded on. Every rank of such a group holds the same stages, so all enter the
    same all-reduces in the same order."""
    inf = norm_type == float("inf")
    device = comm.device_for()
    local = torch.zeros((), dtype=torch.float64, device=device)
    for groups, parts in _by_sharding(grads).items():
        part = _norm_part(parts, norm_type, device)
        for group in groups:
            part = comm.all_reduce_tensor(part.to(comm.device_for(group)).reshape(1), "max" if inf else "sum",
                                          "clip_grad_norm_: summing the norms of gradients sharded over a device "
                                          "mesh (call it on every rank)", group=group)[0]
        part = part.to(device)
        local = torch.maximum(local, part) if inf else local + part
    return local


def _norm_part(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """max |g| (inf) or the sum of |g|^p over `grads`, as a float64 scalar on `device` (a shard of no
    entries adds nothing: the inf norm of an empty tensor is an error)."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).to(device) for g in grads]).double()
    return norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()


def _by_sharding(grads: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """`grads` as the parts this rank holds, by the process groups of the mesh dimensions each is
    split over (() for a plain or replicated one: this rank holds all of it), in first-seen order.
    Every placement but Replicate splits: Shard, and FSDP2-over-TP's _StridedShard (not a Shard, and
    its is_shard() is False). A Partial gradient (unreduced sums) is reduced into a copy first: the
    norm is of the sum."""
    out: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups: tuple = ()
        if is_dtensor(g):
            mesh, placements = g.device_mesh, g.placements
            if any(p.is_partial() for p in placements):
                from torch.distributed.tensor import Replicate

                g = g.redistribute(mesh, [Replicate() if p.is_partial() else p for p in placements])
            groups = tuple(mesh.get_group(d) for d, p in enumerate(g.placements)
                           if not p.is_replicate() and mesh.size(d) > 1)
        out.setdefault(groups, []).append(local_part(g))
    return out


def _is_pipeline(obj) -> bool:
    """A pipecore.Pipeline (told by what it offers: this layer sits below the runtime)."""
    return all(hasattr(obj, name) for name in ("comm", "gradients", "stages", "schedule"))


def _grads_to_norm(pipe) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(gradients counted in the norm, every gradient to scale) of this rank's stages."""
    topo = pipe.schedule.topology
    tied = pipe.gradients.ties
    counted_copy = {(key, cs[0].stage) for key, cs in tied.copies.items()} if tied else set()
    counted: list[torch.Tensor] = []
    every: list[torch.Tensor] = []
    seen: set[int] = set()
    for s in pipe.stages:
        primary = topo.model_stage[s.stage_index] == s.stage_index
        for p in s.module.parameters():
            if p.grad is None or id(p) in seen:
                continue
            seen.add(id(p))
            every.append(p.grad)
            in_tie = tied.copy_of(p) if tied else None
            if primary and (in_tie is None or in_tie in counted_copy):
                counted.append(p.grad)
    return counted, every
