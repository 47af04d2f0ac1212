"""Gradients across a pipeline's ranks: tied weights and the global gradient norm.

Tied weights (DeepSpeed's `TiedLayerSpec`/`ReduceTiedGrads`, Megatron's embedding group): stages
declare one weight under one key, e.g. the token embedding on the first stage and the LM head on
the last::

    first = pc.PipelineStage(parts[0], 0, n, tied={"embedding": parts[0].embed.tok.weight})
    last = pc.PipelineStage(parts[-1], n - 1, n, tied={"embedding": parts[-1].head.weight})

The Pipeline copies the lowest stage's value to the others at the ranks' first agreement (the
first step or eval, before any forward; building a Pipeline is no collective) and, after every
training step, gives each copy the sum of the copies' gradients of that step, so that the copies
stay equal under any optimizer and `.grad` equals what single-process training of the tied model
gives. Where every stage holding a key is on one rank (the V placements put the first and last
stages on rank 0) the sum is local; two ranks exchange their sums once; more ranks all-reduce.

    total = pc.clip_grad_norm_(pipe, max_norm=1.0)

is `torch.nn.utils.clip_grad_norm_` over the whole model: the norm over every stage on every rank,
a tied weight and a dualpipe stage's mirrored copy counted once, equal on every rank. With data
parallel replicas (`dp_group=`) the replicas' gradients are equal after the step, except FSDP2's
sharded ones, whose shards' norms are summed over the dp group first.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import InputError

if TYPE_CHECKING:
    from .runtime import Pipeline


@dataclass(frozen=True)
class TiedCopy:
    """One stage's copy of a tied weight."""

    key: str
    stage: int  # pipeline stage index
    model_stage: int  # the model stage it belongs to (dualpipe mirrors share one)
    rank: int
    shape: tuple[int, ...]
    dtype: str


class TiedWeights:
    """The tied weights of one Pipeline: which copies exist on which ranks, and the step's sum."""

    def __init__(self, pipe: "Pipeline"):
        self._pipe = pipe
        topo = pipe.schedule.topology
        mine = [TiedCopy(key, s.stage_index, topo.model_stage[s.stage_index], pipe.rank, tuple(p.shape), str(p.dtype))
                for s in pipe.stages for key, p in s.tied.items()]
        self._params: dict[tuple[str, int], nn.Parameter] = {
            (key, s.stage_index): p for s in pipe.stages for key, p in s.tied.items()}
        everyone = _gather_objects(pipe, mine, "learning every rank's tied weights (a Pipeline is built on every rank)")
        copies: dict[str, list[TiedCopy]] = {}
        for c in (c for row in everyone for c in row):
            copies.setdefault(c.key, []).append(c)
        self.copies = {k: sorted(v, key=lambda c: c.stage) for k, v in sorted(copies.items())}
        problem = self._problem()
        if problem is not None:
            raise InputError(f"rank {pipe.rank}: {problem}")
        self._sync_values()

    def __bool__(self) -> bool:
        return bool(self.copies)

    def _problem(self) -> str | None:
        for key, copies in self.copies.items():
            if len({c.model_stage for c in copies}) < 2:
                return (f"tied weight {key!r} is declared on stage {copies[0].stage} only: declare it on every stage "
                        "that shares it (a weight shared within one stage's module needs no tie)")
            if len({(c.shape, c.dtype) for c in copies}) > 1:
                held = ", ".join(f"stage {c.stage} (rank {c.rank}) {list(c.shape)} {c.dtype}" for c in copies)
                return (f"tied weight {key!r} has different shapes or dtypes on the stages that declare it: {held}. "
                        "A tie joins copies of one weight: declare the same parameter shape under one key")
        local = [(key, c.stage) for key, cs in self.copies.items() for c in cs if c.rank == self._pipe.rank]
        seen: dict[int, tuple[str, int]] = {}
        for key, stage in local:
            other = seen.setdefault(id(self._params[(key, stage)]), (key, stage))
            if other != (key, stage):
                return (f"stages {other[1]} and {stage} of rank {self._pipe.rank} declare the same Parameter object "
                        f"as tied {other[0]!r}/{key!r}: stages of one rank sharing one Parameter need no tie")
        return None

    # -- the copies' owner is the lowest stage: every copy starts as its value -------------------
    def _sync_values(self) -> None:
        pipe = self._pipe
        for key, copies in self.copies.items():
            owner = copies[0]
            holders = sorted({c.rank for c in copies})
            here = [self._params[(key, c.stage)] for c in copies if c.rank == pipe.rank]
            if not here and len(holders) <= 2:
                continue  # an all-reduce (more than two holders) needs every rank; an exchange only the two
            with torch.no_grad():
                mine = self._params[(key, owner.stage)].detach() if owner.rank == pipe.rank else None
                value = mine if holders == [owner.rank] else self._reduce(key, holders, mine,
                                                                          "making tied weight copies equal")
                for p in here:
                    if p is not self._params.get((key, owner.stage)):
                        p.copy_(value)

    # -- after a step: each copy's gradient becomes the sum of the step's gradients -------------
    def stash(self) -> dict[tuple[str, int], torch.Tensor | None]:
        """The gradients the tied copies hold before a step (set aside: the sum covers one step)."""
        stash = {}
        for k, p in self._params.items():
            stash[k] = p.grad
            p.grad = None
        return stash

    def restore(self, stash: dict) -> None:
        for k, p in self._params.items():
            p.grad = stash[k]

    def sum_grads(self, stash: dict) -> None:
        """Every copy's .grad := what it held before the step + the sum over model stages of this
        step's gradients (a dualpipe mirror's, already summed with its twin, is counted once). A
        weight no copy got a gradient for keeps what it held (None if none), as in one process."""
        pipe = self._pipe
        for key, copies in self.copies.items():
            holders = sorted({c.rank for c in copies})
            here = [c for c in copies if c.rank == pipe.rank]
            models = {c.model_stage for c in copies}
            if all({c.model_stage for c in copies if c.rank == r} == models for r in holders):
                if not here:  # every holder has a copy of each model stage: no communication
                    continue
                counted = _one_per_model_stage(here)
                total, got = self._sum([self._grad(key, c) for c in counted]), self._got(key, counted)
            elif not here and len(holders) <= 2:
                continue
            else:  # each model stage counted once, on the rank of its primary copy (stage == model stage)
                counted = [c for c in here if c.stage == c.model_stage]
                mine = self._sum([self._grad(key, c) for c in counted]) if counted else self._zeros(key)
                # one more element: 1 where a counted copy here got a gradient (summed: how many ranks did)
                flat = torch.cat([mine.reshape(-1), mine.new_tensor([float(self._got(key, counted))])])
                flat = self._reduce(key, holders, flat, "summing tied weight gradients")
                total, got = flat[:-1].view_as(mine), bool(flat[-1].item())
                if not here:
                    continue
            for c in here:
                prev = stash.get((key, c.stage))
                p = self._params[(key, c.stage)]
                p.grad = prev if not got else total.clone() if prev is None else prev + total

    def _got(self, key: str, copies: list[TiedCopy]) -> bool:
        """Whether any of these copies got a gradient this step."""
        return any(self._params[(key, c.stage)].grad is not None for c in copies)

    def _grad(self, key: str, copy: TiedCopy) -> torch.Tensor:
        p = self._params[(key, copy.stage)]
        return p.grad if p.grad is not None else torch.zeros_like(p)

    @staticmethod
    def _sum(grads: list[torch.Tensor]) -> torch.Tensor:
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        return total

    def _zeros(self, key: str) -> torch.Tensor:
        """Zeros shaped like the tied weight, on this rank's device for it."""
        c = self.copies[key][0]
        here = [p for (k, _), p in self._params.items() if k == key]
        return torch.zeros(c.shape, dtype=getattr(torch, c.dtype.removeprefix("torch.")),
                           device=here[0].device if here else self._pipe._comm_device())

    def _reduce(self, key: str, holders: list[int], mine: torch.Tensor | None, what: str) -> torch.Tensor:
        """The sum of the holders' tensors (zeros from a rank that gives None), equal on every holder:
        an exchange between two holders, an all-reduce over the group otherwise (every rank joins)."""
        pipe = self._pipe
        if mine is None:
            mine = self._zeros(key)
        from .runtime import _native

        if len(holders) == 2:
            peer = holders[1] if pipe.rank == holders[0] else holders[0]
            theirs = pipe._collective(_native().exchange, mine.detach(), peer,
                                      what=f"{what} {key!r} with rank {peer}")
            return mine + theirs  # the same on both ranks: a + b == b + a
        return pipe._collective(_native().all_reduce_tensor, mine.detach(), "sum", what=f"{what} {key!r}")


def _one_per_model_stage(copies: list[TiedCopy]) -> list[TiedCopy]:
    """The first copy of each model stage, in model stage order (the same order on every rank)."""
    chosen: dict[int, TiedCopy] = {}
    for c in copies:
        chosen.setdefault(c.model_stage, c)
    return [chosen[m] for m in sorted(chosen)]


def clip_grad_norm_(pipe: "Pipeline", max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scales the gradients of every stage on every rank of `pipe` so that their global norm is at
    most `max_norm`, as `torch.nn.utils.clip_grad_norm_` does for the whole model in one process;
    returns the global norm before clipping (the same on every rank). A collective: call it on
    every rank of the pipeline's group, after `step()`. Tied weights and dualpipe's mirrored
    stages are counted once; every copy is scaled alike, so copies stay equal."""
    from .runtime import Pipeline, _native

    if not isinstance(pipe, Pipeline) and isinstance(getattr(pipe, "pipeline", None), Pipeline):
        pipe = pipe.pipeline  # a pipecore.compat schedule
    if not isinstance(pipe, Pipeline):
        raise TypeError(f"clip_grad_norm_ takes the pipecore.Pipeline (or pipecore.compat schedule) whose gradients "
                        f"to clip, got {type(pipe).__name__} (for plain parameters use torch.nn.utils.clip_grad_norm_)")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (2.0, 1.0 or inf), got {norm_type}")
    counted, every = _grads_to_norm(pipe)
    device = pipe._comm_device()
    inf = norm_type == float("inf")
    sharded = [_local(g) for g in counted if _is_sharded(g)]
    local = _norm_part([g for g in counted if not _is_sharded(g)], norm_type, device)
    if sharded:  # FSDP2 stages: each replica holds a shard of the gradient; the same on every replica
        part = _norm_part(sharded, norm_type, pipe._comm_device(pipe._dp.group))
        part = pipe._collective(_native().all_reduce_tensor, part.reshape(1), "max" if inf else "sum",
                                what="clip_grad_norm_: summing the sharded gradients' norms over the data-parallel "
                                "group (call it on every rank)", group=pipe._dp.group)[0].to(device)
        local = torch.maximum(local, part) if inf else local + part
    local = local.reshape(1)
    if pipe.world > 1:
        local = pipe._collective(_native().all_reduce_tensor, local, "max" if inf else "sum",
                                 what="clip_grad_norm_: summing the gradient norms of every rank (call it on every rank)")
    dtype = counted[0].dtype if counted else torch.float32
    total = (local[0] if inf else local[0].pow(1.0 / norm_type)).to(dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the pipeline's gradients is non-finite ({total}), "
                           "so it cannot be clipped (error_if_nonfinite=True)")
    clip = (max_norm / (total.double() + 1e-6)).clamp(max=1.0)
    for g in every:
        g = _local(g.detach())
        g.mul_(clip.to(device=g.device, dtype=g.dtype))
    return total.to(_local(every[0]).device) if every else total


def _norm_part(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """max |g| (inf) or the sum of |g|^p over `grads`, as a float64 scalar on `device`."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).to(device) for g in grads]).double()
    return norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()


def _dtensor():
    """torch.distributed.tensor once imported (no gradient can be a DTensor before; importing it
    costs a second)."""
    return sys.modules.get("torch.distributed.tensor")


def _is_sharded(g: torch.Tensor) -> bool:
    """A DTensor gradient sharded over the data-parallel group (FSDP2)."""
    dt = _dtensor()
    return dt is not None and isinstance(g, dt.DTensor) and any(isinstance(p, dt.Shard) for p in g.placements)


def _local(g: torch.Tensor) -> torch.Tensor:
    dt = _dtensor()
    return g.to_local() if dt is not None and isinstance(g, dt.DTensor) else g


def _grads_to_norm(pipe: "Pipeline") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(gradients counted in the norm, every gradient to scale) of this rank's stages."""
    topo = pipe.schedule.topology
    tied = pipe._tied
    counted_copy = {(key, cs[0].stage) for key, cs in tied.copies.items()} if tied else set()
    tied_copy = {id(p): (key, stage) for (key, stage), p in (tied._params.items() if tied else ())}
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
            in_tie = tied_copy.get(id(p))
            if primary and (in_tie is None or in_tie in counted_copy):
                counted.append(p.grad)
    return counted, every


def _gather_objects(pipe: "Pipeline", obj: Any, what: str, group=None) -> list[Any]:
    """Every rank's picklable `obj`, in group rank order (the native int64 all-gather, twice: sizes,
    then the bytes; once when no rank has anything to say). `group`: the pipeline's by default."""
    import torch.distributed as dist

    if (pipe.world if group is None else dist.get_world_size(group)) == 1:
        return [obj]
    from .runtime import _native

    data = pickle.dumps(obj) if obj else b""
    sizes = [row[0] for row in pipe._collective(_native().all_gather, [len(data)], what=what, group=group)]
    if not any(sizes):
        return [obj for _ in sizes]
    words = (max(sizes) + 7) // 8
    padded = data.ljust(words * 8, b"\0")
    mine = [int.from_bytes(padded[i:i + 8], "little", signed=True) for i in range(0, len(padded), 8)]
    rows = pipe._collective(_native().all_gather, mine, what=what, group=group)
    out = []
    for size, row in zip(sizes, rows):
        raw = b"".join(v.to_bytes(8, "little", signed=True) for v in row)[:size]
        out.append(pickle.loads(raw) if size else [])
    return out
