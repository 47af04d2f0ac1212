"""Data x pipeline parallel: each stage replicated over a data-parallel group.

    mesh = pc.init_mesh(dp=2, pp=2)
    pipe = pc.Pipeline(stages, "1f1b", m, loss_fn, group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"))
    pipe.step(x_local, target=y_local)     # each replica steps its share of the global batch

After the step every parameter's `.grad` is the mean over the replicas (as torch DDP gives), so it
equals single-process training of the whole global batch; with `loss_divisor` (a loss_fn that
sums over tokens), give the token count of the whole global batch (all replicas: all-reduce it
over the dp group) and the replicas' gradients are summed.

How: the last stage weights each microbatch's loss by 1/dp as well (the mean over replicas is
folded into the seeds), so that every reduction over the dp group is a plain sum. Plain stages
reduce in the executor (csrc/grad_reduce.h): buckets of about `bucket_bytes`, in reverse
registration order, are all-reduced asynchronously from the stage's last backward on (a bucket
goes as soon as its parameters' last gradients are accumulated), the rest at the stage's
REDUCE_GRAD, and the step waits for them at its end: one stage's reduction runs under the
backwards of the others. Stages the user wrapped in torch DDP or FSDP2 reduce through their own
wrapper (pipecore/training/wrapped_stages.py), driven by the schedule's UNSHARD, RESHARD and REDUCE_GRAD.

A failed step anywhere fails the step on every rank of every replica (each bucket carries a
"failed" flag; one small all-reduce over the pipeline group at the step's end tells the rest of the
pipeline), and with plain stages every rank's `.grad` is put back as it was before the step. A
pipeline that cannot run at all (a rank could not build its Pipeline, its ranks built different
ones) tells its replicas at the replicas' agreement, which follows its first training agreement.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pipecore.errors import InputError, PeerFailedError, PipelineError
from pipecore.executor.comm import Comm, cannot_meet, leave_first
from pipecore.executor.native import C, CommError
from pipecore.executor.program import Program

DEFAULT_BUCKET_BYTES = 25 << 20  # torch DDP's bucket_cap_mb
AGREEING = "data-parallel replicas agreeing on their pipelines"


class DataParallel:
    """The data-parallel side of one Pipeline: its group, the buckets of its plain stages, the
    wrappers of the others."""

    def __init__(self, comm: Comm, stages: list, dp_group, bucket_bytes: int, wrapped: dict):
        check_groups(comm.group, dp_group)
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}")
        self.group = dp_group
        self.size = dist.get_world_size(dp_group)
        self.rank = dist.get_rank(dp_group)
        self._comm = comm
        self._stages = stages
        self.wrapped = wrapped  # local stage -> its DDP/FSDP2 adapter (WrapperEvents, driven by finalise.py)
        self._bucket_bytes = bucket_bytes
        self.agreed = False
        self.refused: str | None = None  # the replicas cannot agree: every later step says it again
        self._uid: str | None = None
        self._store = dist.distributed_c10d._get_default_store()
        # rounds of reductions (a step's, or a discarded one): what pairs with the other replicas
        self._round = 0

    def attach(self, executor, program: Program, summary: dict) -> None:
        """Once the Pipeline's training program and executor exist: the buckets of the plain stages,
        in the order of their REDUCE_GRAD actions, and the wrapped stages' events. `summary`: what the
        replicas' pipelines must have in common (checked at the first training step)."""
        self._summary = summary
        stages = self._stages
        self.reducer = C.GradReducer(self.group, self._comm.timeout)
        self.layout: list[tuple] = []  # (local stage, [(shape, dtype)...]) per bucket: equal on every replica
        self._bucketed: set[int] = set()
        order = program.local_stages_in_order_of("REDUCE_GRAD", len(stages))
        owner: dict[int, int] = {}  # a parameter two stages share goes with the later REDUCE_GRAD
        for local in order:
            for p in stages[local].module.parameters():
                owner[id(p)] = local
        for local in order:
            if local in self.wrapped:
                continue
            params = [p for p in stages[local].module.parameters() if p.requires_grad and owner[id(p)] == local]
            for bucket in _buckets(params, self._bucket_bytes):
                self.reducer.add_bucket(local, bucket, torch.empty(0, dtype=bucket[0].dtype, device=bucket[0].device))
                self.layout.append((local, [(tuple(q.shape), str(q.dtype)) for q in bucket]))
                self._bucketed.update(id(q) for q in bucket)
        if self.reducer.num_buckets == 0:  # every stage reduces through its wrapper: the failure flag goes alone
            self.reducer.add_bucket(-1, [], torch.empty(0, device=self._comm.device_for(self.group)))
        executor.set_grad_reducer(self.reducer)

    # -- a step ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._round += 1
        self._concluded = False
        self._reduced = False  # the step's reductions finished (finish() returned)
        self.reducer.begin_step()

    # A training step ends the same way on every rank of every replica: the buckets' flags tell the
    # ranks of one pipeline position whether a replica failed, then one small all-reduce over the
    # pipeline group tells its other ranks (a failure after a rank's last message, or a flag only its
    # position saw). Every rank makes both exchanges once per step, whichever way its step ended.
    def finish(self) -> None:
        """The step ran on this rank: wait for the reductions; PeerFailedError if any rank failed."""
        try:
            ok = self.reducer.finish(False, 1.0)
        except CommError as exc:
            raise self._comm.abandon_group(exc, self.group) from exc.__cause__
        except RuntimeError as exc:  # a gradient changed after its bucket was sent
            ok, late = False, exc
        else:
            late = self._stray_gradient()
            ok = ok and late is None
        if not self._conclude(ok):
            if late is not None:
                raise InputError(f"rank {dist.get_rank()}: {late}") from None
            raise PeerFailedError(f"rank {dist.get_rank()} (pp rank {self._comm.rank}, dp rank {self.rank}): step "
                                  f"{self._comm.step} failed on another rank of this pipeline or of another "
                                  f"data-parallel replica ({self._first_error()}), so "
                                  "this step's gradients were not kept: .grad is as before the step. Step again "
                                  "once it is fixed.")
        self._reduced = True

    def abandon(self, error: BaseException) -> None:
        """The step failed (here or elsewhere): the replicas still get every bucket (flagged), the
        pipeline's ranks learn it, and .grad goes back to what it was before the step. The error goes
        to the store first (the first one stays), for the other ranks' messages."""
        said = str(error).strip()
        self._leave_error(self._error_keys(),
                          f"rank {dist.get_rank()}: {type(error).__name__}: {said.splitlines()[0] if said else ''}")
        try:
            # replicas that disagree on their buckets must not exchange them; after finish() (a later part
            # of the gradient finalisation failed) this step's reductions are over: nothing more to exchange
            if self.agreed and not self._reduced:
                self.reducer.finish(True, 1.0)
            if self.agreed and not self._concluded:
                self._conclude(False)
        except CommError as exc:
            self._comm.abandon_group(exc, self.group)  # the step's own error is raised; later steps say the group broke
        except (RuntimeError, PipelineError):
            pass  # the step's own error says what happened
        finally:
            self.reducer.restore(False)

    def discard_round(self) -> None:
        """The device path, a first stage's batch changed shape: this rank's pass over stand-in messages
        (or, on the first stage, its "shapes changed" pass) counts as one round of reductions, flagged
        failed, and .grad goes back for the step to run again. Every rank of a replica whose batch
        changed does one such round, so the replicas' rounds stay paired: a replica whose batch did not
        change gets the flags, fails its step (PeerFailedError, with the reason below), and its step
        again pairs with the run that counts. Wrapped stages' own reductions (DDP, FSDP2) already ran on
        the stand-ins and cannot be taken back: refused."""
        why = (f"rank {dist.get_rank()}: the batch of data-parallel replica {self.rank} changed shape, and on this "
               "device path its ranks computed on stand-ins before they knew (csrc/device_comm.h): that round of "
               "gradient reductions was discarded. Step again (before any other data-parallel collective) to pair "
               "with the run that counts")
        if self._uid is not None:  # the replicas' key only: this pipeline's step goes on
            self._leave_error([self._replicas_error_key()], why)
        try:
            self.reducer.finish(True, 1.0)
        except CommError as exc:
            raise self._comm.abandon_group(exc, self.group) from exc.__cause__
        self.reducer.restore(False)
        if self.wrapped:
            raise InputError(f"rank {dist.get_rank()}: a batch changed shape on NCCL with DDP- or FSDP2-wrapped stages "
                             "and dp_group: their reductions already ran on stand-in messages and cannot be discarded. "
                             "Keep every replica's batch shape fixed (pad the last batch, or drop it), or use plain "
                             "stages")
        self.begin_step()

    def _stray_gradient(self) -> str | None:
        """A gradient of a plain stage's parameter that no bucket holds (it required no gradient when
        the Pipeline was built): it would differ between replicas."""
        for local, stage in enumerate(self._stages):
            if local in self.wrapped:
                continue
            for name, p in stage.module.named_parameters():
                if p.requires_grad and p.grad is not None and id(p) not in self._bucketed:
                    return (f"stage {stage.stage_index}'s parameter {name} has a gradient but was not reduced over the "
                            "data-parallel replicas: it did not require a gradient when the Pipeline was built. Build "
                            "the Pipeline again after changing which parameters train")
        return None

    def _conclude(self, ok: bool) -> bool:
        """Did every rank of the pipeline end the step well (its flags included)? Once per step."""
        self._concluded = True
        if self._comm.broken is not None:
            return False
        return not self._anywhere_in_pipeline(not ok, "agreeing whether every replica's step succeeded")

    def _anywhere_in_pipeline(self, flag: bool, what: str) -> bool:
        """Is `flag` set on any rank of the pipeline's group? (One small all-reduce.)"""
        if self._comm.world == 1:
            return flag
        return self._comm.all_reduce_sum([int(flag)], what)[0] > 0

    def restore(self) -> None:
        """After a kept step (the last part of the gradient finalisation): the gradients .grad held
        before it are added back."""
        self.reducer.restore(True)

    def trace(self) -> list[dict]:
        return [{"rank": self._comm.rank, "name": f"DP:reduce {self._stages[s].stage_index}/{b} ({n} B)" if s >= 0
                 else "DP:status", "start_us": t0, "end_us": t1}
                for s, b, n, t0, t1 in self.reducer.trace()]

    def _error_keys(self) -> list[str]:
        """Where a failed step's first error is left: this dp group's key and this pipeline's."""
        keys = [self._replicas_error_key()] if self._uid is not None else []
        pipeline_key = self._comm.error_key()
        return keys + ([pipeline_key] if pipeline_key is not None else [])

    def _leave_error(self, keys: list[str], text: str) -> None:
        """`text` under each key unless an error is there already (the first one stays)."""
        leave_first(self._store, keys, text)

    def _replicas_error_key(self) -> str:
        return f"pipecore/dp/{self._uid}/round{self._round}/error"  # by round: a discarded one counts

    def _first_error(self) -> str:
        """The first error left under this rank's keys (another rank's), waiting briefly for it."""
        import time

        deadline = time.monotonic() + 5
        while True:
            for key in self._error_keys():
                try:
                    if self._store.check([key]):
                        return self._store.get(key).decode()
                except Exception:  # noqa: BLE001
                    return "its error message did not arrive"
            if time.monotonic() > deadline:
                return "its error message did not arrive"
            time.sleep(0.01)

    MEETING = "dp"  # the replicas' meeting point before their agreement (Comm.meet)

    def agree(self) -> None:
        """After the pipeline's first training agreement (pipecore/runtime/agreement.py): the replicas
        hold the same pipeline position, the same program and the same bucket layout; otherwise every
        rank of every replica says what differs, at this step and every later one. A replica whose
        pipeline cannot run left why at the meeting point before (`cannot_agree`): raised here."""
        comm = self._comm
        if self.refused is not None:
            raise InputError(self.refused)
        told = comm.meet(self.MEETING, AGREEING, group=self.group)
        if told is not None:
            self.refused = f"rank {dist.get_rank()} (pp rank {comm.rank}, dp rank {self.rank}): {told}"
            raise InputError(self.refused)
        mine = {"pp rank": comm.rank, "pp size": comm.world, "program": self._summary, "buckets": self.layout,
                "wrapped": sorted((self._stages[k].stage_index, a.kind) for k, a in self.wrapped.items()),
                "nonce": int.from_bytes(os.urandom(7), "little")}
        rows = comm.gather_objects(mine, AGREEING, group=self.group)
        # names this dp group's store keys alike on every replica (a failed step's first error)
        self._uid = f"{dist.distributed_c10d._get_process_group_name(self.group)}/{rows[0]['nonce']:x}"
        problem = None
        for field in ("pp rank", "pp size", "program", "buckets", "wrapped"):
            values = [r[field] for r in rows]
            if problem is None and any(v != values[0] for v in values):
                problem = (f"the data-parallel replicas differ in their {field} ({_describe(field, values)}). dp_group "
                           "must join ranks that hold the same stages of the same model in the same pipeline position: "
                           "build the groups with pc.init_mesh(dp=..., pp=...)")
        # the pipeline's other positions learn it too (theirs may agree)
        said = [(r, p) for r, p in enumerate(comm.gather_objects(problem, "agreeing whether the data-parallel replicas "
                                                                  "match")) if p]
        if said:
            self.refused = (f"rank {dist.get_rank()} (pp rank {comm.rank}, dp rank {self.rank}): "
                            f"{problem or f'pp rank {said[0][0]} of this pipeline says: {said[0][1]}'}")
            raise InputError(self.refused)
        # the replicas' communicator for the stages' device (their buckets'), made here where every replica
        # just met: NCCL makes one at its first collective (c10d: a store round trip, then ncclCommInitRank,
        # which no timeout bounds), which on a "cpu:gloo,cuda:nccl" group would be the first step's first
        # bucket ([Note: connecting before the first step] in csrc/device_comm.h); on gloo, 4 bytes once.
        # Without buckets (every stage wrapped) the failure flag goes on device_for(group), whose
        # communicator the gather above connected
        if self.layout:
            comm.all_reduce_tensor(torch.zeros(1, device=comm.device), "sum",
                                   "connecting the data-parallel replicas' communicator", group=self.group)
        self.agreed = True  # until then no bucket goes: replicas that disagree must not exchange them

    def cannot_agree(self, why: str) -> None:
        """This rank's pipeline cannot run (its first agreement found why): its replicas learn it at
        their meeting point, instead of waiting there for this rank (once)."""
        if self.refused is None and not self.agreed:
            self.refused = why
            cannot_meet(self.MEETING, self.group, f"a data-parallel replica of this pipeline cannot run: {why}")


def check_groups(group, dp_group) -> None:
    """Local checks, before any communication: this rank is in both groups and they meet only here."""
    me = dist.get_rank()
    try:
        dp_ranks = dist.get_process_group_ranks(dp_group)
    except Exception as exc:  # noqa: BLE001 - not a process group
        raise TypeError(f"dp_group must be a torch.distributed process group (mesh.get_group('dp')), got "
                        f"{type(dp_group).__name__}") from exc
    if me not in dp_ranks:
        raise InputError(f"rank {me} is not in dp_group (ranks {dp_ranks}): pass each rank its own data-parallel group "
                         "(mesh.get_group('dp'))")
    pp_ranks = dist.get_process_group_ranks(group)
    both = sorted(set(pp_ranks) & set(dp_ranks))
    if both != [me]:
        raise InputError(f"rank {me}: the pipeline group (ranks {pp_ranks}) and dp_group (ranks {dp_ranks}) share "
                         f"ranks {both}: a data-parallel replica is another pipeline, so the groups meet only in this "
                         "rank. Use group=mesh.get_group('pp'), dp_group=mesh.get_group('dp') of "
                         "pc.init_mesh(dp=..., pp=...)")


def _buckets(params: list, bucket_bytes: int) -> list[list]:
    """torch DDP's bucketing: reverse registration order (roughly the backward's), one dtype and
    device per bucket, a bucket closed once it holds `bucket_bytes`."""
    done: list[list] = []
    open_: dict[tuple, list] = {}
    size: dict[tuple, int] = {}
    for p in reversed(params):
        key = (p.dtype, p.device)
        open_.setdefault(key, []).append(p)
        size[key] = size.get(key, 0) + p.numel() * p.element_size()
        if size[key] >= bucket_bytes:
            done.append(open_.pop(key))
            size[key] = 0
    return done + list(open_.values())


def _describe(field: str, values: list) -> str:
    if field in ("pp rank", "pp size", "wrapped"):
        return ", ".join(f"dp rank {r}: {v}" for r, v in enumerate(values))
    differ = [r for r, v in enumerate(values) if v != values[0]]
    return f"dp ranks {differ} differ from dp rank 0"


__all__ = ["DataParallel", "DEFAULT_BUCKET_BYTES", "check_groups"]
