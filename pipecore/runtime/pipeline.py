"""`Pipeline`: runs a schedule over this rank's stages with the C++ executor: its configuration and
`step()`. What a step is made of lives beside it: the agreement between ranks (agreement.py), the
plans of what crosses each boundary (plans.py, discovery.py), the step's inputs and forward callback
(step.py), rollback, overlap and the I/W split; the gradients after a step are pipecore/training/
finalise.py's; every word to another rank goes through pipecore/executor/comm.py."""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

from pipecore.errors import CommunicationError, InputError
from pipecore.executor.comm import Comm, backend_of, who
from pipecore.executor.native import (DEFAULT_RECV_WINDOW, DEFAULT_SEND_BUDGET, MESSAGE_STATUS, C, CommError, PeerAbort,
                                      PeerReplan)
from pipecore.executor.program import encode, forward_only
from pipecore.runtime.agreement import Agreement, groups_named, shares_build_failure
from pipecore.runtime.doctor import Doctor
from pipecore.runtime.failures import group_broke, own_error, peer_failed
from pipecore.runtime.message_path import computes_on_stand_ins, configure_messages, describe_messages
from pipecore.runtime.nvtx_ranges import nvtx_range
from pipecore.runtime.overlap import PairRunner
from pipecore.runtime.plans import Plans
from pipecore.runtime.rollback import Rollback
from pipecore.runtime.split_backward import fallbacks, warn_new_fallbacks
from pipecore.runtime.step import StepInputs, StepRun, read_inputs
from pipecore.schedule import SCHEDULES, Schedule, build_schedule
from pipecore.schedule.lowering import add_unshard_reshard, check_residency
from pipecore.stage import boundary as wire
from pipecore.stage.microbatch import merge, merge_by_spec
from pipecore.stage.pipeline_stage import PipelineStage, pipeline_group, stage_list
from pipecore.training.data_parallel import DEFAULT_BUCKET_BYTES, DataParallel
from pipecore.training.finalise import GradFinalisation
from pipecore.training.ties import TiedWeights, check_shared_parameters
from pipecore.training.wrapped_stages import WrappedStage, WrapperEvents

DEFAULT_TIMEOUT_S = 300.0
# A warning about a step names the line that called step() or eval(): the stacklevel of warnings.warn
# in a phase of _run (the phase, _run, _train or _forward_only, the public method, its caller)
_STEP_CALLER = 5


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
    first step of each batch signature posts every receive at its own action (it learns the shapes).
    Early receives let a peer's data land while this rank computes; each holds its buffer that
    much longer.

    `send_budget`: bytes of sends in flight to one peer. A sent message is freed as soon as its
    transfer completes (small packed copies in bulk, once 1 MiB of them wait); a send that
    would exceed the budget first waits for earlier sends to that peer (a larger message goes
    alone). It bounds what a rank holds for a peer that is behind, e.g. a GPipe first stage whose
    sends would otherwise pile up.

    `max_active_stages`, `unshard_lookahead`: torch 2.15's FSDP2 residency (lowering.add_unshard_reshard).

    `dp_group`: data-parallel replicas of this pipeline (`pc.init_mesh(dp, pp).get_group("dp")`; see
    pipecore/training/data_parallel.py). Each replica steps its share of the global batch and `.grad` becomes
    the mean over replicas, reduced in buckets of `bucket_bytes` while the step's other backwards run;
    stages wrapped in torch DDP or FSDP2 reduce through their wrapper, and without `dp_group` the
    group their wrapper reduces over is taken (as torch's schedules do). A failure on any replica fails
    the step on all of them and leaves `.grad` as it was before the step.

    `overlap_f_b`: how the two halves of dualpipe's OVERLAP_F_B pairs run, the backward on a second
    thread: "lockstep" (taking turns at `pipecore.overlap_handoff()` points inside the model),
    "concurrent" (at once; only for halves that share no process group), "sequential" (as torch),
    or a callable(pair) that decides (see pipecore/runtime/overlap.py).

    `keyword_inputs`: which stages get step()'s keyword arguments (split into microbatches like the
    inputs): "first_stage" (a first stage's, with the positional inputs; on a rank without one they
    are refused), or "every_stage" (every stage of the rank they were given on, after what it
    received: torch.distributed.pipelining's rule, e.g. TorchTitan's attention masks; pipecore.compat
    uses it). A later stage's output shapes are learnt from the first step of each shape of the
    first stages' inputs: keyword arguments that change another stage's output shapes on their own fail
    the step's output check.

    `variable_shapes`: whether messages carry their tensors' shapes, so that microbatches may change
    shapes at every step (and differ within one) without a new plan (docs/training.md, "Microbatches
    of their own shapes"). None (default): on gloo yes; on NCCL no: each batch shape gets its plan at
    its first step, and steps run with no host wait for messages (docs/cuda.md). True on NCCL: every message goes at its boundary's
    capacity (the most elements it carried so far), the host reads each received message's header
    (one small device-to-host copy, started when the receive is posted, waited for by the action that
    consumes it), and a message that outgrows its capacity follows on a communicator of its own (only
    in the steps that grow a capacity; docs/cuda.md). False: per-shape plans on gloo too.

    `group` defaults to the group the stages were given (`PipelineStage(..., group=)`, torch's way), else
    the default group. `args_chunk_spec`, `kwargs_chunk_spec` and `output_merge_spec` mean what they
    mean in torch.distributed.pipelining (its `TensorChunkSpec`s; None: tensors split and merged along
    dim 0). `stages` may also be torch.distributed.pipelining's own `PipelineStage` objects: each is
    converted to pipecore's (same module, index, device, group and dw_builder; pipecore.compat).

    On a gloo `group`, the first step also opens a second gloo connection between the group's
    ranks (on the group's own gloo device): messages to a lower rank travel on it, so that a rank's
    sends never share a connection with the data it receives.

    Besides the configuration given, a Pipeline shows what it built, for tools, benchmarks and tests:
    `comm` (its communication service, pipecore/executor/comm.py), `gradients` (the gradient
    finalisation: `.dp` the data-parallel replicas, `.ties` the tied weights), `programs` ({True:
    training, False: eval} the executor's program of this rank), `plans` (what crosses each stage
    boundary, per batch signature: plans.py) and `executor` (this rank's `pipecore._C.Executor`: not a stable API);
    gloo's second connection, once opened, is `comm.reverse_channel`.
    """

    @shares_build_failure(lambda **arguments: groups_named(**arguments))  # its error reaches the other ranks
    def __init__(self, stages: PipelineStage | Sequence[PipelineStage], schedule: str | Schedule,
                 num_microbatches: int, loss_fn: Callable | None = None, group=None, scale_grads: bool = True,
                 timeout: float | None = None, trace: bool = False, *, check_finite: bool = False,
                 recv_window: int = DEFAULT_RECV_WINDOW, send_budget: int = DEFAULT_SEND_BUDGET,
                 dp_group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap_f_b: str | Callable = "lockstep",
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                 keyword_inputs: str = "first_stage", variable_shapes: bool | None = None, max_active_stages: int = 3,
                 unshard_lookahead: int | None = None):
        if not dist.is_initialized():
            raise RuntimeError("Pipeline needs torch.distributed: call dist.init_process_group first")
        stages = stage_list(stages)
        wrapped = [s.stage_index for s in stages if s.dw_builder is not None and WrappedStage.is_wrapped(s.module)]
        if wrapped:
            raise ValueError(f"stages {wrapped} have a dw_builder and a DDP/FSDP2-wrapped module: the wrapper reduces "
                             "the gradients its autograd hooks see, not those a dw_builder's runner computes. Drop the "
                             "dw_builder (pipecore splits the backward itself) or the wrapper")
        self.group = pipeline_group(group, stages)
        self.rank, self.who = dist.get_rank(self.group), who(self.group)  # who: this rank in errors
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
            raise ValueError(f"{self.who} must hold stages {mine} under {schedule.name or 'this'} schedule's "
                             f"{schedule.placement} placement, but was given stages {given}")
        schedule.compute_only().validate()
        self.schedule = schedule
        self.stages = sorted(stages, key=lambda s: s.stage_index)
        self.stage_by_index = {s.stage_index: s for s in self.stages}
        check_shared_parameters(self.stages)
        local_index = {s.stage_index: i for i, s in enumerate(self.stages)}
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
        if not 0 < self.timeout < float("inf"):  # (not NaN either)
            raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
        if isinstance(recv_window, bool) or not isinstance(recv_window, int) or recv_window < 0:
            raise ValueError(f"recv_window must be an integer >= 0 (receives posted ahead), got {recv_window!r}")
        if isinstance(send_budget, bool) or not isinstance(send_budget, int) or send_budget < 0:
            raise ValueError(f"send_budget must be an integer >= 0 (bytes in flight per peer), got {send_budget!r}")
        check_residency(max_active_stages, unshard_lookahead)
        topo = schedule.topology
        for s in self.stages:  # is_first/is_last as this schedule says (dualpipe: two first and two last stages)
            s.place(first=topo.prev_stage[s.stage_index] < 0, last=topo.next_stage[s.stage_index] < 0)
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        device = self.stages[0].device
        self.comm = Comm(self.group, self.timeout, device)  # talks to the other ranks (pipecore/executor/comm.py)
        # data-parallel replicas (pipecore/training/data_parallel.py): checked here, before any communication
        given = dp_group is not None
        if dp_group is None:  # DDP/FSDP2 stages know the group they reduce over (this rank alone included)
            dp_group = WrappedStage.common_group([s.module for s in self.stages])
        if dp_group is None:
            for s in self.stages:  # a DDP/FSDP2 stage nested in a stage module is refused with the fix
                WrappedStage.of(s.module, None)
        # DDP/FSDP2 stages are driven by the step's events at any dp size; replicas (a group of more
        # ranks, or one given) also exchange their buckets and flags. A wrapper over this rank alone
        # adds no collective: the pipeline's other ranks may hold plain stages
        self._wrappers = WrapperEvents(self.stages, dp_group) if dp_group is not None else None
        if self._wrappers is not None and not self._wrappers.wrapped:
            self._wrappers = None
        replicas = dp_group is not None and (given or dist.get_world_size(dp_group) > 1)
        self._dp = DataParallel(self.comm, self.stages, dp_group, bucket_bytes,
                                self._wrappers.wrapped if self._wrappers is not None else {}) if replicas else None
        self.gradients = GradFinalisation(self.comm, self.stages, topo, self._dp, self._wrappers)
        lowered = {True: schedule.lower(), False: forward_only(schedule).lower()}
        self._trains = schedule.has_backward  # a forward-only schedule serves eval() only
        # FSDP2 stages get UNSHARD/RESHARD in this rank's row only, after lowering: they do not communicate
        # within the pipeline, and the sends and receives must be placed alike on every rank (lowering
        # with them places those differently). The ranks agree below on the program without them.
        run = dict(lowered)
        if self._wrappers is not None and self._wrappers.sharded:
            rows = [list(row) for row in lowered[True].codes]
            rows[self.rank] = add_unshard_reshard(rows[self.rank], self._wrappers.sharded, max_active_stages,
                                                  unshard_lookahead)
            run[True] = Schedule.from_codes(rows, lowered[True].topology, lowered[True].name)
        self.programs = {training: encode(v, self.rank, local_index) for training, v in run.items()}
        self.executor = self.comm.attach(C.Executor(self.group, len(self.stages), num_microbatches, self.timeout,
                                                    self.who))  # (Comm.exchange goes on its messages' path)
        for s in self.stages:
            nxt, prv = topo.next_stage[s.stage_index], topo.prev_stage[s.stage_index]
            self.executor.set_links(
                local_index[s.stage_index],
                local_index[nxt] if nxt >= 0 and topo.stage_rank[nxt] == self.rank else -1,
                local_index[prv] if prv >= 0 and topo.stage_rank[prv] == self.rank else -1)
        # on an accelerator, action times come from events on its stream (one device wait per traced step)
        self.executor.set_trace(bool(trace), str(device))
        self.executor.set_profile(bool(trace))
        gloo = self.comm.p2p_is_gloo()
        configure_messages(self.executor, gloo, device, self.who, recv_window, send_budget, variable_shapes,
                           self.timeout, backend_of(self.group, device))
        # what every rank must agree on before the first step (checked at the first agreement)
        summary = {
            "schedule": schedule.name or "a custom Schedule",
            "microbatches": num_microbatches,
            "stages": schedule.num_stages,
            "placement": f"{schedule.placement} (stage -> rank {list(topo.stage_rank)})",
            "messages": describe_messages(self.executor),
            "program": wire.signature([[str(a) for a in row] for v in lowered.values() for row in v.actions]),
        }
        self._rollback = Rollback([s.module for s in self.stages], [s.device for s in self.stages])
        # how OVERLAP_F_B pairs run (pipecore/runtime/overlap.py)
        self._pairs = PairRunner(self.executor, self.stages, self.programs[True].labels, overlap_f_b)
        self._set_weight_builders()
        self._gloo = gloo  # (its channels: Comm.open_channels)
        self._trace: list[dict] = []
        self._profile: dict[str, float] = {}  # the last step's, with trace (profile())
        self._step_started = 0.0
        self._warned_fallbacks: set[tuple[int, tuple]] = set()
        self._step_count = 0
        # building a Pipeline is no collective (ranks may build different numbers of them): the ties are
        # learnt at the first agreement; alone, now
        ties = sum(len(s.tied) for s in self.stages)
        gradients, comm, stages = self.gradients, self.comm, self.stages

        def learn_ties(any_ties: bool) -> None:  # not a bound method: the Pipeline would hold itself in a
            # cycle, and one freed only by the cycle collector (maybe at exit) keeps its threads and group
            gradients.ties = TiedWeights(comm, stages, topo) if any_ties else None
        self._agreement = Agreement(self.comm, summary, ties, learn_ties, self._dp)
        self.plans = Plans(self._agreement, self.executor, self.stages, topo, self.programs)
        if self.world == 1:
            learn_ties(ties > 0)
        if self._dp is not None:
            self._dp.attach(self.executor, self.programs[True], summary)
        if self._wrappers is not None:
            self._wrappers.attach(self.executor)
        self._doctor = Doctor(self, lowered)  # says why a step failed on a wait (pipecore/runtime/doctor.py)

    def _set_weight_builders(self) -> None:
        """Stages with torch's dw_builder: whole backward at I, the builder's runner at W."""
        local = [i for i, s in enumerate(self.stages) if s.dw_builder is not None]
        if local:
            # weakly: the executor's callbacks are invisible to Python's cycle collector, and a builder
            # may hold what holds this Pipeline
            me = weakref.ref(self)
            self.executor.set_weight_builders(local, lambda i: me().stages[i].dw_builder())

    # -- public -------------------------------------------------------------------------
    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, loss_divisor: float | torch.Tensor | None = None,
             finalize_gradients: bool = True, **kwargs):
        """One training step over `num_microbatches` microbatches (see the class doc).

        `loss_divisor` (read on ranks holding a last stage): `loss_fn` returns a sum over a
        microbatch's tokens (e.g. `cross_entropy(..., reduction="sum", ignore_index=-100)`) and each
        microbatch's gradient is divided by `loss_divisor`, the batch's token count (e.g.
        `(target != -100).sum()`), so `.grad` equals single-process `loss_fn(whole batch) / N` even
        when microbatches hold different numbers of tokens; it replaces the row-share weighting of
        `scale_grads`. `losses` still holds what `loss_fn` returned. With `dp_group`, `loss_divisor`
        is the token count of the whole global batch (every replica's: all-reduce it over the dp
        group) and the replicas' gradients are summed. `finalize_gradients`: step.check_finalize_gradients."""
        return self._train(args, kwargs, target, losses, return_outputs, loss_kwargs, loss_divisor,
                           finalize_gradients=finalize_gradients)

    def step_microbatches(self, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                          target_mbs: list | None = None, losses: list | None = None, return_outputs: bool = True,
                          loss_kwargs: dict | None = None, loss_divisor: float | torch.Tensor | None = None,
                          finalize_gradients: bool = True):
        """One training step over microbatches split by the caller, as torch's `_step_microbatches`:
        `arg_mbs` (ranks with a first stage) a list of `num_microbatches` tuples of positional
        inputs, `kwarg_mbs` their keyword inputs, `target_mbs` (ranks with a last stage) their
        targets; each microbatch may have its own shapes, which may change at every step. The other
        options as in `step`; with `scale_grads`, a microbatch's loss is weighted by its target's
        share of the rows, or 1/num_microbatches without targets (torch's rule; give `loss_divisor`
        for a mean over tokens). Returns the last stage's outputs as a list, one per microbatch (as
        `losses`: dualpipe's two last stages each fill theirs, None elsewhere)."""
        return self._train((), {}, target_mbs, losses, return_outputs, loss_kwargs, loss_divisor, (arg_mbs, kwarg_mbs),
                           finalize_gradients)

    def _train(self, args, kwargs, target, losses, return_outputs, loss_kwargs, loss_divisor, microbatches=None,
               finalize_gradients: bool = True):
        if not self._trains:  # every rank has this schedule: each raises here
            raise InputError(f"step() trains, but schedule {self.schedule.name!r} has no backward: call "
                             "pipe.eval(...) for forward-only runs, or build the Pipeline with a training schedule "
                             f"(one of {[n for n in SCHEDULES if n != 'forward_only']})")
        self._step_started = time.perf_counter()
        with nvtx_range("pipecore.step"):
            try:
                self.gradients.begin_step()
                out = self._run(args, kwargs, target, losses, True, return_outputs, loss_kwargs, loss_divisor,
                                microbatches, finalize_gradients)
            except BaseException as exc:
                self.gradients.abandon(exc)  # .grad as before the step, on every failure path
                raise
            self._end_profile()
            return out

    def eval(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, **kwargs):
        """Forward only (no gradients); losses are computed when a target and loss_fn are given."""
        return self._forward_only(args, kwargs, target, losses, return_outputs, loss_kwargs)

    def eval_microbatches(self, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                          target_mbs: list | None = None, losses: list | None = None, return_outputs: bool = True,
                          loss_kwargs: dict | None = None):
        """Forward only over microbatches split by the caller (see `step_microbatches`)."""
        return self._forward_only((), {}, target_mbs, losses, return_outputs, loss_kwargs, (arg_mbs, kwarg_mbs))

    def _forward_only(self, args, kwargs, target, losses, return_outputs, loss_kwargs, microbatches=None):
        self._step_started = time.perf_counter()
        with nvtx_range("pipecore.eval"), torch.no_grad():
            out = self._run(args, kwargs, target, losses, False, return_outputs, loss_kwargs, None, microbatches)
        self._end_profile()
        return out

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's stages' parameters, each once (two stages of a rank may hold one, e.g. a tied
        embedding under zbv): what the optimizer takes, as `model.parameters()` in one process."""
        return list({id(p): p for s in self.stages for p in s.module.parameters()}.values())

    def trace(self) -> list[dict]:
        """This rank's actions of the last step: name ("PP:1F0"), start_us and end_us on the
        host's monotonic clock (shared by all processes of one machine). Needs trace=True. On an
        accelerator the times are when the action's work ran on the device's current stream
        (events), placed on the host clock by one device wait at the start of each traced step."""
        if not self.trace_enabled:
            raise RuntimeError("tracing is off: create the Pipeline with trace=True")
        return list(self._trace)

    def profile(self) -> dict[str, float]:
        """Where this rank's host time went in the last step (or eval), in microseconds. Needs
        trace=True. `step`: the whole call; `before_run`: Python before the executor runs (input
        checks, microbatch split, plans, gradients set aside; where a batch changed shape, also the
        run that told the ranks and their agreement); `run`: the executor, split into `loop`
        (its own dispatch and bookkeeping), `forward` (the forward callbacks, of which `model` is
        the stages' forwards and loss_fn), `backward` (the autograd engine), `post` (framing and
        posting messages) and `wait` (for messages, sends in flight); `after_run`: Python after it
        (gradient finalisation, outputs); `actions`: the program's actions. The other half of an
        OVERLAP_F_B pair runs on a thread of its own: its time shows as `wait` or `loop`. `tracing`:
        making this step's trace(), which steps without trace=True do not pay."""
        if not self.trace_enabled:
            raise RuntimeError("profiling is off: create the Pipeline with trace=True")
        return dict(self._profile)

    def flight_record(self) -> dict:
        """What this rank does now and did last, always kept (callable from any thread, as while a step
        is stuck): `step`; `phase` (idle, agreement, discovery, run, abort, finalise, data-parallel
        reduction), `phase_seconds`; `action` (None, or `label`, `seconds`, `part`: executor, forward,
        backward, posting, waiting; `halves`: an OVERLAP_F_B pair's other half, on a thread of its own,
        as its `part`, `seconds` in it and `stack`); `waiting` (None, or `peer`, `microbatch`, `what`, `send`,
        `seconds`); `failed_wait` (the run's failed wait, with its `action`); `last` (the last 32 actions:
        label, seconds ago, seconds); `in_flight` (messages this run posted, not seen complete, oldest
        first: `label`, `peer`, `send`, `follow_up`, `bytes`, `seconds` since posted; `in_flight_unlisted`:
        more, pushed out by the last 256); `discovery`; `stack` (the step's thread in Python). A step failing
        on a wait says on every rank what these say together (pipecore/runtime/doctor.py)."""
        return self._doctor.record()

    def _end_profile(self) -> None:
        if self.trace_enabled and self._profile:
            p = self._profile
            p["step"] = (time.perf_counter() - self._step_started) * 1e6
            p["after_run"] = p["step"] - p["before_run"] - p["run"] - p["tracing"]

    @property
    def split_backward_fallbacks(self) -> dict[int, dict[tuple[str, str], int]]:
        """Per stage of this rank, since this Pipeline was built: {(node, why): microbatches} whose
        input backward (I) also computed weight gradients because that autograd node cannot be split
        (see pipecore.runtime.split_backward); a shared parameter is named as "parameter fc.weight (shape
        [8, 8])". Stages whose backward split cleanly are absent, and so are microbatches the
        program runs as one B (where no other rank waits for the I)."""
        return fallbacks(self.executor, self.stages)

    @property
    def overlap_fallbacks(self) -> dict[str, int]:
        """Since this Pipeline was built: {why: pairs} of OVERLAP_F_B pairs that ran in sequence
        although `overlap_f_b` overlaps them (see pipecore.runtime.overlap). The first step of each batch
        shape, which runs every pair in sequence, is not counted."""
        return self._pairs.fallbacks

    @property
    def overlapped_pairs(self) -> int:
        """Since this Pipeline was built: OVERLAP_F_B pairs run on two threads under the concurrent
        or lockstep rules (pairs a hook runs half by half are not counted, nor those of the first
        step of each batch signature, which runs them in sequence)."""
        return self.executor.overlapped_pairs

    # -- step ---------------------------------------------------------------------------
    def _run(self, args, kwargs, target, losses, training: bool, return_outputs: bool, loss_kwargs,
             loss_divisor=None, microbatches: tuple | None = None, finalize_gradients: bool = True):
        """One step (or eval) on this rank, in the phases every rank goes through in the same order."""
        self._check_usable()
        step = self.comm.step = self._step_count
        self._step_count += 1
        self._doctor.begin_step(step)
        try:
            inputs, problem = self._check(args, kwargs, target, training, return_outputs, loss_kwargs,
                                          loss_divisor, microbatches, finalize_gradients)
            if problem is not None:
                self._release_peers(problem, training)
            self._plan(step, inputs, training)
            run = self._start(inputs, training, return_outputs, loss_kwargs)
            run_started = self._execute(step, run, inputs, training)
            self._doctor.set_phase("finalise")
            self._finalise(training)
        finally:
            self._doctor.end_step()
        if self.trace_enabled:
            self._record_trace(step, run, run_started, training)
        return self._assemble_outputs(run, losses, microbatches)

    def _check_usable(self) -> None:
        if self._agreement.misbuilt is not None:
            raise InputError(self._agreement.misbuilt)
        if self.comm.broken is not None:
            raise CommunicationError(f"{self.who}: this Pipeline's process group broke in an earlier step "
                                     f"({self.comm.broken}); rebuild the group and the Pipeline before stepping again")

    def _check(self, args, kwargs, target, training, return_outputs, loss_kwargs, loss_divisor,
               microbatches, finalize_gradients=True) -> tuple[StepInputs | None, Exception | None]:
        """Everything that can be checked before communicating (step.py): (the step's inputs, None), or
        (None, what is wrong), which the peers must learn before it is raised."""
        try:
            return read_inputs(self, args, kwargs, target, training, return_outputs, loss_kwargs, loss_divisor,
                               microbatches, finalize_gradients), None
        except (ValueError, TypeError) as exc:
            return None, exc

    def _release_peers(self, problem: Exception, training: bool) -> NoReturn:
        """This rank's inputs failed their checks: its peers learn it, then it is raised here."""
        agreed = self.plans.agreed.get(training)
        if agreed is None:  # first step of this mode: the ranks agree on shapes anyway (and learn the store keys)
            self._agreement(0, True, training)
        self.comm.publish_error(f"{type(problem).__name__}: {problem}", "input checks")
        if agreed is not None:  # they get "aborted" messages instead of data
            self.plans.ensure_loaded(agreed, training)
            self._run_aborted(MESSAGE_STATUS["ABORTED"])
        raise problem

    def _plan(self, step: int, inputs: StepInputs, training: bool) -> None:
        """What crosses every boundary. It is agreed on once per batch signature (plans.py; on gloo
        shapes are not part of it, messages carry them): a first stage whose batch changed signature
        tells its peers by running the step as "shapes changed" messages, then all ranks agree again;
        no collective runs while the signature stays the same."""
        plans = self.plans
        agreed = plans.agreed.get(training)
        if agreed is not None and self.has_first and inputs.signature != plans.last_desc.get(training):
            plans.ensure_loaded(agreed, training)
            self._run_aborted(MESSAGE_STATUS["REPLAN"])
            if training and computes_on_stand_ins(self.executor) and self.world > 1:
                self.gradients.discard_round()  # as the ranks that compute on its stand-ins do
            agreed = None
        if agreed is None:
            self._agree_and_plan(step, inputs.signature, inputs.rows, training)
        else:
            plans.ensure_loaded(agreed, training)

    def _start(self, inputs: StepInputs, training: bool, return_outputs: bool, loss_kwargs) -> StepRun:
        """The step as the executor's forward callback sees it; the gradients set aside right before it runs."""
        self.executor.batch_rows = inputs.rows if self.has_first else -1
        run = StepRun(self, self.plans, inputs.batch, training, return_outputs, loss_kwargs, inputs.loss_divisor,
                      self._wrappers.wrapped if self._wrappers is not None else {},
                      self._dp.size if self._dp is not None else 1, self._rollback.before_forward)
        if training:
            self.gradients.set_aside()
        self._profile = {}
        return run

    def _execute(self, step: int, run: StepRun, inputs: StepInputs, training: bool) -> float:
        """Runs the program until a run counts (the first step of a batch signature learns its plan:
        pipecore/runtime/discovery.py); returns when that run started. A run that failed raises the
        error its kind of failure calls for (pipecore/runtime/failures.py)."""
        plans = self.plans
        try:
            while True:
                # RNG states and buffers go back if this run does not count (pipecore/runtime/rollback.py)
                self._rollback.arm(learn=plans.discovery is not None)
                on_stand_ins = computes_on_stand_ins(self.executor) and plans.discovery is None
                started = time.perf_counter()  # profile(): a run that did not count is before the run
                try:
                    self.executor.run(run.forward, self.comm.publish_error,
                                      plans.discovery.answer if plans.discovery is not None else None)
                    return started
                except PeerReplan:  # a first stage's batch changed shape: agree, then run again
                    self._replan(step, inputs, training, on_stand_ins)
                    run.restart()
        except PeerAbort as exc:
            raise peer_failed(step, exc, self._rollback.restore_or_explain(), self.comm, plans) from None
        except CommError as exc:
            raise group_broke(exc, self._rollback.restore_or_explain(), self.comm, plans, step,
                              lambda: self._doctor.explain(step)) from exc.__cause__  # (the backend's text)
        except BaseException as exc:
            broke = own_error(step, exc, self._rollback.restore_or_explain(), self.comm, plans, self.executor)
            if broke is not None:
                raise broke from exc
            raise

    def _replan(self, step: int, inputs: StepInputs, training: bool, on_stand_ins: bool) -> None:
        """A peer's batch changed shape during the run: its state put back, the ranks agree again."""
        problem = self._rollback.restore_or_explain()
        if problem:  # the peers are agreeing already: run again, and say so
            warnings.warn(problem, RuntimeWarning, stacklevel=_STEP_CALLER + 1)
        if training and on_stand_ins:
            self.gradients.discard_round()
        self._agree_and_plan(step, inputs.signature, inputs.rows, training)

    def _finalise(self, training: bool) -> None:
        """The run counted on this rank: the plan it learnt is kept (an agreement), the saved module
        state dropped, and a training step's gradients finished."""
        self.plans.end_discovery(failed=False)
        self._rollback.finished()
        if training:
            # the replicas', mirrors' and ties' sums (pipecore/training/finalise.py). Once they are in,
            # the step happened on every rank: what fails below (merging outputs, a warning raised as an
            # error) leaves .grad with the step's gradients, as on the other ranks
            self.gradients.finish(self._doctor.set_phase)
            warn_new_fallbacks(self.executor, self.stages, self._warned_fallbacks, stacklevel=_STEP_CALLER + 1)
            self._pairs.warn_fallbacks(stacklevel=_STEP_CALLER + 1)

    def _record_trace(self, step: int, run: StepRun, run_started: float, training: bool) -> None:
        """trace() and profile() of this step."""
        tracing = time.perf_counter()
        self._trace = [{"rank": self.rank, "step": step, "name": name, "start_us": t0, "end_us": t1, "lane": lane}
                       for name, t0, t1, lane in self.executor.trace()]
        if training and self._dp is not None:
            self._trace += [dict(e, step=step) for e in self._dp.trace()]
        self._profile = {**self.executor.profile(), "model": run.model_seconds * 1e6,
                         "actions": float(len(self.programs[training].labels)),
                         "before_run": (run_started - self._step_started) * 1e6,
                         "tracing": (time.perf_counter() - tracing) * 1e6}

    def _assemble_outputs(self, run: StepRun, losses: list | None, microbatches: tuple | None):
        """`losses` filled (replaced, as torch does) and the last stages' outputs merged."""
        if losses is not None and run.losses:
            losses[:] = [run.losses.get(mb) for mb in range(self.num_microbatches)]
        if not run.outputs:
            return None
        with nvtx_range("pipecore.merge"):
            if microbatches is not None:  # one per microbatch (dualpipe: None where the other direction's ended)
                return [run.outputs.get(mb) for mb in range(self.num_microbatches)]
            chunks = [run.outputs[mb] for mb in sorted(run.outputs)]
            return merge(chunks) if self.output_merge_spec is None else merge_by_spec(chunks, self.output_merge_spec)

    def _agree_and_plan(self, step: int, desc: int, rows: int, training: bool) -> None:
        """All ranks agree on the batch signature; its plan is loaded, or this step learns it."""
        sig, failed = self.plans.agree(desc, training, self.has_first, rows)
        if failed:  # another rank's input checks failed on the first step of this mode
            raise InputError(f"{self.who}: step {step} not run: {self.comm.peer_error()}")
        messages = sorted({p for v in self.programs.values() for p in v.peers()})
        self.comm.open_channels(self.executor, self._gloo, messages, sorted(self.gradients.exchange_peers()))
        self.gradients.make_ties_equal()  # (once: its exchanges go on the communicators just connected)
        self.plans.plan(sig, training)

    def _run_aborted(self, status: int) -> None:
        try:
            self.executor.run_aborted(status)
        except CommError as exc:
            raise self.comm.abandon_group(exc) from exc.__cause__

    def __repr__(self) -> str:
        return (f"Pipeline(rank={self.rank}/{self.world}, stages={[s.stage_index for s in self.stages]}, "
                f"schedule={self.schedule.name!r}, microbatches={self.num_microbatches})")

