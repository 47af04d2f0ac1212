"""`Pipeline`: runs a schedule over this rank's stages with the C++ executor."""

from __future__ import annotations

import inspect
import os
import warnings
import weakref
from contextlib import nullcontext
from datetime import timedelta
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from . import plan as planning
from .discovery import Discovery, declared_mismatch
from .microbatch import batch_size, merge, merge_by_spec, split, split_by_specs
from .schedule import Action, Kind, Schedule, ScheduleError, build_schedule
from .schedule.lowering import add_unshard_reshard
from .errors import CommunicationError, InputError, PeerFailedError
from .data_parallel import DEFAULT_BUCKET_BYTES, DataParallel
from .wrapped_stages import WrappedStage
from .grads import TiedWeights
from .overlap import PairRunner
from .split_backward import fallback_message, name_parameter
from .rollback import Rollback
from .stage import PipelineStage, from_torch_stage, is_torch_stage

DEFAULT_TIMEOUT_S = 300.0
# Receives posted ahead of the program point: gloo and NCCL move a message only once its receive
# is posted, so posting each receive just before it is needed puts a round trip on the critical path.
DEFAULT_RECV_WINDOW = 32
# Bytes of sends in flight to one peer before the next send to it waits for earlier ones to complete.
DEFAULT_SEND_BUDGET = 64 << 20

# executor opcodes (csrc/executor.h): the schedule kinds plus an OVERLAP_F_B bracket
_OVERLAP_BEGIN, _OVERLAP_END = 11, 12


def _range(name: str):
    """An NVTX range from Python (the `nvtx` package; no-op without it)."""
    if _nvtx is None:
        return nullcontext()
    return _nvtx.annotate(name, domain="pipecore")


try:  # Python-side phases show in Nsight Systems beside the executor's per-action ranges
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - optional
    _nvtx = None


def _native():
    from . import _C

    return _C


class Pipeline:
    """Pipeline-parallel training of this rank's `stages` under `schedule`.

    `step(*args, target=..., losses=...)` has torch.distributed.pipelining's meaning: inputs go on
    the rank(s) holding a first stage, targets on the rank(s) holding a last stage; it returns the
    merged last-stage outputs there (None elsewhere), fills `losses` with the per-microbatch losses
    there (detached; the list's earlier contents replaced, as torch does),
    and accumulates into every parameter's `.grad` what single-process training on the whole batch
    would (`scale_grads`: each microbatch's loss is weighted by its share of the batch rows, which
    equals the mean over the batch for mean-reduced losses; only this step's contribution is scaled).

    `step(..., return_outputs=False)` drops each last-stage output as soon as its loss is computed
    (an LLM's logits are the largest tensors of a step) and returns None; `loss_kwargs` are passed to
    every call of `loss_fn(output, target, **loss_kwargs)`, as torch does.

    `recv_window`: how many receives are posted ahead of the action that needs them (0: each at
    its own RECV action), holding at most 16 MiB of buffers ahead (the next receive always goes). The
    first step of each batch shape posts every receive at its own action (it learns the shapes).
    Early receives let a peer's data land while this rank computes; each holds its buffer that
    much longer.

    `send_budget`: bytes of sends in flight to one peer. A sent message is freed as soon as its
    transfer completes; a send that would exceed the budget first waits for earlier sends to that
    peer (a larger message goes alone). It bounds what a rank holds for a peer that is behind, e.g.
    a GPipe first stage whose sends would otherwise pile up.

    `dp_group`: data-parallel replicas of this pipeline (`pc.init_mesh(dp, pp).get_group("dp")`; see
    pipecore/data_parallel.py). Each replica steps its share of the global batch and `.grad` becomes
    the mean over replicas, reduced in buckets of `bucket_bytes` while the step's other backwards run;
    stages wrapped in torch DDP or FSDP2 reduce through their wrapper. A failure on any replica fails
    the step on all of them and leaves `.grad` as it was before the step.

    `overlap_f_b`: how the two halves of dualpipe's OVERLAP_F_B pairs run, the backward on a second
    thread: "lockstep" (taking turns at `pipecore.overlap_handoff()` points inside the model),
    "concurrent" (at once; only for halves that share no process group), "sequential" (as torch),
    or a callable(pair) that decides (see pipecore/overlap.py).

    `keyword_inputs`: which stages get step()'s keyword arguments (split into microbatches like the
    inputs): "first_stage" (a first stage's, with the positional inputs; on a rank without one they
    are refused), or "every_stage" (every stage of the rank they were given on, after what it
    received: torch.distributed.pipelining's rule, e.g. TorchTitan's attention masks; pipecore.compat
    uses it). A later stage's output shapes are learnt from the first step of each shape of the
    first stages' inputs: keyword arguments that change another stage's output shapes on their own fail
    the step's output check.

    `group` defaults to the group the stages were given (`PipelineStage(..., group=)`, torch's way), else
    the default group. `args_chunk_spec`, `kwargs_chunk_spec` and `output_merge_spec` mean what they
    mean in torch.distributed.pipelining (its `TensorChunkSpec`s; None: tensors split and merged along
    dim 0). `stages` may also be torch.distributed.pipelining's own `PipelineStage` objects: each is
    converted to pipecore's (same module, index, device, group and dw_builder; pipecore.compat).

    On a gloo `group`, the first step also opens a second gloo connection between the group's
    ranks (on the group's own gloo device): messages to a lower rank travel on it, so that a rank's
    sends never share a connection with the data it receives.
    """

    def __init__(self, stages: PipelineStage | Sequence[PipelineStage], schedule: str | Schedule,
                 num_microbatches: int, loss_fn: Callable | None = None, group=None, scale_grads: bool = True,
                 timeout: float | None = None, trace: bool = False, *, check_finite: bool = False,
                 recv_window: int = DEFAULT_RECV_WINDOW, send_budget: int = DEFAULT_SEND_BUDGET,
                 dp_group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap_f_b: str | Callable = "lockstep",
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                 keyword_inputs: str = "first_stage"):
        if not dist.is_initialized():
            raise RuntimeError("Pipeline needs torch.distributed: call dist.init_process_group first")
        stages = stage_list(stages)
        wrapped = [s.stage_index for s in stages if s.dw_builder is not None and WrappedStage.is_wrapped(s.module)]
        if wrapped:
            raise ValueError(f"stages {wrapped} have a dw_builder and a DDP/FSDP2-wrapped module: the wrapper reduces "
                             "the gradients its autograd hooks see, not those a dw_builder's runner computes. Drop the "
                             "dw_builder (pipecore splits the backward itself) or the wrapper")
        self.group = _pipeline_group(group, stages)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
        self.num_microbatches = num_microbatches
        if isinstance(schedule, str):
            schedule = build_schedule(schedule, self.world, num_microbatches, len(stages))
        elif not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a name from pc.SCHEDULES or a Schedule, got {type(schedule).__name__}")
        if schedule.num_ranks != self.world:
            raise ValueError(f"the schedule is for {schedule.num_ranks} ranks but the group has {self.world}")
        if schedule.num_microbatches != num_microbatches:
            raise ValueError(f"the schedule has {schedule.num_microbatches} microbatches, Pipeline was given "
                             f"num_microbatches={num_microbatches}")
        num_stages = {s.num_stages for s in stages}
        if num_stages != {schedule.num_stages}:
            raise ValueError(f"the schedule has {schedule.num_stages} stages but the stages say num_stages="
                             f"{sorted(num_stages)}")
        mine = schedule.rank_stages(self.rank)
        given = sorted(s.stage_index for s in stages)
        if given != mine:
            raise ValueError(f"rank {self.rank} must hold stages {mine} under {schedule.name or 'this'} schedule's "
                             f"{schedule.placement} placement, but was given stages {given}")
        schedule.compute_only().validate()
        self.schedule = schedule
        self.stages = sorted(stages, key=lambda s: s.stage_index)
        self.stage_by_index = {s.stage_index: s for s in self.stages}
        self.local_index = {s.stage_index: i for i, s in enumerate(self.stages)}
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        # torch.distributed.pipelining's microbatch specs (None: tensors split and merged along dim 0)
        self.args_chunk_spec, self.kwargs_chunk_spec = args_chunk_spec, kwargs_chunk_spec
        self.output_merge_spec = output_merge_spec
        if keyword_inputs not in ("first_stage", "every_stage"):
            raise ValueError(f"keyword_inputs must be 'first_stage' or 'every_stage', got {keyword_inputs!r}")
        self.keyword_inputs = keyword_inputs
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
        self.trace_enabled = trace
        self.check_finite = check_finite
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        if isinstance(recv_window, bool) or not isinstance(recv_window, int) or recv_window < 0:
            raise ValueError(f"recv_window must be an integer >= 0 (receives posted ahead), got {recv_window!r}")
        if isinstance(send_budget, bool) or not isinstance(send_budget, int) or send_budget < 0:
            raise ValueError(f"send_budget must be an integer >= 0 (bytes in flight per peer), got {send_budget!r}")
        topo = schedule.topology
        for s in self.stages:  # is_first/is_last as this schedule says (dualpipe: two first and two last stages)
            s._role = (topo.prev_stage[s.stage_index] < 0, topo.next_stage[s.stage_index] < 0)
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.is_dualpipe = topo.style == "dualpipe"
        # data-parallel replicas (pipecore/data_parallel.py): checked here, before any communication
        self._dp: DataParallel | None = DataParallel(self, dp_group, bucket_bytes) if dp_group is not None else None
        if dp_group is None:
            for s in self.stages:  # a DDP/FSDP2 stage reduces over a group this Pipeline must know
                WrappedStage.of(s.module, None)
        lowered = {True: schedule.lower(), False: _forward_only(schedule).lower()}
        # FSDP2 stages get UNSHARD/RESHARD in this rank's row only, after lowering: they do not communicate
        # within the pipeline, and the sends and receives must be placed alike on every rank (lowering
        # with them places those differently). The ranks agree below on the program without them.
        run = dict(lowered)
        if self._dp is not None and self._dp.sharded:
            rows = [list(row) for row in lowered[True].codes]
            rows[self.rank] = add_unshard_reshard(rows[self.rank], self._dp.sharded, max_active=3)
            run[True] = Schedule._from_codes(rows, lowered[True].topology, lowered[True].name)
        self._programs: dict[bool, tuple[list[int], list[str]]] = {k: self._encode(v) for k, v in run.items()}
        # what every rank must agree on before the first step (checked at the first agreement)
        self._program = {
            "schedule": schedule.name or "a custom Schedule",
            "microbatches": num_microbatches,
            "stages": schedule.num_stages,
            "placement": f"{schedule.placement} (stage -> rank {list(topo.stage_rank)})",
            "program": planning.signature([[str(a) for a in row] for v in lowered.values() for row in v.actions]),
        }
        self._executor = _native().Executor(self.group, len(self.stages), num_microbatches, self.timeout)
        for s in self.stages:
            nxt, prv = topo.next_stage[s.stage_index], topo.prev_stage[s.stage_index]
            self._executor.set_links(
                self.local_index[s.stage_index],
                self.local_index[nxt] if nxt >= 0 and topo.stage_rank[nxt] == self.rank else -1,
                self.local_index[prv] if prv >= 0 and topo.stage_rank[prv] == self.rank else -1)
        # on an accelerator, action times come from events on its stream (one device wait per traced step)
        self._executor.set_trace(bool(trace), str(self.stages[0].device))
        # gloo runs every operation on its own; NCCL runs a peer pair's operations in posting order
        gloo = self._p2p_backend_is_gloo()
        self._executor.set_recv_window(recv_window, gloo)
        self._executor.set_send_budget(send_budget)
        # posting a gloo operation can block on gloo's locks (and a send copy the message): not on the
        # compute thread
        self._executor.set_comm_thread(gloo)
        # NCCL: batches on a communication stream, events, message statuses on the device: no host
        # wait inside a step (csrc/device_comm.h; posting order in pipecore/schedule/p2p_order.py)
        device = self.stages[0].device
        if not gloo and device.type == "cuda":
            self._executor.set_device_comm(str(device))  # False (host-waiting path) in builds without CUDA
        self._rollback = Rollback([s.module for s in self.stages], [s.device for s in self.stages])
        self._pairs = PairRunner(self, overlap_f_b)  # how OVERLAP_F_B pairs run (pipecore/overlap.py)
        self._set_weight_builders()
        self._reverse_channel = None  # gloo: opened at the first agreement (_open_reverse_channel)
        self._wants_reverse_channel = gloo and self.world > 1
        self._trace: list[dict] = []
        self._warned_fallbacks: set[tuple[int, tuple]] = set()
        self._step_count = 0
        self._plans: dict[tuple[int, bool], dict] = {}  # per (batch signature, training): every stage's plan
        self._discovery: Discovery | None = None  # during a step that learns its batch shape's plan
        self._misbuilt: str | None = None  # the ranks' programs differ (see _first_agreement)
        self._loaded: tuple[int, bool] | None = None
        self._broken: str | None = None
        self._agreed: dict[bool, int] = {}  # per mode (train/eval): the signature all ranks agreed on
        self._last_desc: dict[bool, int] = {}  # first-stage ranks: the batch description it came from
        self._loss_wants_target = _takes_two_args(loss_fn)
        self._loss_divisor: float | None = None  # step()'s, during a step
        self._store = dist.distributed_c10d._get_default_store() if self.world > 1 else None
        # Names this Pipeline's keys in the store, the same on every rank: group rank 0's nonce, learnt
        # by all at the first agreement (a per-process count would differ between ranks that create
        # different numbers of pipelines)
        self._nonce = int.from_bytes(os.urandom(7), "little") if self.rank == 0 else 0
        self._uid: str | None = None
        # which stages tie which weights: learnt at the first agreement (building a Pipeline is not a
        # collective: ranks may build different numbers of them); alone, now
        self._tied: TiedWeights | None = TiedWeights(self) if self.world == 1 else None
        if self._dp is not None:
            self._dp.attach()

    def _set_weight_builders(self) -> None:
        """Stages with torch's dw_builder: whole backward at I, the builder's runner at W."""
        local = [i for i, s in enumerate(self.stages) if s.dw_builder is not None]
        if local:
            # weakly: the executor's callbacks are invisible to Python's cycle collector, and a builder
            # may hold what holds this Pipeline
            me = weakref.ref(self)
            self._executor.set_weight_builders(local, lambda i: me().stages[i].dw_builder())

    # -- program ------------------------------------------------------------------------
    def _encode(self, lowered: Schedule) -> tuple[list[int], list[str]]:
        topo = lowered.topology
        flat: list[int] = []
        labels: list[str] = []

        def emit(op: int, stage: int, mb: int, peer: int, label: str) -> None:
            flat.extend((op, stage, mb, peer, len(labels)))
            labels.append(label)

        for a in lowered.actions[self.rank]:
            if a.kind is Kind.OVERLAP_F_B:
                emit(_OVERLAP_BEGIN, 0, 0, -1, f"PP:{a}")
                for sub in a.sub_actions:
                    emit(int(sub.kind), self.local_index[sub.stage], sub.microbatch, -1, f"PP:{sub}")
                emit(_OVERLAP_END, 0, 0, -1, f"PP:{a}")
                continue
            peer = -1
            if a.kind in (Kind.SEND_F, Kind.RECV_B):
                peer = topo.stage_rank[topo.next_stage[a.stage]]
            elif a.kind in (Kind.SEND_B, Kind.RECV_F):
                peer = topo.stage_rank[topo.prev_stage[a.stage]]
            mb = a.microbatch if a.microbatch is not None else 0
            emit(int(a.kind), self.local_index[a.stage], mb, peer, f"PP:{a}")
        return flat, labels

    # -- public -------------------------------------------------------------------------
    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, loss_divisor: float | torch.Tensor | None = None, **kwargs):
        """One training step over `num_microbatches` microbatches (see the class doc).

        `loss_divisor` (read on ranks holding a last stage): `loss_fn` returns a sum over a
        microbatch's tokens (e.g. `cross_entropy(..., reduction="sum", ignore_index=-100)`) and each
        microbatch's gradient is divided by `loss_divisor`, the batch's token count (e.g.
        `(target != -100).sum()`), so `.grad` equals single-process `loss_fn(whole batch) / N` even
        when microbatches hold different numbers of tokens; it replaces the row-share weighting of
        `scale_grads`. `losses` still holds what `loss_fn` returned. With `dp_group`, `loss_divisor`
        is the token count of the whole global batch (every replica's: all-reduce it over the dp
        group) and the replicas' gradients are summed."""
        with _range("pipecore.step"):
            if self._dp is None:
                return self._run(args, kwargs, target, losses, True, return_outputs, loss_kwargs, loss_divisor)
            self._dp.begin_step()
            try:
                out = self._run(args, kwargs, target, losses, True, return_outputs, loss_kwargs, loss_divisor)
            except BaseException as exc:
                self._dp.abandon(exc)  # the replicas learn of it with the data; .grad as before the step
                raise
            self._dp.restore()
            return out

    def eval(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, **kwargs):
        """Forward only (no gradients); losses are computed when a target and loss_fn are given."""
        with _range("pipecore.eval"), torch.no_grad():
            return self._run(args, kwargs, target, losses, False, return_outputs, loss_kwargs)

    def trace(self) -> list[dict]:
        """This rank's actions of the last step: name ("PP:1F0"), start_us and end_us on the
        host's monotonic clock (shared by all processes of one machine). Needs trace=True. On an
        accelerator the times are when the action's work ran on the device's current stream
        (events), placed on the host clock by one device wait at the start of each traced step."""
        if not self.trace_enabled:
            raise RuntimeError("tracing is off: create the Pipeline with trace=True")
        return list(self._trace)

    @property
    def split_backward_fallbacks(self) -> dict[int, dict[tuple[str, str], int]]:
        """Per stage of this rank, since this Pipeline was built: {(node, why): microbatches} whose
        input backward (I) also computed weight gradients because that autograd node cannot be split
        (see pipecore.split_backward); a shared parameter is named as "parameter fc.weight (shape
        [8, 8])". Stages whose backward split cleanly are absent, and so are microbatches the
        program runs as one B (where no other rank waits for the I)."""
        return {self.stages[local].stage_index: {self._fallback_key(local, key): n for key, n in stats.items()}
                for local, stats in enumerate(self._executor.split_fallbacks()) if stats}

    @property
    def overlap_fallbacks(self) -> dict[str, int]:
        """Since this Pipeline was built: {why: pairs} of OVERLAP_F_B pairs that ran in sequence
        although `overlap_f_b` overlaps them (see pipecore.overlap). The first step of each batch
        shape, which runs every pair in sequence, is not counted."""
        return self._pairs.fallbacks

    @property
    def overlapped_pairs(self) -> int:
        """Since this Pipeline was built: OVERLAP_F_B pairs run on two threads under the concurrent
        or lockstep rules (pairs a hook runs half by half are not counted, nor those of the first
        step of each batch shape, which runs them in sequence)."""
        return self._executor.overlapped_pairs

    def _fallback_key(self, local: int, key: tuple[str, str, int]) -> tuple[str, str]:
        node, why, param = key
        return (name_parameter(self.stages[local].module, param, node) if param else node), why

    def _warn_split_fallbacks(self) -> None:
        new: dict[tuple[int, str], list[str]] = {}  # (stage, why) -> nodes not warned about yet
        for local, stats in enumerate(self._executor.split_fallbacks()):
            stage_index = self.stages[local].stage_index
            for key in stats:
                if (stage_index, key) not in self._warned_fallbacks:
                    self._warned_fallbacks.add((stage_index, key))
                    node, why = self._fallback_key(local, key)
                    new.setdefault((stage_index, why), []).append(node)
        for (stage_index, why), nodes in new.items():
            warnings.warn(fallback_message(stage_index, why, sorted(nodes)), stacklevel=4)

    # -- step ---------------------------------------------------------------------------
    def _run(self, args, kwargs, target, losses, training: bool, return_outputs: bool, loss_kwargs,
             loss_divisor=None):
        if self._misbuilt is not None:
            raise InputError(self._misbuilt)
        if self._broken is not None:
            raise CommunicationError(f"rank {self.rank}: this Pipeline's process group broke in an earlier step "
                                     f"({self._broken}); rebuild the group and the Pipeline before stepping again")
        if training and self._dp is not None and not self._dp.agreed:
            self._dp.agree()  # eval() exchanges nothing over dp: it may run on some replicas only
        m = self.num_microbatches
        step = self._step_count
        self._step_count += 1
        # 1. everything that can be checked before communicating
        problem = None
        inputs: dict[int, tuple[Any, Any]] = {}
        targets = None
        desc = 0
        try:
            self._check_inputs(args, kwargs, target, training)
            loss_divisor = self._check_step_options(return_outputs, loss_kwargs, loss_divisor)
            with _range("pipecore.split"):
                inputs, targets = self._split(args, kwargs, target)
            if self.has_first:
                desc = planning.signature((planning.describe(args), planning.describe(kwargs), training))
        except (ValueError, TypeError) as exc:
            problem = exc
        agreed = self._agreed.get(training)
        if problem is not None:
            if agreed is None:  # first step of this mode: the ranks agree on shapes anyway (and learn the store keys)
                self._agree(0, True, training)
            self._publish_error(step, f"{type(problem).__name__}: {problem}", "input checks")
            if agreed is not None:  # release the peers: they get "aborted" messages instead of data
                self._ensure_loaded(agreed, training)
                self._run_aborted(1)
            raise problem
        # 2. shapes crossing every boundary. They are agreed on once per batch shape: a first stage
        #    whose batch changed shape tells its peers by running the step as "shapes changed"
        #    messages, then all ranks agree again; no collective runs while shapes stay the same.
        if agreed is not None and self.has_first and desc != self._last_desc.get(training):
            self._ensure_loaded(agreed, training)
            self._run_aborted(2)
            if training and self._dp is not None and self._executor.device_comm and self.world > 1:
                self._dp.discard_round()  # as the ranks that compute on its stand-ins do (data_parallel.py)
            agreed = None
        if agreed is None:
            agreed = self._agree_and_plan(step, desc, training)
        else:
            self._ensure_loaded(agreed, training)
        # 3. the step (the first one of a batch shape learns its plan: pipecore/discovery.py)
        self._inputs, self._targets = inputs, targets
        self._outputs: dict[int, Any] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._training = training
        self._return_outputs = return_outputs
        self._loss_kwargs = loss_kwargs or {}
        self._loss_divisor = loss_divisor
        tied_stash = self._tied.stash() if training and self._tied else None
        stash = self._stash_mirrored_grads() if training and self.is_dualpipe else None
        native = _native()
        try:
            while True:
                # RNG states and buffers go back if this run does not count (pipecore/rollback.py)
                self._rollback.arm(learn=self._discovery is not None)
                on_stand_ins = self._executor.device_comm and self._discovery is None  # (device_comm.h)
                try:
                    self._executor.run(self._forward, lambda error, action: self._publish_error(step, error, action),
                                       self._discovery.answer if self._discovery is not None else None)
                    break
                except native.PeerReplan:  # a first stage's batch changed shape: agree, then run again
                    problem = self._restore_module_state()
                    if problem:  # the peers are agreeing already: run again, and say so
                        warnings.warn(problem, RuntimeWarning, stacklevel=3)
                    if training and self._dp is not None and on_stand_ins:
                        self._dp.discard_round()
                    agreed = self._agree_and_plan(step, desc, training)
                    self._outputs, self._losses = {}, {}
        except native.PeerAbort as exc:
            problem = self._restore_module_state()
            self._end_discovery(failed=True)
            self._restore_grads(stash, tied_stash)
            failed = PeerFailedError(f"rank {self.rank}: step {step} aborted because {self._peer_error(step)} "
                                     f"(noticed here: {exc}). The group is fine: zero the gradients and step again.")
            if problem:
                failed.add_note(problem)
            raise failed from None
        except native.CommError as exc:
            problem = self._restore_module_state()
            self._restore_grads(stash, tied_stash)  # what .grad held before the step survives a broken group
            self._discovery = None
            broke = self._group_broke(exc)
            if problem:
                broke.add_note(problem)
            raise broke from None
        except BaseException as exc:
            problem = self._restore_module_state()
            if problem:
                exc.add_note(problem)
            self._restore_grads(stash, tied_stash)
            also = self._executor.last_comm_failure
            if also:  # this rank's own error, and releasing its peers failed too: the group broke
                self._broken = also
                self._discovery = None
                raise CommunicationError(f"rank {self.rank}: step {step} failed ({type(exc).__name__}: {exc}), and "
                                         f"telling the other ranks failed too: {also}. A peer hung or died: rebuild "
                                         "the process group and the Pipeline.") from exc
            self._end_discovery(failed=True)
            raise
        finally:
            self._inputs = self._targets = self._stage_kwargs = None
            self._loss_kwargs = None
            self._loss_divisor = None
            done, self._outputs = self._outputs, {}  # a failed step's outputs die with the exception
        self._end_discovery(failed=False)
        self._rollback.finished()
        if training and self._dp is not None:
            self._dp.finish()  # the replicas' sums, before the mirrored and tied copies add theirs up
        if stash is not None:
            self._sum_mirrored_grads(stash)
        if tied_stash is not None:
            self._tied.sum_grads(tied_stash)
        if training:
            self._warn_split_fallbacks()
            self._pairs.warn_fallbacks()
        if self.trace_enabled:
            self._trace = [{"rank": self.rank, "step": step, "name": name, "start_us": t0, "end_us": t1, "lane": lane}
                           for name, t0, t1, lane in self._executor.trace()]
            if training and self._dp is not None:
                self._trace += [dict(e, step=step) for e in self._dp.trace()]
        if losses is not None and self._losses:  # replaced, as torch does
            losses[:] = [self._losses.get(mb) for mb in range(m)]
        result = None
        if done:
            with _range("pipecore.merge"):
                chunks = [done[mb] for mb in sorted(done)]
                result = merge(chunks) if self.output_merge_spec is None else merge_by_spec(chunks, self.output_merge_spec)
        self._losses = {}
        return result

    def _agree_and_plan(self, step: int, desc: int, training: bool) -> int:
        """All ranks agree on the batch signature; its plan is loaded, or this step learns it."""
        sig, failed = self._agree(desc, False, training)
        if failed:  # another rank's input checks failed on the first step of this mode
            raise InputError(f"rank {self.rank}: step {step} not run: {self._peer_error(step)}")
        if self._wants_reverse_channel and self._reverse_channel is None:
            self._open_reverse_channel()
        self._agreed[training] = sig
        if self.has_first:
            self._last_desc[training] = desc
        if (sig, training) in self._plans:
            self._ensure_loaded(sig, training)
            return sig
        flat, labels = self._programs[training]
        self._executor.set_program(flat, labels)
        self._executor.forget_specs()
        self._loaded = None
        self._discovery = Discovery(self, step, training)
        self._plans_in_use = self._discovery.plans
        return sig

    def _end_discovery(self, failed: bool) -> None:
        """After a step that learnt its batch shape's plan: the plan is kept once every rank ran the
        step (one small all-reduce); otherwise the next step learns it again."""
        discovery, self._discovery = self._discovery, None
        if discovery is None:
            return
        _, failed_somewhere = self._agree(0, failed, discovery.training, "agreeing whether every rank ran the step that learnt this "
                                                  "batch shape's messages")
        if failed_somewhere:
            self._agreed.pop(discovery.training, None)
            return
        key = (self._agreed[discovery.training], discovery.training)
        self._plans[key] = discovery.plans
        self._load(discovery.plans, discovery.training)
        self._loaded = key

    def _open_reverse_channel(self) -> None:
        """gloo: a second gloo group over these ranks for the messages that travel to a lower rank,
        so that a rank's sends never share a connection with the data it receives (see
        Executor.set_reverse_channel). It runs on the group's own gloo device: no extra thread. Opened
        right after an agreement, when every rank of the group is here to connect."""
        options = dist.ProcessGroupGloo._Options()
        options._devices = self.group._get_backend(torch.device("cpu")).options._devices
        options._timeout = timedelta(seconds=self.timeout)
        options._threads = 1  # its collective threads idle: only send and receive run on it
        store = dist.PrefixStore(f"pipecore/{self._uid}/reverse", self._store)
        try:
            channel = dist.ProcessGroupGloo(store, self.rank, self.world, options)
        except RuntimeError as exc:
            self._broken = str(exc)
            raise CommunicationError(f"rank {self.rank}: connecting the ranks' second gloo channel failed within "
                                     f"{self.timeout} s ({exc}); a rank hung or died: rebuild the process group"
                                     ) from None
        self._executor.set_reverse_channel(channel)
        self._reverse_channel = channel

    def _ensure_loaded(self, sig: int, training: bool) -> None:
        key = (sig, training)
        if self._loaded != key:
            self._load(self._plans[key], training)
            self._loaded = key

    def _restore_module_state(self) -> str:
        """After a run that does not count: RNG states and buffers back (pipecore/rollback.py). Returns
        why that failed ('' if it did not): the step's own error is the one to raise."""
        try:
            self._rollback.restore()
        except Exception as exc:  # noqa: BLE001
            return f"pipecore: the step's RNG states and buffers could not be put back: {type(exc).__name__}: {exc}"
        return ""

    def _run_aborted(self, status: int) -> None:
        try:
            self._executor.run_aborted(status)
        except _native().CommError as exc:
            raise self._group_broke(exc) from None

    def _group_broke(self, exc: Exception) -> CommunicationError:
        """The executor's wait timed out or a connection broke: no later step may run on this group."""
        self._broken = str(exc)
        return CommunicationError(f"{exc}. A peer hung or died: rebuild the process group and the Pipeline.")

    def _check_step_options(self, return_outputs, loss_kwargs, divisor) -> float | None:
        """Checks step()'s options; returns loss_divisor as a float (None where no last stage is)."""
        if divisor is not None and self.has_last:
            if isinstance(divisor, torch.Tensor) and divisor.numel() == 1 and not divisor.is_complex():
                divisor = float(divisor)
            if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or not 0 < divisor < float("inf"):
                raise InputError(f"rank {self.rank}: loss_divisor must be a positive number (the batch's token count, "
                                 f"for a loss_fn that returns a sum), got {divisor!r}")
        if not isinstance(return_outputs, bool):
            raise InputError(f"return_outputs must be True or False, got {return_outputs!r}")
        if loss_kwargs is not None and not isinstance(loss_kwargs, dict):
            raise InputError(f"loss_kwargs must be a dict of keyword arguments for loss_fn, got "
                             f"{type(loss_kwargs).__name__}")
        return divisor if self.has_last else None

    def _check_inputs(self, args, kwargs, target, training: bool) -> None:
        if training and not torch.is_grad_enabled():
            raise InputError(f"rank {self.rank}: step() computes gradients but was called under torch.no_grad(): "
                             "call eval() for forward passes only")
        if training and self.has_last and self.loss_fn is None:
            raise InputError(f"rank {self.rank} holds a last stage ({self._last_stages()}): training needs loss_fn")
        if self.has_first and not args and not kwargs:
            raise InputError(f"rank {self.rank} holds a first stage: step() needs the batch's inputs here")
        if not self.has_first and kwargs and self.keyword_inputs == "first_stage":
            raise InputError(f"rank {self.rank} holds no first stage (stages {[s.stage_index for s in self.stages]}): "
                             f"step()'s keyword arguments {sorted(kwargs)} would reach no stage. Pass them on the "
                             "ranks holding a first stage, or build the Pipeline with keyword_inputs='every_stage' "
                             "to give them to every stage of the rank they are given on (torch's rule)")
        if training and self.has_last and target is None and self.loss_fn is not None and self._loss_wants_target:
            raise InputError(f"rank {self.rank} holds a last stage ({self._last_stages()}): step() needs target= "
                             "for loss_fn(output, target) (or give a loss_fn that takes the output alone)")
        if training and self.has_first:
            for i, t in enumerate(tree_flatten((args, kwargs))[0]):
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                    raise InputError(
                        f"rank {self.rank}: step()'s input tensor {i} was computed with a gradient outside the "
                        f"pipeline (grad_fn {type(t.grad_fn).__name__}): each microbatch's backward would run through "
                        "that shared graph again. Compute it inside the first stage, or pass "
                        "x.detach().requires_grad_() and backward x's .grad into that graph after the step")

    def _last_stages(self) -> str:
        topo = self.schedule.topology
        return ", ".join(f"stage {s.stage_index}" for s in self.stages if topo.next_stage[s.stage_index] < 0)

    # -- failures shared between ranks -----------------------------------------------------
    def _store_key(self, step: int) -> str:
        return f"pipecore/{self._uid}/step{step}/error"

    def _publish_error(self, step: int, error: str, action: str) -> None:
        """First failing rank of a step: leave its error where the other ranks will look."""
        if self.world == 1 or self._uid is None:
            return
        text = f"rank {self.rank} failed in {action}: {error.strip().splitlines()[0] if error.strip() else error}"
        try:
            self._store.compare_set(self._store_key(step), "", text)
        except Exception:  # pragma: no cover - the store is best effort for the message only
            pass

    def _peer_error(self, step: int) -> str:
        try:
            self._store.wait([self._store_key(step)], timedelta(seconds=10))
            return self._store.get(self._store_key(step)).decode()
        except Exception:
            return "another rank failed (its error message did not arrive)"

    def _restore_grads(self, stash, tied_stash) -> None:
        """A failed step: the gradients set aside before it (dualpipe's, then the tied copies') go back."""
        if stash is not None:
            for s in self.stages:
                for name, p in s.module.named_parameters():
                    p.grad = stash.get((s.stage_index, name))
        if tied_stash is not None:
            self._tied.restore(tied_stash)

    def _split(self, args, kwargs, target):
        """Microbatches of the inputs (ranks with a first stage) and targets (with a last stage)."""
        m = self.num_microbatches
        inputs: dict[int, tuple[Any, Any]] = {}
        if self.has_first:
            if not args and not kwargs:
                raise ValueError(f"rank {self.rank} holds a first stage: step() needs its inputs")
            inputs = dict(enumerate(self._split_call(args, kwargs, self.args_chunk_spec)))
        self._stage_kwargs = None
        if self.keyword_inputs == "every_stage" and kwargs:  # torch's rule: every stage of this rank gets them
            parts = inputs.values() if inputs else self._split_call((), kwargs, None)
            self._stage_kwargs = [k for _, k in parts]
        targets: list | None = None
        self._rows = None
        if self.has_last and target is not None:
            targets = split(target, m, "target")
            if batch_size(target) is not None:
                self._rows = [batch_size(t) for t in targets]
        return inputs, targets

    def _split_call(self, args: tuple, kwargs: dict, args_chunk_spec) -> list[tuple[tuple, dict]]:
        """Per microbatch, (args, kwargs) of step()'s inputs: along dim 0, or as torch's chunk specs say."""
        m = self.num_microbatches
        if args_chunk_spec is None and self.kwargs_chunk_spec is None:
            return list(zip(split(args, m, "input"), split(kwargs, m, "keyword input")))
        return split_by_specs(args, kwargs, m, args_chunk_spec, self.kwargs_chunk_spec)

    def _agree(self, local_sig: int, failed: bool, training: bool,
               what: str = "waiting for every rank to reach step()") -> tuple[int, bool]:
        """One small all-reduce: the batch signature (did shapes change?), whether any rank's step
        failed, and how many ranks train (a rank in eval() while the others step() would wait for
        gradients that never come). The first one gathers instead, and checks that every rank runs
        the same program."""
        if self.world == 1:
            return local_sig, failed
        if self._uid is None:
            return self._first_agreement(local_sig, failed, training)
        sig, failed, trainers = self._collective(_native().all_reduce_sum, [local_sig, int(failed), int(training)],
                                                 what=what)
        if 0 < trainers < self.world:
            raise InputError(f"rank {self.rank}: {trainers} of the {self.world} ranks called step() and the others "
                             f"eval() (this rank: {'step' if training else 'eval'}()): every rank makes the same call")
        return sig, bool(failed)

    def _first_agreement(self, local_sig: int, failed: bool, training: bool) -> tuple[int, bool]:
        """The first agreement, gathered: besides the batch signature (summed as the all-reduce
        does) and the failure flags, group rank 0's nonce (which names this Pipeline's store keys)
        and each rank's program digest: ranks built with different schedules, microbatch counts or
        stage layouts fail here, at once, every one of them with the same message."""
        fields = [planning.signature(v) for v in self._program.values()]
        ties = sum(len(s.tied) for s in self.stages)
        rows = self._collective(_native().all_gather, [local_sig, int(failed), self._nonce, int(training), ties, *fields])
        any_ties = any(r[4] for r in rows)
        rows = [r[:4] + r[5:] for r in rows]
        nonce = rows[0][2]
        self._uid = f"{dist.distributed_c10d._get_process_group_name(self.group)}/{nonce:x}"
        if any(r[4:] != rows[0][4:] for r in rows):
            self._misbuilt = self._program_mismatch([r[4:] for r in rows])  # every later step says it again
            raise InputError(self._misbuilt)
        # tied weights: every rank learns the ties and the copies are made equal, before any forward
        try:
            self._tied = TiedWeights(self) if any_ties else None
        except InputError as exc:
            self._misbuilt = str(exc)  # every later step says it again
            raise
        if len({r[3] for r in rows}) > 1:
            calls = ", ".join(f"rank {r} {'step' if row[3] else 'eval'}()" for r, row in enumerate(rows))
            raise InputError(f"rank {self.rank}: the ranks made different calls ({calls}): every rank makes the same "
                             "call, step() or eval()")
        sig = (sum(r[0] for r in rows) + (1 << 63)) % (1 << 64) - (1 << 63)  # int64 wrap-around, as all_reduce
        return sig, any(r[1] for r in rows)

    def _program_mismatch(self, digests: list[list[int]]) -> str:
        """Names the ranks and what differs between their programs (their summaries via the store)."""
        import json

        key = f"pipecore/{self._uid}/program/rank"
        self._store.set(f"{key}{self.rank}", json.dumps(self._program))
        try:
            self._store.wait([f"{key}{r}" for r in range(self.world)], timedelta(seconds=min(self.timeout, 10)))
            theirs = [json.loads(self._store.get(f"{key}{r}")) for r in range(self.world)]
        except Exception:  # noqa: BLE001 - the digests still say which ranks differ
            theirs = None
        lines = []
        differ = [len({d[k] for d in digests}) > 1 for k in range(len(self._program))]
        if any(differ[:-1]):
            differ[-1] = False  # the lowered program differs because of what is named
        for k, name in enumerate(self._program):
            if name == "program" and differ[k]:
                lines.append("the lowered programs differ (the same schedule built differently: a custom Schedule or "
                             "other builder options)")
            elif differ[k]:
                if theirs is None:
                    groups: dict[int, list[int]] = {}
                    for r, d in enumerate(digests):
                        groups.setdefault(d[k], []).append(r)
                    lines.append(f"{name} differs between ranks {' / '.join(str(g) for g in groups.values())}")
                else:
                    lines.append(f"{name}: " + ", ".join(f"rank {r} {t[name]!r}" for r, t in enumerate(theirs)))
        return (f"rank {self.rank}: the ranks were built with different pipelines ({'; '.join(lines)}). Build the "
                "same Pipeline on every rank: the same schedule, num_microbatches and number of stages")

    def _collective(self, fn, *args, what: str = "waiting for every rank to reach step()", group=None):
        """One of the native small collectives (csrc/collectives.h says why they are native), over the
        pipeline's group or `group`."""
        native = _native()
        group = self.group if group is None else group
        try:
            return fn(group, *args, timeout=self.timeout, what=what,
                      **({} if fn in (native.exchange, native.all_reduce_tensor)
                         else {"device": str(self._comm_device(group))}))
        except native.CommError as exc:
            self._broken = str(exc)
            raise CommunicationError(f"{exc}; a rank hung or died: rebuild the process group") from None

    def _comm_device(self, group=None) -> torch.device:
        """Where this Pipeline's own small collectives run: CPU when the group has a CPU backend
        (gloo, also in "cpu:gloo,cuda:nccl"), else the stages' device."""
        group = self.group if group is None else group
        return torch.device("cpu") if _backend_of(group, torch.device("cpu")) else self.stages[0].device

    def _p2p_backend_is_gloo(self) -> bool:
        """Do the stages' messages go through gloo? Asked of the backend that serves the stages'
        device: a group made with "cpu:gloo,cuda:nccl" is gloo on CPU and NCCL on CUDA."""
        backend = _backend_of(self.group, self.stages[0].device)
        if backend is None:
            return dist.get_backend(self.group) == "gloo"
        backend = getattr(backend, "wrapped_pg", backend)  # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps it
        return dist.is_gloo_available() and isinstance(backend, dist.ProcessGroupGloo)

    def _load(self, plans: dict, training: bool) -> None:
        topo = self.schedule.topology
        flat, labels = self._programs[training]
        self._executor.set_program(flat, labels)
        self._plans_in_use = plans
        for s in self.stages:
            p = plans[s.stage_index]
            like = torch.empty(0, device=s.device)
            for mb in topo.microbatches[s.stage_index]:
                given, sent = p.inputs.get(mb), p.outputs.get(mb)
                self._executor.set_specs(self.local_index[s.stage_index], mb,
                                         given.meta_tensors() if given is not None else [],
                                         sent.meta_tensors() if sent is not None else [], like)

    def _forward(self, local: int, mb: int, received: list[torch.Tensor]):
        self._rollback.before_forward()
        stage = self.stages[local]
        s = stage.stage_index
        topo = self.schedule.topology
        if topo.prev_stage[s] < 0:
            args, kwargs = self._inputs[mb]
        else:
            args, kwargs = planning.as_call(self._plans_in_use[s].inputs[mb].decode(received))
            if self._stage_kwargs is not None:
                clash = sorted(set(kwargs) & set(self._stage_kwargs[mb]))
                if clash:
                    raise InputError(f"rank {self.rank}: stage {s} receives keyword inputs {clash} from stage "
                                     f"{topo.prev_stage[s]} and from step()'s keyword arguments: rename one")
                kwargs = {**kwargs, **self._stage_kwargs[mb]}
        try:
            wrapper = self._dp.wrapped.get(local) if self._dp is not None and self._training else None
            with wrapper.forward_context() if wrapper is not None else nullcontext():
                out = stage.forward(args, kwargs)
        except Exception as exc:
            shapes = [(tuple(t.shape), str(t.dtype)) for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)]
            exc.add_note(f"pipecore: raised by stage {s}'s forward of microbatch {mb} on rank {self.rank}, inputs "
                         f"{shapes}")
            if "leaf Variable that requires grad" in str(exc) and topo.prev_stage[s] >= 0:
                exc.add_note("pipecore: a stage's received inputs are leaves that need a gradient, so they cannot "
                             "be changed in place: write `h = h + x` instead of `h += x` (or clone the input first)")
            raise
        if topo.next_stage[s] >= 0:
            return self._message(local, mb, args, kwargs, out), None, 1.0
        if self._return_outputs:
            self._outputs[mb] = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
        loss = None
        seed = 1.0
        if self.loss_fn is not None and (self._training or self._targets is not None):
            with stage.autocast_context():
                if self._targets is not None:
                    loss = self.loss_fn(out, self._targets[mb], **self._loss_kwargs)
                else:
                    loss = self.loss_fn(out, **self._loss_kwargs)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                f"{' of shape ' + str(tuple(loss.shape)) if isinstance(loss, torch.Tensor) else ''}")
            self._losses[mb] = loss.detach()
            if self.check_finite and not torch.isfinite(loss.detach()).all():
                raise FloatingPointError(f"rank {self.rank}: loss of microbatch {mb} is {loss.item()} "
                                         "(check_finite=True)")
            if self.scale_grads or self._loss_divisor is not None:
                seed = self._loss_weight(mb)
            elif self._dp is not None:
                seed = 1.0 / self._dp.size
        if not self._training:
            loss = None
        return [], loss, seed

    def _message(self, local: int, mb: int, args, kwargs, out) -> list[torch.Tensor]:
        """What stage `local`'s output for `mb` sends to the next stage; on the first step of a batch
        shape its boundary is learnt here, on later steps the output is checked against it."""
        stage = self.stages[local]
        s = stage.stage_index
        nxt = self.schedule.topology.next_stage[s]
        what = f"rank {self.rank}: stage {s}'s output for microbatch {mb}"
        if out is None:
            raise InputError(f"{what} is None, but stage {nxt} takes it as its input: a stage returns what the next "
                             "stage takes (a tensor, or a tuple, list or dict of tensors and other values). Does its "
                             "forward miss a `return`?")
        leaves, spec = tree_flatten(out)
        if self._discovery is not None:
            problem = declared_mismatch(stage, args, kwargs, out)
            if problem is not None:
                raise InputError(f"{what} has {problem} (given as this stage's output_args)")
            boundary = planning.Boundary.of(out, what)
            tensors = boundary.encode(leaves, stage.device, what)
            self._discovery.learnt_output(local, mb, boundary)
        else:
            boundary = self._plans_in_use[s].outputs[mb]
            problem = boundary.mismatch(leaves, spec)
            if problem is not None:
                raise InputError(f"{what} has {problem}: stage {nxt} receives what the first step with this batch "
                                 "shape returned (a stage's output may change its shapes, dtypes, gradient flags or "
                                 "structure only with the batch's shapes)")
            tensors = boundary.encode(leaves, stage.device, what)
        # a view would keep its base alive after the send: send a viewless copy instead
        return [t.clone() if t._is_view() else t for t in tensors]

    def _loss_weight(self, mb: int) -> float:
        """This microbatch's share of the batch: n_mb / N (1/m when rows are unknown); with a
        loss_divisor (sum losses), 1 / loss_divisor."""
        if self._loss_divisor is not None:
            return 1.0 / self._loss_divisor
        dp = self._dp.size if self._dp is not None else 1  # the mean over replicas: their gradients are summed
        if self._rows:
            return self._rows[mb] / sum(self._rows) / dp
        return 1.0 / self.num_microbatches / dp

    # -- dualpipe: mirrored stages hold copies of one model stage ----------------------------
    def _stash_mirrored_grads(self):
        stash = {}
        for s in self.stages:
            for name, p in s.module.named_parameters():
                stash[(s.stage_index, name)] = p.grad
                p.grad = None
        return stash

    def _sum_mirrored_grads(self, stash) -> None:
        """Each mirrored parameter's .grad := what it held before the step + the two copies' gradients
        of this step. A parameter that neither copy got a gradient for keeps what it held (None if
        none), as one process leaves a parameter its forward never used: AdamW then skips it."""
        topo = self.schedule.topology
        R = self.world
        partner = R - 1 - self.rank
        by_model = sorted(self.stages, key=lambda s: topo.model_stage[s.stage_index])
        mine = []
        params = []
        for s in by_model:
            for name, p in s.module.named_parameters():
                if p.requires_grad:
                    params.append((s.stage_index, name, p))
                    mine.append((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1))
        if not params:  # the partner holds the same model stages: it has none either
            return
        # after the gradients, one flag per parameter: 1 where this copy got a gradient
        got = torch.tensor([p.grad is not None for _, _, p in params], dtype=mine[0].dtype, device=mine[0].device)
        flat = torch.cat(mine + [got])
        theirs = self._collective(_native().exchange, flat, partner,
                                  what=f"summing mirrored dualpipe gradients with rank {partner}")
        total = flat + theirs
        anyone_got = total[-len(params):].tolist()
        offset = 0
        for (stage_index, name, p), got_one in zip(params, anyone_got):
            n = p.numel()
            g = total[offset:offset + n].view_as(p).clone()
            offset += n
            prev = stash.get((stage_index, name))
            p.grad = prev if not got_one else g if prev is None else prev + g

    def __repr__(self) -> str:
        return (f"Pipeline(rank={self.rank}/{self.world}, stages={[s.stage_index for s in self.stages]}, "
                f"schedule={self.schedule.name!r}, microbatches={self.num_microbatches})")


def stage_list(stages) -> list[PipelineStage]:
    """The Pipeline's stages argument as a list of pipecore stages (torch.distributed.pipelining's
    stage objects converted: pipecore.stage.from_torch_stage), or a TypeError that says what was given."""
    if isinstance(stages, PipelineStage) or is_torch_stage(stages):
        stages = [stages]
    kind = type(stages)
    try:
        stages = list(stages)
    except TypeError:
        raise TypeError(f"stages must be a pipecore.PipelineStage (or torch.distributed.pipelining's) or a "
                        f"non-empty list of them, got {kind.__name__}") from None
    stages = [from_torch_stage(s) if is_torch_stage(s) else s for s in stages]
    wrong = [type(s).__name__ for s in stages if not isinstance(s, PipelineStage)]
    if not stages or wrong:
        raise TypeError(f"stages must be a pipecore.PipelineStage or a non-empty list of them, got "
                        f"{'an empty list' if not stages else 'a list holding ' + ', '.join(sorted(set(wrong)))}")
    return stages


def _pipeline_group(group, stages: list[PipelineStage]):
    """The pipeline's process group: `group`, or the one its stages were given (torch's way), or the
    default group."""
    given = {id(s.group): s.group for s in stages if s.group is not None}
    if len(given) > 1:
        raise ValueError(f"this rank's stages were given different process groups (stages "
                         f"{[s.stage_index for s in stages if s.group is not None]}): a pipeline runs over one group")
    if group is None:
        return next(iter(given.values()), dist.group.WORLD)
    if given and next(iter(given.values())) is not group:
        raise ValueError("Pipeline(group=...) differs from the group its stages were given: pass one of them, or "
                         "the same group to both")
    return group


def _backend_of(group, device: torch.device):
    """The backend `group` uses for tensors on `device`, or None if it has none for that device."""
    try:
        return group._get_backend(device)
    except RuntimeError:
        return None


def _takes_two_args(fn) -> bool:
    """Does loss_fn take (output, target)? (True when it cannot be told.)"""
    if fn is None:
        return False
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind in (p.VAR_POSITIONAL,) for p in params):
        return True
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) >= 2


def _forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards, in its order (same placement): what eval() runs."""
    rows = []
    for row in schedule.compute_only().actions:
        out = []
        for a in row:
            for leaf in a.leaves():
                if leaf.kind is Kind.F:
                    out.append(leaf)
        rows.append(out)
    topo = schedule.topology
    return Schedule._from_codes([[a.code for a in row] for row in rows], topo, (schedule.name or "") + ":forward")
