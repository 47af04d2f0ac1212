"""torch.distributed.pipelining.schedules' classes, run by pipecore's executor.

Each class takes the constructor arguments of torch's class of the same name and builds a
`pipecore.Pipeline` over the same stages and group; `step()` and `eval()` have torch's signature
and meaning. Keyword arguments torch does not have (`timeout=`, `trace=`, `overlap_f_b=`,
`dp_group=`, ...) go to the Pipeline. The differences from torch are listed in the README's
migration section; the one that can change numbers: `scale_grads=True` weights each microbatch by
its share of the batch rows (torch divides by the number of microbatches, the same when the batch
splits evenly) and never rescales gradients accumulated before the step.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

from pipecore.compat._fallback import torch_fallback
from pipecore.errors import InputError
from pipecore.schedule import Schedule, ScheduleError, build_schedule
from pipecore.schedule.lowering import check_residency
from pipecore.stage.pipeline_stage import PipelineStage, is_torch_stage

__all__ = ["_PipelineSchedule", "PipelineScheduleSingle", "PipelineScheduleMulti", "_PipelineScheduleRuntime",
           "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
           "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "ScheduleDualPipe",
           "get_schedule_class"]


class _PipelineSchedule:
    """What every schedule class shares: torch's constructor fields, step() and eval()."""

    _schedule_name: str | None = None  # the pipecore schedule this class runs; None: loaded from a CSV

    def __init__(self, stages: list, n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False, runtime_options=None,
                 **pipeline_options):
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
        if not backward_requires_autograd:
            raise ValueError("backward_requires_autograd=False is for torch's register_custom_function backwards; "
                             "pipecore's backward always runs through autograd")
        _check_pipeline_options(type(self).__name__, pipeline_options)
        self._stages = stages
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._has_backward = loss_fn is not None  # torch: without a loss_fn, step() runs forwards only
        self._scale_grads = scale_grads
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self._num_stages = stages[0].num_stages
        self.pp_group_size = stages[0].group_size
        self.rank = stages[0].group_rank
        # torch's defer_pp_recv posts each receive when its action runs: pipecore's recv_window=0
        self._pipeline_options = dict(pipeline_options)
        if defer_pp_recv:
            self._pipeline_options.setdefault("recv_window", 0)
        self._defer_reduce_grad_wait = False
        if runtime_options is not None:  # torch 2.15's _PipelineScheduleRuntime arguments
            self._take_runtime_options(**runtime_options)
        self.pipeline: Any = None  # the pipecore.Pipeline that runs the steps
        self.schedule: Schedule | None = None  # its compute-only schedule
        if self._schedule_name is not None:
            self._build(build_schedule(self._schedule_name, self.pp_group_size, n_microbatches, len(stages)))

    def _take_runtime_options(self, max_active_stages=3, unshard_lookahead="full", defer_reduce_grad_wait=False,
                              max_outstanding_sends=None) -> None:
        """torch 2.15's arguments of the multi-stage schedules, with torch's checks: `max_active_stages` and
        `unshard_lookahead` place this rank's FSDP2 UNSHARD/RESHARD as torch's do (Pipeline's options of the
        same names); `defer_reduce_grad_wait` places WAIT_REDUCE_GRAD in the schedules this class shows and
        writes (pipeline_order_with_comms, _dump_csv): pipecore's executor starts each reduction at
        REDUCE_GRAD and has all of them done by the end of step() either way; `max_outstanding_sends`
        (a count) is refused: pipecore bounds the sends in flight to a peer in bytes (send_budget)."""
        self._pipeline_options.setdefault("max_active_stages", max_active_stages)
        self._pipeline_options.setdefault("unshard_lookahead", _unshard_lookahead_of(
            unshard_lookahead, self.rank, self.pp_group_size, max_active_stages))
        if not isinstance(defer_reduce_grad_wait, bool):
            raise TypeError(f"defer_reduce_grad_wait must be True or False, got {defer_reduce_grad_wait!r}")
        self._defer_reduce_grad_wait = defer_reduce_grad_wait
        if max_outstanding_sends is not None:
            if isinstance(max_outstanding_sends, bool) or not isinstance(max_outstanding_sends, int) \
                    or max_outstanding_sends < 0:
                raise ValueError("max_outstanding_sends must be a non-negative integer")
            from pipecore.executor.native import DEFAULT_SEND_BUDGET

            raise InputError(
                f"max_outstanding_sends={max_outstanding_sends} caps torch's pending send batches per rank; pipecore's "
                "executor frees each send as soon as it completes (a thread per peer waits for them) and bounds what "
                "is in flight to each peer in bytes: pass send_budget=<bytes> (default "
                f"{DEFAULT_SEND_BUDGET}; 0: one message in flight per peer) instead")

    @property
    def scale_grads(self) -> bool:
        """torch's attribute, read at every step (set it to change the next steps)."""
        return self._scale_grads

    @scale_grads.setter
    def scale_grads(self, value: bool) -> None:
        self._scale_grads = value
        if self.pipeline is not None:
            self.pipeline.scale_grads = value

    def _build(self, schedule: Schedule) -> None:
        from pipecore.runtime.pipeline import Pipeline

        self.schedule = schedule
        self.pipeline = Pipeline(self._stages, schedule, self._n_microbatches, loss_fn=self._loss_fn,
                                 scale_grads=self.scale_grads, args_chunk_spec=self._args_chunk_spec,
                                 kwargs_chunk_spec=self._kwargs_chunk_spec,
                                 output_merge_spec=self._output_merge_spec, keyword_inputs="every_stage",
                                 **self._pipeline_options)

    @property
    def pipeline_order(self) -> dict[int, list]:
        """{rank: its compute actions in order}, as torch's `_Action`s."""
        return _torch_actions(self.schedule) if self.schedule is not None else {}

    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
             target_mbs: list | None = None, finalize_gradients: bool = True, **kwargs):
        """One iteration over the whole batch, as torch's `step`: inputs on the rank(s) holding a first
        stage, `target` on those holding a last stage; `losses` is filled with the per-microbatch losses
        there; keyword arguments go to every stage of this rank; returns the merged last-stage outputs
        there (`return_outputs`), None elsewhere. Without a `loss_fn` it runs the forwards only, as
        torch does.

        Or, in the keyword form of a newer torch that TorchTitan calls, the microbatches the caller
        split: `arg_mbs` (a tuple of positional inputs per microbatch, on ranks with a first stage),
        `kwarg_mbs` (a dict per microbatch) and `target_mbs` (ranks with a last stage), as
        `_step_microbatches` takes them; it returns the outputs as a list, one per microbatch.

        `finalize_gradients` (torch 2.15): False changes nothing on stages that are not FSDP2, as in
        torch, and is refused on FSDP2 stages (Pipeline.step)."""
        if _microbatches_given("step", args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs):
            return self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs,
                                           finalize_gradients)
        pipe = self._pipeline()
        if not self._has_backward:  # (torch's forwards keep a graph nothing will use; these build none)
            return pipe.eval(*args, target=target, losses=losses, return_outputs=return_outputs,
                             loss_kwargs=loss_kwargs, **kwargs)
        return pipe.step(*args, target=target, losses=losses, return_outputs=return_outputs,
                         loss_kwargs=loss_kwargs, finalize_gradients=finalize_gradients, **kwargs)

    def eval(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
             target_mbs: list | None = None, **kwargs):
        """Forward passes only, as torch's `eval`: losses are computed where a target and loss_fn are.
        Or over the caller's microbatches, in the keyword form TorchTitan's validator calls (as `step`)."""
        if _microbatches_given("eval", args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs):
            return self._pipeline().eval_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses=losses,
                                                      return_outputs=return_outputs, loss_kwargs=loss_kwargs)
        return self._pipeline().eval(*args, target=target, losses=losses, return_outputs=return_outputs,
                                     loss_kwargs=loss_kwargs, **kwargs)

    def _step_microbatches(self, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                           target_mbs: list | None = None, losses: list | None = None, return_outputs: bool = True,
                           loss_kwargs: dict | None = None, finalize_gradients: bool = True):
        """torch's: one iteration over microbatches the caller split (`Pipeline.step_microbatches`:
        each microbatch may have its own shapes, at every step); returns the last stage's outputs as
        a list (torch's returns None and keeps them on its stage)."""
        pipe = self._pipeline()
        if not self._has_backward:
            return pipe.eval_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses=losses,
                                          return_outputs=return_outputs, loss_kwargs=loss_kwargs)
        return pipe.step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses=losses, return_outputs=return_outputs,
                                      loss_kwargs=loss_kwargs, finalize_gradients=finalize_gradients)

    def _pipeline(self):
        if self.pipeline is None:
            how = ("load one with _load_csv(path), or use" if isinstance(self, PipelineScheduleMulti)
                   else "it is a base class: use")
            raise RuntimeError(f"{type(self).__name__} has no schedule to run: {how} a schedule class from "
                               "get_schedule_class(name)")
        return self.pipeline

    def _write_csv(self, filename, lowered: bool) -> None:
        if self.schedule is None:
            raise RuntimeError(f"{type(self).__name__} has no schedule yet: load one with _load_csv(path)")
        (self._lowered() if lowered else self.schedule).to_csv(filename)

    def _lowered(self) -> Schedule:
        """The schedule with its communication, as torch shows and writes it: with torch 2.15's waits
        where this torch has them (its compute_comms CSVs must hold them)."""
        return self.schedule.lower(waits=torch_has_waits(), defer_reduce_grad_wait=self._defer_reduce_grad_wait)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.pipeline!r})"


class PipelineScheduleSingle(_PipelineSchedule):
    """torch's base of schedules with one stage per rank: takes `stage`, one stage."""

    def __init__(self, stage, n_microbatches: int, loss_fn: Callable | None = None, args_chunk_spec=None,
                 kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True, **pipeline_options):
        if isinstance(stage, (list, tuple)):
            raise TypeError(f"{type(self).__name__} takes one stage (stage=...), got a {type(stage).__name__} of "
                            f"{len(stage)}: for several stages per rank use a multi-stage schedule such as "
                            "ScheduleInterleaved1F1B")
        stages = _pipecore_stages([stage], type(self).__name__)
        self._stage = stages[0]  # torch's attribute
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, **pipeline_options)


class PipelineScheduleMulti(_PipelineSchedule):
    """torch's base of schedules with a list of stages per rank. Built directly, it runs the schedule
    that `_load_csv` loads (a compute-only CSV, as torch's)."""

    def __init__(self, stages: Sequence, n_microbatches: int, loss_fn: Callable | None = None, args_chunk_spec=None,
                 kwargs_chunk_spec=None, output_merge_spec=None, use_full_backward: bool | None = None,
                 scale_grads: bool = True, backward_requires_autograd: bool = True, **pipeline_options):
        # use_full_backward: deprecated in torch and ignored there too
        super().__init__(_pipecore_stages(stages, type(self).__name__), n_microbatches, loss_fn, args_chunk_spec,
                         kwargs_chunk_spec, output_merge_spec, scale_grads, backward_requires_autograd,
                         **pipeline_options)

    def _load_csv(self, filename: str | os.PathLike, format: str = "compute_only") -> None:
        """Runs the schedule in `filename` (torch's CSV: one row per rank, one action per cell), checked
        by pipecore's validator, from the next step on."""
        if format != "compute_only":
            raise ValueError(f'{type(self).__name__}._load_csv takes format="compute_only" (as torch), got {format!r}; '
                             '_PipelineScheduleRuntime also loads "compute_comms"')
        self._load(filename, lowered=False)

    def _load(self, filename, lowered: bool) -> None:
        schedule = Schedule.from_csv(filename, num_stages=self._num_stages, num_microbatches=self._n_microbatches)
        if schedule.is_lowered and not lowered:
            raise ScheduleError(f"{filename} holds communication actions: load it with format=\"compute_comms\" "
                                "(_PipelineScheduleRuntime), or drop them for format=\"compute_only\"")
        # pipecore places the sends and receives itself (batched per peer, never deadlocking): a
        # compute_comms CSV gives the compute order
        self._build(schedule.compute_only())

    def _dump_csv(self, filename: str | os.PathLike) -> None:
        """Writes the compute-only schedule in torch's CSV format."""
        self._write_csv(filename, lowered=False)


class _PipelineScheduleRuntime(PipelineScheduleMulti):
    """torch's runtime for schedules given as action lists; `_load_csv` also takes "compute_comms"."""

    def __init__(self, stages: Sequence, n_microbatches: int, loss_fn: Callable | None = None, args_chunk_spec=None,
                 kwargs_chunk_spec=None, output_merge_spec=None, use_full_backward: bool | None = None,
                 scale_grads: bool = True, backward_requires_autograd: bool = True, *, defer_pp_recv: bool = False,
                 max_active_stages: int = 3, unshard_lookahead: str | tuple[int, ...] = "full",
                 defer_reduce_grad_wait: bool = False, max_outstanding_sends: int | None = None, **pipeline_options):
        # torch's takes PipelineScheduleMulti's arguments (use_full_backward: ignored there too), and torch
        # 2.15's runtime options (_take_runtime_options)
        runtime = dict(max_active_stages=max_active_stages, unshard_lookahead=unshard_lookahead,
                       defer_reduce_grad_wait=defer_reduce_grad_wait, max_outstanding_sends=max_outstanding_sends)
        _PipelineSchedule.__init__(self, _pipecore_stages(stages, type(self).__name__), n_microbatches, loss_fn,
                                   args_chunk_spec, kwargs_chunk_spec, output_merge_spec, scale_grads,
                                   backward_requires_autograd, defer_pp_recv, runtime, **pipeline_options)

    def _load_csv(self, filename: str | os.PathLike, format: str = "compute_only") -> None:
        """Runs the schedule in `filename`: "compute_only" (compute actions) or "compute_comms" (with
        SEND/RECV actions: pipecore keeps the compute order and places the communication itself)."""
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(f"format={format!r} is not implemented (compute_only or compute_comms)")
        self._load(filename, lowered=format == "compute_comms")

    def _dump_csv(self, filename: str | os.PathLike, format: str = "compute_comms") -> None:
        """Writes the schedule in torch's CSV format: "compute_comms" with pipecore's lowering (the
        sends and receives it runs), or "compute_only"."""
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(f"format={format!r} is not implemented (compute_only or compute_comms)")
        self._write_csv(filename, lowered=format == "compute_comms")

    def register_custom_function(self, computation_type, custom_function) -> None:
        """torch's hook for running an action kind with the user's function (TorchTitan registers one
        for OVERLAP_F_B). Its functions drive torch's stage internals, which pipecore does not have:
        refused, with pipecore's way to do the same."""
        raise NotImplementedError(
            f"register_custom_function({computation_type!r}, ...) drives torch's stage internals, which pipecore "
            "does not have. For OVERLAP_F_B pairs pass overlap_f_b= to the schedule (\"lockstep\", \"concurrent\", "
            "or a callable(pair) that calls pair.run_forward() and pair.run_backward()) and call "
            "pipecore.overlap_handoff() around the model's communication (pipecore/runtime/overlap.py)")

    @property
    def pipeline_order_with_comms(self) -> dict[int, list]:
        """{rank: every action it runs, communication included} (pipecore's lowering)."""
        return _torch_actions(self._lowered()) if self.schedule is not None else {}


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: all forwards, then all backwards."""

    _schedule_name = "gpipe"


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: one forward, one backward."""

    _schedule_name = "1f1b"


class _BuiltSchedule(_PipelineScheduleRuntime):
    """A multi-stage schedule class of torch's: its constructor arguments (no use_full_backward)."""

    def __init__(self, stages: Sequence, n_microbatches: int, loss_fn: Callable | None = None, args_chunk_spec=None,
                 kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False, max_active_stages: int = 3,
                 unshard_lookahead: str | tuple[int, ...] = "full", *, defer_reduce_grad_wait: bool = False,
                 max_outstanding_sends: int | None = None, **pipeline_options):
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec, None,
                         scale_grads, backward_requires_autograd, defer_pp_recv=defer_pp_recv,
                         max_active_stages=max_active_stages, unshard_lookahead=unshard_lookahead,
                         defer_reduce_grad_wait=defer_reduce_grad_wait, max_outstanding_sends=max_outstanding_sends,
                         **pipeline_options)


class ScheduleInterleaved1F1B(_BuiltSchedule):
    """Interleaved 1F1B (Megatron's virtual pipeline): several stages per rank, loop placement."""

    _schedule_name = "interleaved_1f1b"


class ScheduleInterleavedZeroBubble(_BuiltSchedule):
    """Interleaved zero bubble (ZB1P): the backward split into I and W."""

    _schedule_name = "interleaved_zb"


class ScheduleZBVZeroBubble(_BuiltSchedule):
    """Zero bubble V: two stages per rank, V placement."""

    _schedule_name = "zbv"


class ScheduleDualPipeV(_BuiltSchedule):
    """DualPipeV (DeepSeek): two stages per rank, V placement, overlapped forward/backward pairs."""

    _schedule_name = "dualpipev"


class ScheduleDualPipe(_BuiltSchedule):
    """DualPipe (DeepSeek; not in torch): both directions at once, stage R+j holding a copy of model
    stage j (pipecore's "dualpipe")."""

    _schedule_name = "dualpipe"


class ScheduleLoopedBFS(_PipelineScheduleRuntime):
    """Looped BFS: several stages per rank, each stage runs all its microbatches before the next."""

    _schedule_name = "looped_bfs"

    def __init__(self, stages: Sequence, n_microbatches: int, loss_fn: Callable | None = None,
                 output_merge_spec=None, scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False, max_active_stages: int = 3, unshard_lookahead: str | tuple[int, ...] = "full",
                 *, defer_reduce_grad_wait: bool = False, max_outstanding_sends: int | None = None,
                 **pipeline_options):  # torch's takes no chunk specs
        super().__init__(stages, n_microbatches, loss_fn, None, None, output_merge_spec, None, scale_grads,
                         backward_requires_autograd, defer_pp_recv=defer_pp_recv, max_active_stages=max_active_stages,
                         unshard_lookahead=unshard_lookahead, defer_reduce_grad_wait=defer_reduce_grad_wait,
                         max_outstanding_sends=max_outstanding_sends, **pipeline_options)


_BY_NAME = {
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "GPipe": ScheduleGPipe,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "PipelineScheduleSingle": PipelineScheduleSingle,
    "PipelineScheduleMulti": PipelineScheduleMulti,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
    "DualPipe": ScheduleDualPipe,
}


def _microbatches_given(call: str, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs) -> bool:
    """Did step()/eval() get the caller's microbatches (the keyword form) rather than a batch?"""
    if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
        return False
    if args or kwargs or target is not None:
        raise TypeError(f"{call}() takes a batch (inputs, target=, keyword inputs) or its microbatches (arg_mbs=, "
                        "kwarg_mbs=, target_mbs=), not both")
    return True


def get_schedule_class(schedule_name: str) -> type:
    """The schedule class for `schedule_name` (case insensitive), as torch's get_schedule_class:
    "1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
    "DualPipeV", "PipelineScheduleSingle", "PipelineScheduleMulti", and pipecore's "DualPipe"."""
    if not isinstance(schedule_name, str):
        raise TypeError(f"schedule_name must be a str, got {type(schedule_name).__name__}")
    lower = {k.lower(): k for k in _BY_NAME}
    if schedule_name.lower() not in lower:
        raise ValueError(f"Unknown schedule name '{schedule_name}'. The valid options are {list(_BY_NAME)}")
    return _BY_NAME[lower[schedule_name.lower()]]


def _pipecore_stages(stages, schedule: str) -> list[PipelineStage]:
    """A multi-stage schedule's list of this rank's stages, as the Pipeline takes them (torch's converted)."""
    from pipecore.stage.pipeline_stage import stage_list

    if isinstance(stages, PipelineStage) or is_torch_stage(stages):
        raise TypeError(f"{schedule} takes a list of this rank's stages, got one {type(stages).__name__}: pass "
                        f"[stage]")
    stages = list(stages)
    if not stages:
        raise ValueError(f"{schedule} needs this rank's stages, got an empty list")
    return stage_list(stages)


# Pipeline arguments the schedule classes set themselves (the stages' group is the pipeline's, as in torch)
_SET_BY_SCHEDULE = {"stages", "schedule", "num_microbatches", "loss_fn", "scale_grads", "args_chunk_spec",
                    "kwargs_chunk_spec", "output_merge_spec", "group", "keyword_inputs"}


def _check_pipeline_options(schedule: str, options: dict) -> None:
    """Keywords torch's class does not take go to pipecore.Pipeline: refused here, not at the first build."""
    from pipecore.runtime.pipeline import Pipeline

    known = set(inspect.signature(Pipeline.__init__).parameters) - {"self"} - _SET_BY_SCHEDULE
    unknown = sorted(set(options) - known)
    if "group" in options:
        raise TypeError(f"{schedule} runs over the group its stages were given: pass group= to PipelineStage")
    if unknown:
        raise TypeError(f"{schedule} got unexpected keyword arguments {unknown}: it takes torch's arguments and "
                        f"pipecore.Pipeline's options {sorted(known)}")


def _unshard_lookahead_of(lookahead, rank: int, ranks: int, max_active_stages) -> int:
    """This rank's count of FSDP2 stages all-gathered ahead, from torch 2.15's unshard_lookahead (its
    rules and checks): "full" is max_active_stages, "auto" min(rank + 2, max_active_stages) (earlier
    ranks wait longer for their first inputs), or a tuple of one count per pipeline rank."""
    check_residency(max_active_stages, None)
    if lookahead == "full":
        return max_active_stages
    if lookahead == "auto":
        return min(rank + 2, max_active_stages)
    if not isinstance(lookahead, tuple):
        raise ValueError(f"unshard_lookahead must be 'full', 'auto', or a tuple of {ranks} integers, got {lookahead!r}")
    if len(lookahead) != ranks:
        raise ValueError(f"unshard_lookahead tuple length must equal the pipeline degree ({ranks}), got "
                         f"{len(lookahead)}")
    for r, n in enumerate(lookahead):
        check_residency(max_active_stages, n, name=f"unshard_lookahead[{r}]")
    return lookahead[rank]


def torch_has_waits() -> bool:
    """Does this torch know 2.15's WAIT_SEND_F, WAIT_SEND_B and WAIT_REDUCE_GRAD actions?"""
    from torch.distributed.pipelining.schedules import _ComputationType

    return hasattr(_ComputationType, "WAIT_SEND_F")


def _torch_actions(schedule: Schedule) -> dict[int, list]:
    """{rank: actions} as torch.distributed.pipelining's `_Action`s (pipecore's strings are torch's)."""
    from torch.distributed.pipelining.schedules import _Action

    return {rank: [_Action.from_str(str(a)) for a in row] for rank, row in enumerate(schedule.actions)}


# torch's names that pipecore does not run (its _Action, _ComputationType, ...): torch's own
__getattr__ = torch_fallback("torch.distributed.pipelining.schedules", __name__)
