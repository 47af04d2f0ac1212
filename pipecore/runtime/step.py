"""One step's inputs and the forward the executor calls back for each action F.

`read_inputs` is what a rank does with a step's arguments before any rank communicates:
`check_inputs` and `check_step_options` say what is wrong with them, `split_batch` cuts them into
microbatches, and a first stage's batch gets its signature. `StepRun` holds one step's state (its
microbatches, the outputs and losses it keeps) and is the executor's forward callback: it runs a
stage's forward, returns the message for the next stage (learning its boundary on the first step of
a batch signature, checking it after), or the loss and the weight its backward is seeded with.
"""

from __future__ import annotations

import inspect
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from pipecore.errors import InputError
from pipecore.executor.native import CommError
from pipecore.runtime.discovery import declared_mismatch
from pipecore.runtime.nvtx_ranges import nvtx_range
from pipecore.stage import boundary as wire
from pipecore.stage.microbatch import batch_size, split, split_by_specs, split_sizes


@dataclass
class Batch:
    """A step's arguments, per microbatch."""

    inputs: dict[int, tuple[Any, Any]]  # first stages: microbatch -> (args, kwargs)
    targets: list | None  # last stages
    rows: list[int] | None  # the targets' rows per microbatch, where they have a batch dimension
    stage_kwargs: list[dict] | None  # keyword_inputs="every_stage": each microbatch's, for every stage


@dataclass
class StepInputs:
    """A step's arguments as the rest of the step takes them."""

    batch: Batch
    signature: int  # ranks with a first stage: the batch's signature (plans.py); 0 elsewhere
    rows: int  # the batch's rows where step() split it along dim 0, else 0
    loss_divisor: float | None  # step()'s, checked (None where no last stage is)


def read_inputs(pipe, args, kwargs, target, training: bool, return_outputs, loss_kwargs, loss_divisor,
                microbatches: tuple | None, finalize_gradients: bool = True) -> StepInputs:
    """Checks a step's arguments (InputError, or torch's ValueError or TypeError) and splits them;
    `microbatches`: step_microbatches' (arg_mbs, kwarg_mbs), else None."""
    if microbatches is not None:  # the caller's own microbatches
        args, kwargs = microbatches_as_call(pipe, *microbatches)
    check_inputs(pipe, args, kwargs, target, training)
    parted = pipe.gradients.ties.parted if pipe.gradients.ties else None
    if parted is not None:  # found at the last step's gradient sum: every rank fails this step
        raise InputError(f"{pipe.who}: {parted}")
    loss_divisor = check_step_options(pipe, return_outputs, loss_kwargs, loss_divisor)
    check_finalize_gradients(pipe, finalize_gradients)
    check_not_capturing(pipe)
    with nvtx_range("pipecore.split"):
        batch = split_batch(pipe, args, kwargs, target, given=microbatches is not None)
    signature = rows = 0
    if pipe.has_first:
        if microbatches is None and pipe.args_chunk_spec is None and pipe.kwargs_chunk_spec is None:
            rows = batch_size((args, kwargs)) or 0  # split along dim 0
        # the batch's signature: its shapes, or where messages carry them (and the batch's rows,
        # which the last stages weigh losses by), its structure
        shaped = pipe.executor.shapes_travel
        signature = wire.signature((wire.describe(args, shaped), wire.describe(kwargs, shaped), training))
    return StepInputs(batch, signature, rows, loss_divisor)


def check_not_capturing(pipe) -> None:
    """A step is not something a CUDA graph can hold: it posts NCCL groups and reads on the host what
    arrived (message headers, the step's status at its end), which capture refuses or records wrong."""
    if any(s.device.type == "cuda" for s in pipe.stages) and torch.cuda.is_current_stream_capturing():
        raise InputError(f"{pipe.who}: step() was called while a CUDA graph is being captured. A pipeline step "
                         "posts NCCL groups and reads on the host what arrived, which a graph cannot hold: capture "
                         "inside the stages' modules (torch.compile(mode='reduce-overhead'), torch.cuda.graphs), "
                         "not around the step")


def check_finalize_gradients(pipe, finalize: bool) -> None:
    """torch 2.15's step(finalize_gradients=False): nothing to do but on FSDP2 stages, which pipecore
    reduces at every step's REDUCE_GRAD (what deferring their reduction would change: refused)."""
    if finalize:  # (read as torch reads it: its truth)
        return
    wrapped = pipe._wrappers.wrapped if pipe._wrappers is not None else {}
    sharded = [pipe.stages[local].stage_index for local, adapter in sorted(wrapped.items()) if adapter.sharded]
    if sharded:
        raise InputError(
            f"{pipe.who}: finalize_gradients=False asks to defer the FSDP2 gradient reduction of stages "
            f"{sharded} to a later step(); pipecore reduces FSDP2 stages at every step's REDUCE_GRAD, and the "
            "sharded gradients of several step() calls add up to the same gradients (the sum, reduced per step): "
            "call step() without finalize_gradients for each step you accumulate")


def check_step_options(pipe, return_outputs, loss_kwargs, divisor) -> float | None:
    """Checks step()'s options; returns loss_divisor as a float (None where no last stage is)."""
    if divisor is not None and pipe.has_last:
        if isinstance(divisor, torch.Tensor) and divisor.numel() == 1 and not divisor.is_complex():
            divisor = float(divisor)
        if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or not 0 < divisor < float("inf"):
            raise InputError(f"{pipe.who}: loss_divisor must be a positive number (the batch's token count, "
                             f"for a loss_fn that returns a sum), got {divisor!r}")
    if not isinstance(return_outputs, bool):
        raise InputError(f"return_outputs must be True or False, got {return_outputs!r}")
    if loss_kwargs is not None and not isinstance(loss_kwargs, dict):
        raise InputError(f"loss_kwargs must be a dict of keyword arguments for loss_fn, got "
                         f"{type(loss_kwargs).__name__}")
    return divisor if pipe.has_last else None


def check_inputs(pipe, args, kwargs, target, training: bool) -> None:
    if training and not torch.is_grad_enabled():
        raise InputError(f"{pipe.who}: step() computes gradients but was called under torch.no_grad(): "
                         "call eval() for forward passes only")
    if training and pipe.has_last and pipe.loss_fn is None:
        raise InputError(f"{pipe.who} holds a last stage ({_last_stages(pipe)}): training needs loss_fn")
    if pipe.has_first and not args and not kwargs:
        raise InputError(f"{pipe.who} holds a first stage: step() needs the batch's inputs here")
    if not pipe.has_first and kwargs and pipe.keyword_inputs == "first_stage":
        raise InputError(f"{pipe.who} holds no first stage (stages {[s.stage_index for s in pipe.stages]}): "
                         f"step()'s keyword arguments {sorted(kwargs)} would reach no stage. Pass them on the "
                         "ranks holding a first stage, or build the Pipeline with keyword_inputs='every_stage' "
                         "to give them to every stage of the rank they are given on (torch's rule)")
    if training and pipe.has_last and target is None and pipe.loss_fn is not None and takes_two_args(pipe.loss_fn):
        raise InputError(f"{pipe.who} holds a last stage ({_last_stages(pipe)}): step() needs target= "
                         "for loss_fn(output, target) (or give a loss_fn that takes the output alone)")
    if training and pipe.has_first:
        for i, t in enumerate(tree_flatten((args, kwargs))[0]):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                raise InputError(
                    f"{pipe.who}: step()'s input tensor {i} was computed with a gradient outside the "
                    f"pipeline (grad_fn {type(t.grad_fn).__name__}): each microbatch's backward would run through "
                    "that shared graph again. Compute it inside the first stage, or pass "
                    "x.detach().requires_grad_() and backward x's .grad into that graph after the step")


def microbatches_as_call(pipe, arg_mbs, kwarg_mbs) -> tuple[tuple, dict]:
    """step_microbatches' inputs checked, as the call that `split_batch(..., given=True)` takes
    apart: ((each microbatch's positional inputs, each one's keyword inputs), {})."""
    m = pipe.num_microbatches
    if pipe.has_first and arg_mbs is None and kwarg_mbs is None:
        raise InputError(f"{pipe.who} holds a first stage: step_microbatches() needs arg_mbs (or kwarg_mbs) here")
    if not pipe.has_first and pipe.keyword_inputs == "first_stage":
        if kwarg_mbs:
            raise InputError(f"{pipe.who} holds no first stage: kwarg_mbs would reach no stage (see step())")
        return ((), ()), {}
    arg_mbs = _per_microbatch(arg_mbs, m, "arg_mbs", ()) if pipe.has_first else [()] * m
    kwarg_mbs = _per_microbatch(kwarg_mbs, m, "kwarg_mbs", {})
    args = [tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in arg_mbs]
    for mb, k in enumerate(kwarg_mbs):
        if not isinstance(k, dict):
            raise InputError(f"kwarg_mbs[{mb}] must be a dict of keyword inputs, got {type(k).__name__}")
    return (tuple(args), tuple(kwarg_mbs)), {}


def _per_microbatch(values, m: int, what: str, empty) -> list:
    if values is None:
        return [empty] * m
    if not isinstance(values, (list, tuple)) or len(values) != m:
        raise InputError(f"{what} must be a list of one entry per microbatch ({m}), got "
                         f"{len(values) if isinstance(values, (list, tuple)) else type(values).__name__}")
    return list(values)


def split_batch(pipe, args, kwargs, target, given: bool = False) -> Batch:
    """Microbatches of the inputs (ranks with a first stage) and targets (with a last stage); `given`:
    the caller's own microbatches (`microbatches_as_call`) and a list of targets."""
    m = pipe.num_microbatches
    inputs: dict[int, tuple[Any, Any]] = {}
    if given:
        parts = list(zip(*args)) if args[0] or args[1] else []
    if pipe.has_first:
        inputs = dict(enumerate(parts if given else _split_call(pipe, args, kwargs, pipe.args_chunk_spec)))
    stage_kwargs = None
    if pipe.keyword_inputs == "every_stage" and (any(k for _, k in parts) if given else kwargs):
        # torch's rule: every stage of this rank gets them
        parts = parts if given else inputs.values() if inputs else _split_call(pipe, (), kwargs, None)
        stage_kwargs = [k for _, k in parts]
    targets, rows = None, None
    if pipe.has_last and target is not None:
        targets = _per_microbatch(target, m, "target_mbs", None) if given else split(target, m, "target")
        if all(batch_size(t) is not None for t in targets):
            rows = [batch_size(t) for t in targets]
    return Batch(inputs, targets, rows, stage_kwargs)


def _split_call(pipe, args: tuple, kwargs: dict, args_chunk_spec) -> list[tuple[tuple, dict]]:
    """Per microbatch, (args, kwargs) of step()'s inputs: along dim 0, or as torch's chunk specs say."""
    m = pipe.num_microbatches
    if args_chunk_spec is None and pipe.kwargs_chunk_spec is None:
        return list(zip(split(args, m, "input"), split(kwargs, m, "keyword input")))
    return split_by_specs(args, kwargs, m, args_chunk_spec, pipe.kwargs_chunk_spec)


def _last_stages(pipe) -> str:
    topo = pipe.schedule.topology
    return ", ".join(f"stage {s.stage_index}" for s in pipe.stages if topo.next_stage[s.stage_index] < 0)


def takes_two_args(fn) -> bool:
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


def _viewless(t: torch.Tensor) -> torch.Tensor:
    """A view would keep its base alive after the send: a viewless copy goes instead."""
    return t.clone() if t._is_view() else t


class StepRun:
    """One step (or eval) as the executor runs it: `forward` is its callback for every F."""

    def __init__(self, pipe, plans, batch: Batch, training: bool, return_outputs: bool, loss_kwargs: dict | None,
                 loss_divisor: float | None, wrapped: dict, dp_size: int, before_forward):
        """`plans`: the Pipeline's `Plans` (a step that replans reads the new one); `wrapped`: local
        stage -> its DDP/FSDP2 adapter (its forward context); `dp_size`: data-parallel replicas."""
        self._pipe = pipe
        self._plans = plans
        self._batch = batch
        self._training = training
        self._return_outputs = return_outputs
        self._loss_kwargs = loss_kwargs or {}
        self._loss_divisor = loss_divisor
        self._wrapped = wrapped
        self._dp_size = dp_size
        self._before_forward = before_forward
        self._rows: tuple[list[int], int] | None = None  # (rows per microbatch, their sum), once known
        self.outputs: dict[int, Any] = {}  # last stages: microbatch -> output (detached), if asked
        self.losses: dict[int, torch.Tensor] = {}  # last stages: microbatch -> loss (detached)
        # traced steps: seconds in the stages' forwards and loss_fn (Pipeline.profile's `model`)
        self._clock = time.perf_counter if pipe.trace_enabled else None
        self.model_seconds = 0.0

    def restart(self) -> None:
        """The step runs again (a peer's batch changed shape): what it kept goes, and the batch rows
        (agreed again) are read again."""
        self.outputs, self.losses = {}, {}
        self._rows = None

    def forward(self, local: int, mb: int, received: list[torch.Tensor]):
        pipe = self._pipe
        self._before_forward()
        stage = pipe.stages[local]
        s = stage.stage_index
        topo = pipe.schedule.topology
        if topo.prev_stage[s] < 0:
            args, kwargs = self._batch.inputs[mb]
        else:
            try:
                args, kwargs = wire.as_call(self._plans.in_use[s].inputs[mb].decode(
                    received, pipe.timeout, stage.mesh_for))
            except InputError as e:  # (a DTensor this stage has no mesh for)
                raise InputError(f"{pipe.who}: {e}") from None
            except TimeoutError as e:  # the device did not reach the message within the timeout
                raise CommError(f"pipecore {pipe.who}, stage {s}'s input of microbatch {mb}: {e} within "
                                f"{pipe.timeout:g} s (a peer stopped sending, or the device is stuck)") from None
            extra = self._batch.stage_kwargs
            if extra is not None:
                clash = sorted(set(kwargs) & set(extra[mb]))
                if clash:
                    raise InputError(f"{pipe.who}: stage {s} receives keyword inputs {clash} from stage "
                                     f"{topo.prev_stage[s]} and from step()'s keyword arguments: rename one")
                kwargs = {**kwargs, **extra[mb]}
        clock = self._clock
        started = clock() if clock else 0.0
        try:
            wrapper = self._wrapped.get(local) if self._training else None
            with wrapper.forward_context() if wrapper is not None else nullcontext():
                out = stage.forward(args, kwargs, mb)
        except Exception as exc:
            shapes = [(tuple(t.shape), str(t.dtype)) for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)]
            exc.add_note(f"pipecore: raised by stage {s}'s forward of microbatch {mb} on {pipe.who}, inputs "
                         f"{shapes}")
            if "leaf Variable that requires grad" in str(exc) and topo.prev_stage[s] >= 0:
                exc.add_note("pipecore: a stage's received inputs are leaves that need a gradient, so they cannot "
                             "be changed in place: write `h = h + x` instead of `h += x` (or clone the input first)")
            raise
        if clock:
            self.model_seconds += clock() - started
        if topo.next_stage[s] >= 0:
            return self._message(local, mb, args, kwargs, out), None, 1.0
        if self._return_outputs:
            self.outputs[mb] = (out.detach() if isinstance(out, torch.Tensor)
                                else tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out))
        loss = None
        seed = 1.0
        targets = self._batch.targets
        if pipe.loss_fn is not None and (self._training or targets is not None):
            if out is None:
                raise InputError(f"{pipe.who}: stage {s}'s output for microbatch {mb} is None, but loss_fn takes "
                                 "it: a last stage returns what loss_fn takes. Does its forward miss a `return`?")
            started = clock() if clock else 0.0
            with stage.autocast_context():
                if targets is not None:
                    loss = pipe.loss_fn(out, targets[mb], **self._loss_kwargs)
                else:
                    loss = pipe.loss_fn(out, **self._loss_kwargs)
            if clock:
                self.model_seconds += clock() - started
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                f"{' of shape ' + str(tuple(loss.shape)) if isinstance(loss, torch.Tensor) else ''}")
            self.losses[mb] = loss.detach()
            if pipe.check_finite and not torch.isfinite(loss.detach()).all():
                raise FloatingPointError(f"{pipe.who}: loss of microbatch {mb} is {loss.item()} "
                                         "(check_finite=True)")
            if pipe.scale_grads or self._loss_divisor is not None:
                seed = self._loss_weight(mb)
            elif self._dp_size > 1:
                seed = 1.0 / self._dp_size
        if not self._training:
            loss = None
        return [], loss, seed

    def _message(self, local: int, mb: int, args, kwargs, out) -> list[torch.Tensor]:
        """What stage `local`'s output for `mb` sends to the next stage; on the first step of a batch
        shape its boundary is learnt here, on later steps the output is checked against it."""
        pipe = self._pipe
        stage = pipe.stages[local]
        s = stage.stage_index
        discovery = self._plans.discovery
        any_shape = pipe.executor.shapes_travel  # messages carry their shapes: any shape of the planned ranks
        if discovery is None:
            boundary = self._plans.in_use[s].outputs[mb]
            if boundary.single and boundary.tree.layout is None and isinstance(out, torch.Tensor) and \
                    boundary.fits(out, any_shape):
                # the steady path's common case: one tensor, as the first step of this structure had it
                return [_viewless(out)]
        nxt = pipe.schedule.topology.next_stage[s]
        what = f"{pipe.who}: stage {s}'s output for microbatch {mb}"
        if out is None:
            raise InputError(f"{what} is None, but stage {nxt} takes it as its input: a stage returns what the next "
                             "stage takes (a tensor, or a tuple, list or dict of tensors and other values). Does its "
                             "forward miss a `return`?")
        leaves, spec = tree_flatten(out)
        if discovery is not None:
            problem = declared_mismatch(stage, args, kwargs, out)
            if problem is not None:
                raise InputError(f"{what} has {problem} (given as this stage's output_args)")
            boundary = wire.Boundary.of(out, what)
            tensors = boundary.encode(leaves, stage.device, what)
            discovery.learnt_output(local, mb, boundary)
        else:
            try:
                problem = boundary.mismatch(leaves, spec, any_shape)
            except InputError as e:  # (a DTensor its receiver cannot rebuild)
                raise InputError(f"{what}: {e}") from None
            if problem is not None:
                if any_shape:
                    raise InputError(f"{what} has {problem}: stage {nxt} receives what the first step with this "
                                     "batch structure returned (a stage's output may change its dtypes, ranks, "
                                     "gradient flags or structure only with the batch's)")
                raise InputError(f"{what} has {problem}: stage {nxt} receives what the first step with this batch "
                                 "shape returned (a stage's output may change its shapes, dtypes, gradient flags or "
                                 "structure only with the batch's shapes)")
            tensors = boundary.encode(leaves, stage.device, what)
        return [_viewless(t) for t in tensors]

    def _loss_weight(self, mb: int) -> float:
        """This microbatch's share of the batch rows, n_mb / N: the target's rows, else the rows of
        the first stages' batch (learnt at the agreement, or where messages carry shapes, from them;
        split as `split` does), else 1/m (inputs split by torch's chunk specs, with no target rows);
        with a loss_divisor (sum losses), 1 / loss_divisor. Divided by the replicas, whose gradients
        are summed."""
        if self._loss_divisor is not None:
            return 1.0 / self._loss_divisor
        if self._rows is None:  # once per run, not per microbatch: m microbatches, O(m) each
            executor = self._pipe.executor
            # shaped messages bring the step's batch rows (the first stage's or an earlier activation's)
            batch_rows = max(executor.batch_rows, 0) if executor.shapes_travel else self._plans.batch_rows.get(
                self._training, 0)
            rows = self._batch.rows or split_sizes(batch_rows, self._pipe.num_microbatches)
            self._rows = (rows or [], sum(rows or []))
        rows, total = self._rows
        if rows:
            return rows[mb] / total / self._dp_size
        return 1.0 / self._pipe.num_microbatches / self._dp_size
