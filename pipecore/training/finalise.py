"""The one gradient finalisation of a training step: what is set aside before it, how the step's
gradients are combined after it, and how `.grad` goes back when it fails.

Three mechanisms keep `.grad` equal to single-process training; each sets the gradients it combines
aside before the step, so that it combines this step's only, and adds back what `.grad` held:

- data-parallel replicas (`DataParallel`): the executor's buckets (csrc/grad_reduce.h) set aside the
  plain stages' gradients at the start of the step and all-reduce each bucket while later backwards
  run; DDP/FSDP2 stages reduce through their wrapper, which sets its own aside;
- dualpipe's mirrored stages (two copies of one model stage on partner ranks): every parameter's
  gradient is set aside; after the step the partners exchange theirs and each copy gets the sum;
- tied weights (`TiedWeights`): after the step, each copy gets the sum of the copies' gradients.

The order is fixed, and written here only:

1. `begin_step()`, before anything of the step: the replicas' buckets and wrappers set aside;
2. `set_aside()`, right before the executor runs (after the first agreement, which learns the ties):
   mirrors, then ties;
3. `finish()`, once the step ran on this rank: the replicas' sums (PeerFailedError if a replica
   failed), then the mirror sum, then the tie sum (a tied dualpipe copy is already summed with its
   twin), each of this step's gradients only; then what the mirrors and ties set aside is added
   back, once, and the replicas' set-aside gradients last;
4. `abandon(error)`, on every failure until `finish()` returned, one inside `finish()` included (the
   Pipeline's step() calls it for any exception; once per step): ties, then mirrors, then the
   replicas put back exactly what `.grad` held before the step. After `finish()` the step happened
   on every rank; a later local error (merging the outputs) leaves the step's gradients in.

A parameter that no copy got a gradient for keeps what it held (None if none), as one process
leaves a parameter its forward never used: AdamW then skips it.
"""

from __future__ import annotations

import torch

from pipecore.executor.comm import Comm
from pipecore.stage.dtensor import local_part
from pipecore.training.data_parallel import DataParallel
from pipecore.training.ties import TiedWeights
from pipecore.training.wrapped_stages import WrapperEvents


class GradFinalisation:
    def __init__(self, comm: Comm, stages: list, topology, dp: DataParallel | None,
                 wrappers: WrapperEvents | None = None):
        self._comm = comm
        self._stages = stages
        self._topology = topology
        self._dp = dp
        self._wrappers = wrappers  # DDP/FSDP2 stages, with replicas or over this rank alone
        self.ties: TiedWeights | None = None  # learnt at the first agreement (building a Pipeline is no collective)
        self._mirrored = topology.style == "dualpipe"
        self._mirror_stash: dict | None = None
        self._tie_stash: dict | None = None
        self._active = False  # between begin_step() and the step's finish() or abandon()

    @property
    def dp(self) -> DataParallel | None:
        """The data-parallel replicas (None without dp_group)."""
        return self._dp

    def exchange_peers(self) -> set[int]:
        """The ranks this rank exchanges gradients with after a step (Comm.exchange): its dualpipe mirror's
        partner, its ties' other holders. Known at the first agreement (the ties are learnt there)."""
        peers = {self._comm.world - 1 - self._comm.rank} if self._mirrored and self._comm.world > 1 else set()
        return peers | (self.ties.exchange_peers() if self.ties else set())

    def make_ties_equal(self) -> None:
        """At the first agreement, once the communicators are connected: every tie's copies equal (once).
        Whatever fails there breaks the group: the other holders may have made their copies equal already,
        and a later step would come back here on this rank alone (or run with a copy left unequal)."""
        if not self.ties:
            return
        try:
            self.ties.make_copies_equal()
        except Exception as exc:
            if self._comm.broken is None:  # (an exchange that failed broke it already, saying why)
                self._comm.mark_broken(f"making the tied weights' copies equal failed: {exc!r}")
            raise

    def begin_step(self) -> None:
        self._active = True
        if self._dp is not None:
            self._dp.begin_step()
        if self._wrappers is not None:
            self._wrappers.begin_step()

    def discard_round(self) -> None:
        """The device path, a first stage's batch changed shape: the replicas' round of reductions
        over stand-in messages is discarded and .grad set aside again (DataParallel.discard_round)."""
        if self._dp is not None:
            self._dp.discard_round()

    def set_aside(self) -> None:
        if self._mirrored:  # each parameter once, also one that two of this rank's stages share
            self._mirror_stash = {}
            for s in self._stages:
                for p in s.module.parameters():
                    if id(p) not in self._mirror_stash:
                        self._mirror_stash[id(p)] = (p, p.grad)
                        p.grad = None
        if self.ties:
            self._tie_stash = self.ties.stash()

    def finish(self, set_phase=lambda phase: None) -> None:
        """The step ran on this rank. Raises (PeerFailedError: another replica failed) with the
        step's gradients still set aside: the caller then calls abandon(). `set_phase`: the flight
        record's phase (Doctor.set_phase), told where the replicas' reduction ends."""
        if self._dp is not None:
            set_phase("data-parallel reduction")
            self._dp.finish()
            set_phase("finalise")
        if self._mirror_stash is not None:
            self._sum_mirrors()
        if self._tie_stash is not None:
            self.ties.sum_grads()
        # this step's sums are in .grad: what it held before goes back on top, once (a tied dualpipe
        # copy was set aside by the mirrors, so its tie stash holds None)
        for stash in (self._mirror_stash, self._tie_stash):
            for p, prev in (stash or {}).values():
                if prev is not None:
                    p.grad = prev if p.grad is None else prev + p.grad
        self._mirror_stash = self._tie_stash = None
        if self._dp is not None:
            self._dp.restore()
        if self._wrappers is not None:
            self._wrappers.end_step(failed=False)
        self._active = False

    def abandon(self, error: BaseException) -> None:
        """The step failed, here or on another rank: .grad as before it (once per step)."""
        if not self._active:
            return
        self._active = False
        tie_stash, self._tie_stash = self._tie_stash, None
        mirror_stash, self._mirror_stash = self._mirror_stash, None
        for stash in (tie_stash, mirror_stash):  # the reverse of set_aside()
            for p, prev in (stash or {}).values():
                p.grad = prev
        try:
            if self._dp is not None:
                self._dp.abandon(error)
        finally:
            if self._wrappers is not None:
                try:
                    self._wrappers.end_step(failed=True)
                except Exception as exc:  # noqa: BLE001 - the step's own error is the one raised
                    error.add_note(f"pipecore: resetting the DDP/FSDP2 stages after it failed as well: {exc!r}")

    def _sum_mirrors(self) -> None:
        """Each mirrored parameter's .grad := the two copies' gradients of this step (None where
        neither copy got one)."""
        topo = self._topology
        partner = self._comm.world - 1 - self._comm.rank
        params = list({id(p): (s.stage_index, name, p)
                       for s in sorted(self._stages, key=lambda s: topo.model_stage[s.stage_index])
                       for name, p in s.module.named_parameters() if p.requires_grad}.values())
        if not params:  # the partner holds the same model stages: it has none either
            return
        # an FSDP2 stage's parameters are DTensors: the partner's copy holds the same shard (the same
        # dp rank), so the local shards are summed
        mine = [local_part(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, _, p in params]
        # after the gradients, one flag per parameter: 1 where this copy got a gradient
        got = torch.tensor([p.grad is not None for _, _, p in params], dtype=mine[0].dtype, device=mine[0].device)
        flat = torch.cat(mine + [got])
        total = flat + self._comm.exchange(flat, partner, f"summing mirrored dualpipe gradients with rank {partner}")
        anyone_got = total[-len(params):].tolist()
        offset = 0
        for (_, _, p), got_one in zip(params, anyone_got):
            n = local_part(p).numel()
            if got_one:
                grad = torch.zeros_like(p) if p.grad is None else p.grad
                local_part(grad).copy_(total[offset:offset + n].view_as(local_part(grad)))
                p.grad = grad
            else:
                p.grad = None
            offset += n
