"""Tied weights across stages (DeepSpeed's `TiedLayerSpec`/`ReduceTiedGrads`, Megatron's embedding
group): stages declare one weight under one key, e.g. the token embedding on the first stage and
the LM head on the last::

    first = pc.PipelineStage(parts[0], 0, n, tied={"embedding": parts[0].embed.tok.weight})
    last = pc.PipelineStage(parts[-1], n - 1, n, tied={"embedding": parts[-1].head.weight})

The Pipeline copies the lowest stage's value to the others at the ranks' first agreement (the
first step or eval, before any forward; building a Pipeline is no collective) and, after every
training step, gives each copy the sum of the copies' gradients of that step (finalise.py says
when), so that the copies stay equal under any optimizer and `.grad` equals what single-process
training of the tied model gives. Where every stage holding a key is on one rank (the V placements
put the first and last stages on rank 0) the sum is local; two ranks exchange their sums once;
more ranks all-reduce. Copies that are one Parameter on a rank (a model whose head *is* its
embedding, split without copying, under a V placement) are one copy there: autograd already sums
their uses into its `.grad`, so it is counted, set aside and added back once. Copies that FSDP2
shards (every stage holding one wrapped over the same data-parallel mesh) are made equal and summed
shard by shard: a rank holds the same rows of each copy, and the replicas' sums already ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipecore.errors import InputError
from pipecore.executor.comm import Comm
from pipecore.stage.dtensor import local_part, rows_held
from pipecore.stage.partitioning import shared_parameters


SAMPLE = 64  # entries of a tied weight compared between its copies after each step


@dataclass(frozen=True)
class TiedCopy:
    """One stage's copy of a tied weight."""

    key: str
    stage: int  # pipeline stage index
    model_stage: int  # the model stage it belongs to (dualpipe mirrors share one)
    rank: int
    shape: tuple[int, ...]
    dtype: str
    local_shape: tuple[int, ...]  # what this rank holds of it (an FSDP2 shard, or the whole weight)
    rows: tuple  # which entries that is (dtensor.rows_held)


class TiedWeights:
    """The tied weights of one Pipeline: which copies exist on which ranks, and the step's sum."""

    def __init__(self, comm: Comm, stages: list, topology):
        """Learns every rank's ties (a collective over the pipeline's group); `make_copies_equal` then
        makes the copies equal, once the communicators its exchanges go on are connected."""
        self._comm = comm
        mine = [TiedCopy(key, s.stage_index, topology.model_stage[s.stage_index], comm.rank, tuple(p.shape),
                         str(p.dtype), tuple(local_part(p).shape), rows_held(p))
                for s in stages for key, p in s.tied.items()]
        self._params: dict[tuple[str, int], nn.Parameter] = {
            (key, s.stage_index): p for s in stages for key, p in s.tied.items()}
        self._by_id: dict[int, tuple[str, int]] = {}  # a Parameter under several stages: its lowest one
        for k, p in sorted(self._params.items(), key=lambda kv: kv[0][1]):
            self._by_id.setdefault(id(p), k)
        everyone = comm.gather_objects(mine, "learning every rank's tied weights (a Pipeline is built on every rank)")
        copies: dict[str, list[TiedCopy]] = {}
        for c in (c for row in everyone for c in row):
            copies.setdefault(c.key, []).append(c)
        self.copies = {k: sorted(v, key=lambda c: c.stage) for k, v in sorted(copies.items())}
        problem = self._problem()
        if problem is not None:
            raise InputError(f"{comm.who}: {problem}")
        # why the copies of a tie differ (found at a step's gradient sum): every later step fails with it,
        # until the Pipeline is built again (its first agreement makes the copies equal)
        self.parted: str | None = None
        self._unequal = True  # until make_copies_equal

    def exchange_peers(self) -> set[int]:
        """The ranks this rank exchanges a tie's values or gradients with (`_reduce`: a tie of two holders)."""
        rank = self._comm.rank
        holders = [sorted({c.rank for c in copies}) for copies in self.copies.values()]
        return {h[1] if rank == h[0] else h[0] for h in holders if len(h) == 2 and rank in h}

    def make_copies_equal(self) -> None:
        """Every copy of a tie := its owner's value (the lowest stage's), once, at the first agreement after
        the Pipeline connected its communicators (Comm.open_channels), before any forward."""
        if self._unequal:
            self._sync_values()
            self._unequal = False

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
            if len({(c.local_shape, c.rows) for c in copies}) > 1:
                held = ", ".join(f"stage {c.stage} (rank {c.rank}) holds {_describe_rows(c)}" for c in copies)
                return (f"tied weight {key!r} is sharded differently on the stages that declare it: {held}. The copies "
                        "are summed shard by shard, so each rank must hold the same entries of every copy: shard "
                        "every copy alike (fully_shard over data-parallel meshes of one size and rank order, or a "
                        "plain copy only where the mesh has one rank)")
        return None

    def _distinct(self, key: str, copies: list[TiedCopy]) -> list[TiedCopy]:
        """`copies` with each Parameter object once (copies that are one Parameter are one copy)."""
        seen: set[int] = set()
        out = []
        for c in copies:
            p = self._params[(key, c.stage)]
            if id(p) not in seen:
                seen.add(id(p))
                out.append(c)
        return out

    # -- the copies' owner is the lowest stage: every copy starts as its value -------------------
    def _sync_values(self) -> None:
        rank = self._comm.rank
        for key, copies in self.copies.items():
            owner = copies[0]
            holders = sorted({c.rank for c in copies})
            here = [self._params[(key, c.stage)] for c in copies if c.rank == rank]
            if not here and len(holders) <= 2:
                continue  # an all-reduce (more than two holders) needs every rank; an exchange only the two
            with torch.no_grad():
                mine = local_part(self._params[(key, owner.stage)].detach()) if owner.rank == rank else None
                value = mine if holders == [owner.rank] else self._reduce(key, holders, mine,
                                                                          "making tied weight copies equal")
                for p in here:
                    if p is not self._params.get((key, owner.stage)):
                        local_part(p).copy_(value)

    # -- after a step: each copy's gradient becomes the sum of the step's gradients -------------
    def stash(self) -> dict[tuple[str, int], tuple[nn.Parameter, torch.Tensor | None]]:
        """Each tied copy and the gradient it holds before a step, set aside (the sum covers one step;
        the gradient finalisation puts them back)."""
        stash = {}
        seen: set[int] = set()
        for k, p in self._params.items():
            if id(p) in seen:  # one Parameter under several stages: set aside once
                continue
            seen.add(id(p))
            stash[k] = (p, p.grad)
            p.grad = None
        return stash

    def copy_of(self, param: nn.Parameter) -> tuple[str, int] | None:
        """(key, stage) of a tied copy held on this rank, or None for an untied parameter."""
        return self._by_id.get(id(param))

    def sum_grads(self) -> None:
        """Every copy's .grad := the sum over model stages of this step's gradients (a dualpipe
        mirror's, already summed with its twin, is counted once); None where no copy got one. What
        .grad held before the step is added back by the gradient finalisation (finalise.py)."""
        rank = self._comm.rank
        for key, copies in self.copies.items():
            holders = sorted({c.rank for c in copies})
            here = [c for c in copies if c.rank == rank]
            models = {c.model_stage for c in copies}
            if all({c.model_stage for c in copies if c.rank == r} == models for r in holders):
                if not here:  # every holder has a copy of each model stage: no communication
                    continue
                counted = self._distinct(key, _one_per_model_stage(here))
                total, got = self._sum([self._grad(key, c) for c in counted]), self._got(key, counted)
            elif not here and len(holders) <= 2:
                continue
            else:  # each model stage counted once, on the rank of its primary copy (stage == model stage)
                counted = self._distinct(key, [c for c in here if c.stage == c.model_stage])
                mine = self._sum([self._grad(key, c) for c in counted]) if counted else self._zeros(key)
                # after the gradient: 1 where a counted copy here got one (summed: how many ranks did),
                # then a sample of this rank's copy and 1 (summed: the samples and how many ranks gave one)
                sample = self._sample(key, counted[0]).to(mine.dtype) if counted else None
                flat = torch.cat([mine.reshape(-1), mine.new_tensor([float(self._got(key, counted))]),
                                  torch.zeros(SAMPLE, dtype=mine.dtype, device=mine.device) if sample is None
                                  else sample, mine.new_tensor([float(sample is not None)])])
                flat = self._reduce(key, holders, flat, "summing tied weight gradients")
                n = mine.numel()
                got, sampled = flat[[n, -1]].tolist()
                total, got = flat[:n].view_as(mine), bool(got)
                if sample is not None:
                    self._compare(key, sample, flat[n + 1:-1], int(sampled))
                if not here:
                    continue
            self._compare_here(key, here)
            for c in here:
                p = self._params[(key, c.stage)]
                if not got:
                    p.grad = None
                    continue
                grad = torch.zeros_like(p)  # an FSDP2 copy's gradient is a DTensor like it: its shard is summed
                local_part(grad).copy_(total)
                p.grad = grad

    # -- copies that parted: an optimizer that treats them differently ----------------------------
    def _sample(self, key: str, copy: TiedCopy) -> torch.Tensor:
        """SAMPLE entries of a copy, spread over it, in float32 (the same entries on every rank)."""
        flat = local_part(self._params[(key, copy.stage)].detach()).reshape(-1)
        if flat.numel() == 0:  # a shard of no rows (a weight of fewer rows than replicas)
            return torch.zeros(SAMPLE, dtype=torch.float32, device=flat.device)
        # integer steps: float indices round past the end above 2**24 entries (a real vocabulary)
        index = torch.arange(SAMPLE, device=flat.device) * (flat.numel() - 1) // (SAMPLE - 1)
        return flat.index_select(0, index).float()

    def _compare(self, key: str, mine: torch.Tensor, summed: torch.Tensor, ranks: int) -> None:
        """The ranks' samples summed (in the gradient's dtype): equal copies sum to `ranks` times this
        rank's, exactly for two ranks, up to the sum's rounding for more."""
        rtol = torch.finfo(mine.dtype).eps * (ranks - 1)
        if ranks > 1 and not torch.allclose(summed.double(), mine.double() * ranks, rtol=rtol, atol=0.0,
                                            equal_nan=True):  # a NaN weight is the loss's story, not the tie's
            self._parted(key, f"the copies on {ranks} ranks")

    def _compare_here(self, key: str, here: list[TiedCopy]) -> None:
        distinct = self._distinct(key, here)
        first = self._sample(key, distinct[0]) if len(distinct) > 1 else None
        if first is not None and any(not torch.allclose(first, self._sample(key, c), rtol=0.0, atol=0.0, equal_nan=True)
                                     for c in distinct[1:]):
            self._parted(key, f"the copies of stages {', '.join(str(c.stage) for c in distinct)} on this rank")

    def _parted(self, key: str, where: str) -> None:
        self.parted = self.parted or (
            f"tied weight {key!r}: {where} differ (entries compared after a step; a tie's copies start equal and get "
            "the same gradient, so something else changed them): give every copy to the optimizer with the same "
            "settings (learning rate, weight decay, parameter group), and load or change a tied weight in every copy; "
            "then build the Pipeline again (its first step makes the copies equal)")


    def _got(self, key: str, copies: list[TiedCopy]) -> bool:
        """Whether any of these copies got a gradient this step."""
        return any(self._params[(key, c.stage)].grad is not None for c in copies)

    def _grad(self, key: str, copy: TiedCopy) -> torch.Tensor:
        """This rank's part of a copy's gradient (zeros without one)."""
        p = self._params[(key, copy.stage)]
        return local_part(p.grad if p.grad is not None else torch.zeros_like(p))

    @staticmethod
    def _sum(grads: list[torch.Tensor]) -> torch.Tensor:
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        return total

    def _zeros(self, key: str) -> torch.Tensor:
        """Zeros shaped like this rank's part of the tied weight, on this rank's device for it."""
        c = self.copies[key][0]
        here = [p for (k, _), p in self._params.items() if k == key]
        return torch.zeros(c.local_shape, dtype=getattr(torch, c.dtype.removeprefix("torch.")),
                           device=here[0].device if here else self._comm.device)

    def _reduce(self, key: str, holders: list[int], mine: torch.Tensor | None, what: str) -> torch.Tensor:
        """The sum of the holders' tensors (zeros from a rank that gives None), equal on every holder:
        an exchange between two holders, an all-reduce over the group otherwise (every rank joins)."""
        rank = self._comm.rank
        if mine is None:
            mine = self._zeros(key)
        if len(holders) == 2:
            peer = holders[1] if rank == holders[0] else holders[0]
            theirs = self._comm.exchange(mine.detach(), peer, f"{what} {key!r} with rank {peer}")
            return mine + theirs  # the same on both ranks: a + b == b + a
        return self._comm.all_reduce_tensor(mine.detach(), "sum", f"{what} {key!r}")


def _describe_rows(c: TiedCopy) -> str:
    if c.rows and c.rows[0] == "layout":
        return f"a shard of layout {c.rows[1]} at mesh coordinate {list(c.rows[3])}"
    return "entries " + " x ".join(f"[{start}:{start + length}]" for start, length in c.rows)


def check_shared_parameters(stages: list) -> None:
    """Raises InputError where stages of this rank hold one Parameter object that they do not all
    declare tied under one key: each stage's gradient finalisation would count its gradient, and a
    copy on another rank would not be summed with it."""
    for param, held in shared_parameters([s.module for s in stages]):
        holders = [stages[i] for i, _ in held]
        keys = [next((k for k, p in s.tied.items() if p is param), None) for s in holders]
        if None in keys or len(set(keys)) > 1:
            where = ", ".join(f"stage {s.stage_index}" + (f" (tied {k!r})" if k else "") for s, k in zip(holders, keys))
            raise InputError(
                f"{where} hold one Parameter object ({held[0][1]}) that they do not declare as one tied weight: "
                "declare it on each of them under one key (PipelineStage(..., tied={'<key>': <the parameter>})), "
                "or build the stages with pc.partition, which finds such ties itself")


def _one_per_model_stage(copies: list[TiedCopy]) -> list[TiedCopy]:
    """The first copy of each model stage, in model stage order (the same order on every rank)."""
    chosen: dict[int, TiedCopy] = {}
    for c in copies:
        chosen.setdefault(c.model_stage, c)
    return [chosen[m] for m in sorted(chosen)]
