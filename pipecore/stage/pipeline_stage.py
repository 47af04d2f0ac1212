"""`PipelineStage`: one stage of the model, held by this rank."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from pipecore.errors import InputError
from pipecore.stage.boundary import describe, tensor_leaves
from pipecore.stage.dtensor import mesh_in
from pipecore.stage.stage_module import StageModule


class PipelineStage:
    """Wraps `module` as stage `stage_index` of `num_stages`.

    The module's forward takes what the previous stage returned (a tuple is unpacked into
    positional arguments, a dict into keyword arguments) or, for the first stage, the arguments
    given to `Pipeline.step`. It may return a tensor, or a tuple/list/dict of tensors and other
    values; several tensors per boundary travel as one message, other values (ints, floats, bools,
    None, small picklable objects) travel with them and reach the next stage as returned, integer
    tensors pass through, tensors that need no gradient get none.
    For `dualpipe`, stage R+j holds a copy of model stage j (see `Schedule.topology.model_stage`).

    What crosses the boundaries is learnt from the forwards of the first step with each batch
    shape (pipecore/runtime/discovery.py): nothing runs the module beforehand. `input_args`/`output_args`
    are accepted as torch's PipelineStage takes them (examples of one microbatch's inputs and of what
    the module returns for them, real or meta; only shapes and dtypes count): a forward on inputs
    shaped like `input_args` that returns other shapes fails with an error that names both.

    `tied` defaults to the ties `pc.partition` found (a StageModule's `tied`: parameters its layers
    share with other stages'); `tied={"embedding": module.tok.weight}` on one stage and
    `tied={"embedding": module.head.weight}` on another declare one weight shared by stages (DeepSpeed's TiedLayerSpec, Megatron's embedding
    group): the Pipeline makes the copies equal at its first step, before any forward (the lowest stage's value wins), and
    sums their gradients after every training step, so an optimizer step keeps them equal
    (pipecore/training/ties.py). Stages on one rank that hold the key need no communication for it.

    `activation_checkpointing=True` runs the stage's forward under torch's non-reentrant
    checkpoint: a microbatch keeps only the stage's inputs until its backward recomputes the rest.
    (Zero-bubble schedules then give this stage's whole backward at I: the split is reported.)
    `autocast=torch.bfloat16` runs the forward, and on a last stage the loss, under
    `torch.autocast` on the stage's device, as single-process mixed-precision training does.
    A stage may return DTensors (tensor-parallel activations, TorchTitan's DTensor TP): this rank's
    part travels, with the DTensor's placements and its mesh's dimension names and shape, and the
    next stage gets a DTensor of those placements on its own mesh of those names and shape: one its
    module's DTensor parameters or buffers live on, else `get_mesh(names, None)` as torch's stage
    takes it (TorchTitan always passes one). Gradients come back the same way.
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, device: torch.device | str | None = None,
                 input_args: Any = None, output_args: Any = None, *, group=None,
                 dw_builder: Callable[[], Callable[[], None]] | None = None, tied: dict[str, nn.Parameter] | None = None,
                 activation_checkpointing: bool = False, autocast: torch.dtype | None = None,
                 get_mesh: Callable | None = None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"PipelineStage needs an nn.Module, got {type(module).__name__}")
        if dw_builder is not None and not callable(dw_builder):
            raise TypeError(f"dw_builder must be a callable that returns a microbatch's weight-gradient runner "
                            f"(a callable), got {type(dw_builder).__name__}")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup (the pipeline's group) or None for "
                            f"the default group, got {type(group).__name__}")
        if get_mesh is not None and not callable(get_mesh):
            raise TypeError(f"get_mesh must be a callable (mesh_dim_names, mesh_layout) -> DeviceMesh, as torch's "
                            f"PipelineStage takes it, got {type(get_mesh).__name__}")
        self.group = group
        self.dw_builder = dw_builder
        self.get_mesh = get_mesh
        self._meshes: dict[tuple, Any] = {}  # mesh_for's, by (dimension names, shape)
        self._role: tuple[bool, bool] | None = None  # (first, last) under the schedule of a Pipeline
        for label, value in (("stage_index", stage_index), ("num_stages", num_stages)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{label} must be an int, got {value!r}")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in 0..num_stages-1 = 0..{num_stages - 1}, got {stage_index}")
        self._declared_tied = tied
        self.tied = _tied_parameters(module, tied, stage_index)
        self._tie_names = _names_in(module, self.tied)
        if not isinstance(activation_checkpointing, bool):
            raise TypeError(f"activation_checkpointing must be True or False, got {activation_checkpointing!r}")
        if autocast is not None and not (isinstance(autocast, torch.dtype) and autocast.is_floating_point):
            raise TypeError(f"autocast must be a floating dtype (torch.bfloat16, torch.float16) or None, got "
                            f"{autocast!r}")
        self.activation_checkpointing = activation_checkpointing
        self.autocast = autocast
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        if device is None:
            param = next(iter(module.parameters()), None)
            device = param.device if param is not None else torch.device("cpu")
        self.device = torch.device(device)
        if (input_args is None) != (output_args is None):
            raise ValueError("give both input_args (one microbatch's inputs) and output_args (what the stage returns "
                             "for them), or neither to have shapes found on the first step")
        # register_forward_context's, by handle id (an OrderedDict: the handle holds it weakly)
        self._forward_contexts: OrderedDict[int, Callable] = OrderedDict()
        self._given_in: list[tuple] | None = None
        self._given_out: Any = None
        if input_args is not None:
            args = input_args if isinstance(input_args, tuple) else (input_args,)
            self._given_in = _shapes(args, "input_args")
            self._given_out = describe(output_args)
            _shapes(output_args, "output_args")

    def place(self, first: bool, last: bool) -> None:
        """Whether this stage takes the batch's inputs and computes the loss under the schedule of the
        Pipeline that holds it (dualpipe has two of each); a Pipeline calls it when built."""
        self._role = (first, last)
        self.tied = self._live_ties()

    # torch.distributed.pipelining's stage attributes
    @property
    def submod(self) -> nn.Module:
        """The stage's module (torch's name for `module`). Setting it re-points the stage at another
        module, as TorchTitan does after wrapping each stage's module (FSDP2, torch.compile), before
        a Pipeline (a schedule) holds the stage."""
        return self.module

    @submod.setter
    def submod(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"submod must be an nn.Module, got {type(module).__name__}")
        if self._role is not None:
            raise RuntimeError(f"stage {self.stage_index} is held by a Pipeline (a schedule was built over it), which "
                               "took its module's parameters and wrappers: set submod before building the schedule")
        self.tied = _tied_parameters(module, self._declared_tied, self.stage_index)
        self._tie_names = _names_in(module, self.tied)
        self.module = module

    def _live_ties(self) -> dict[str, nn.Parameter]:
        """The tied parameters as the module holds them now, looked up by name: fully_shard (and
        other wrappers applied in place) replaces a module's Parameter objects after the stage took
        them, and a tie on a replaced one would sum gradients nobody trains with."""
        live = {}
        for key, name in self._tie_names.items():
            try:
                live[key] = self.module.get_parameter(name)
            except AttributeError:
                raise InputError(f"stage {self.stage_index}'s tied weight {key!r} was its module's parameter {name}, "
                                 "which the module no longer has (a wrapper applied to it after the PipelineStage was "
                                 "built renamed it): wrap the module first, then build the PipelineStage, or set "
                                 "stage.submod to the wrapped module") from None
        return live

    @property
    def is_first(self) -> bool:
        """Does this stage take the batch's inputs? Stage 0, as torch says; under dualpipe, once a
        Pipeline holds the stage, also the first stage of the reverse direction (stage R)."""
        return self._role[0] if self._role is not None else self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Does this stage compute the loss? The last stage, as torch says; under dualpipe, once a
        Pipeline holds the stage, also the last stage of the reverse direction (stage R - 1)."""
        return self._role[1] if self._role is not None else self.stage_index == self.num_stages - 1

    @property
    def group_rank(self) -> int:
        """This process's rank in the stage's group (torch's attribute)."""
        return dist.get_rank(self.group)

    @property
    def group_size(self) -> int:
        """The size of the stage's group (torch's attribute)."""
        return dist.get_world_size(self.group)

    def forward(self, args: tuple, kwargs: dict, microbatch: int = 0) -> Any:
        """The module on one microbatch's inputs, under this stage's forward context (if one is
        registered), autocast and checkpointing."""
        if not self._forward_contexts:
            return self._run_module(args, kwargs, None)
        factory = next(iter(self._forward_contexts.values()))
        info = PipelineStageInfo(stage_index=self.stage_index, microbatch_index=microbatch)
        ran = False
        with factory(info):
            out = self._run_module(args, kwargs, lambda: factory(info))
            ran = True
        if not ran:
            raise RuntimeError(f"stage {self.stage_index}'s forward context suppressed an exception of the stage's "
                               f"module (microbatch {microbatch}): a forward context must let them through")
        return out

    def _run_module(self, args: tuple, kwargs: dict, context: Callable | None) -> Any:
        with self.autocast_context():
            if self.activation_checkpointing and torch.is_grad_enabled():
                # the backward's recomputation runs in the forward context too
                recompute = (lambda: (nullcontext(), context())) if context is not None else None
                extra = {"context_fn": recompute} if recompute is not None else {}
                return checkpoint(self.module, *args, use_reentrant=False, **extra, **kwargs)
            return self.module(*args, **kwargs)

    # torch 2.15's stage methods
    def mesh_for(self, names: tuple, shape: tuple):
        """This stage's DeviceMesh of these dimension names and shape, on which it rebuilds DTensor
        activations received from the previous stage."""
        key = (names, shape)
        if key not in self._meshes:
            mesh = mesh_in(self.module, names, shape)
            if mesh is None and self.get_mesh is not None:
                mesh = self.get_mesh(names, None)
            if mesh is None or tuple(mesh.shape) != shape:
                raise InputError(f"stage {self.stage_index} receives a DTensor on a mesh of dimensions {names} and shape "
                                 f"{shape} from stage {self.stage_index - 1}, and has no such mesh: hold a DTensor "
                                 "parameter on it, or give PipelineStage(..., get_mesh=lambda names, layout: mesh)")
            self._meshes[key] = mesh
        return self._meshes[key]

    def register_forward_context(self, context_factory: Callable[[Any], Any]):
        """torch 2.15's: `context_factory(PipelineStageInfo)` returns a context manager that every
        forward of this stage runs inside (each microbatch's, in step() and eval(), and the backward's
        recomputation under activation checkpointing). pipecore has no separate shape probe, so
        `is_metadata_inference` is always False; a step pipecore runs again (a peer's batch changed
        shape) calls the factory again for its microbatches. One at a time; the
        returned handle's remove() unregisters it. A torch stage object's registration is carried
        over when a schedule converts it."""
        from torch.utils.hooks import RemovableHandle

        if not callable(context_factory):
            raise TypeError(f"context_factory must be a callable(PipelineStageInfo) -> context manager, got "
                            f"{type(context_factory).__name__}")
        if self._forward_contexts:
            raise RuntimeError("A pipeline forward context is already registered; remove its handle before "
                               "registering another")
        handle = RemovableHandle(self._forward_contexts)
        self._forward_contexts[handle.id] = context_factory
        return handle

    def release_fwd_send_outputs(self, fwd_chunk_id: int) -> None:
        """torch 2.15's: drops the stage's references to a microbatch's outputs whose sends completed.
        pipecore's executor does that itself as each send completes (csrc/send_tracker.h): nothing is
        left to release here."""

    def start_gradient_reduction(self) -> None:
        """torch 2.15's runtime starts an FSDP stage's reduction here at REDUCE_GRAD; pipecore's step()
        does it at its own REDUCE_GRAD (pipecore/training/wrapped_stages.py). Not for calling outside."""
        raise NotImplementedError(_STEP_DRIVES_REDUCTION)

    def wait_for_gradient_reduction(self, grad_scale_factor: int) -> None:
        """torch 2.15's runtime waits for an FSDP stage's reduction here; pipecore's step() has every
        reduction done, and the gradients scaled, by the time it returns."""
        raise NotImplementedError(_STEP_DRIVES_REDUCTION)

    def autocast_context(self):
        """torch.autocast for this stage's device and dtype, or a no-op without autocast."""
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def declared_output(self, args_desc: Any, kwargs_desc: Any) -> Any | None:
        """The description of this stage's output declared by output_args, when these inputs are
        shaped like input_args; None: nothing declared for them."""
        if self._given_in is None or tensor_leaves(kwargs_desc):
            return None
        if [(m.shape, m.dtype) for m in tensor_leaves(args_desc)] != self._given_in:
            return None
        return self._given_out

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, {type(self.module).__name__}, {self.device})"


_STEP_DRIVES_REDUCTION = (
    "pipecore's step() starts each FSDP2 stage's gradient reduction at the schedule's REDUCE_GRAD and has it done, "
    "scaled, when step() returns; a stage's reduction is not driven from outside a step")


def _torchs_stage_info() -> type | None:
    """torch's PipelineStageInfo, which exists from 2.15 on (None before): an older torch is not asked, since
    importing torch.distributed.pipelining costs 1.7 s per process (it imports torch._dynamo)."""
    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 15):
        return None
    try:
        from torch.distributed.pipelining.stage import PipelineStageInfo as torchs
    except ImportError:
        return None
    return torchs


_TORCHS_STAGE_INFO = _torchs_stage_info()
if _TORCHS_STAGE_INFO is not None:  # torch's, where torch has it (users may check isinstance)
    PipelineStageInfo = _TORCHS_STAGE_INFO
else:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class PipelineStageInfo:
        """One forward of a pipeline stage, as register_forward_context's factory receives it (torch 2.15's
        class of the same name)."""

        stage_index: int
        microbatch_index: int
        is_metadata_inference: bool = False


def is_torch_stage(obj: Any) -> bool:
    """Is `obj` one of torch.distributed.pipelining's stage objects?"""
    return any(c.__module__.startswith("torch.distributed.pipelining") and c.__name__ == "_PipelineStageBase"
               for c in type(obj).__mro__)


def from_torch_stage(stage: Any) -> PipelineStage:
    """pipecore's stage for torch.distributed.pipelining's `stage`: the same module (not a copy), index,
    stage count, device, group and dw_builder. Shapes are learnt on the first step, as for any stage."""
    ours = PipelineStage(stage.submod, stage.stage_index, stage.num_stages, stage.device, group=stage.group,
                         dw_builder=stage.dw_builder)
    ours._forward_contexts = getattr(stage, "_forward_contexts", ours._forward_contexts)  # torch 2.15's, shared
    return ours


def stage_list(stages) -> list[PipelineStage]:
    """The Pipeline's stages argument as a list of pipecore stages (torch.distributed.pipelining's
    stage objects converted: from_torch_stage), or a TypeError that says what was given."""
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


def pipeline_group(group, stages: list[PipelineStage]):
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


def _shapes(tree: Any, what: str) -> list[tuple]:
    leaves = [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]
    if not leaves:
        raise TypeError(f"{what} must be a tensor or hold tensors (examples of one microbatch), got {tree!r:.80}")
    return [(tuple(t.shape), t.dtype) for t in leaves]


def _tied_parameters(module: nn.Module, tied: Any, stage_index: int) -> dict[str, nn.Parameter]:
    """`tied` checked, {key: a parameter of `module`}; None: the ties `pc.partition` found."""
    if tied is None:
        return _found_ties(module)
    if not isinstance(tied, dict):
        raise TypeError(f"tied must be a dict {{key: parameter of this stage's module}}, got {type(tied).__name__}")
    own = {id(p) for p in module.parameters()}
    for key, param in tied.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"tied keys name a shared weight (a non-empty str, the same on every stage holding it), "
                            f"got {key!r}")
        if not isinstance(param, nn.Parameter) or id(param) not in own:
            raise ValueError(f"tied[{key!r}] of stage {stage_index} must be a parameter of that stage's module "
                             f"(e.g. module.tok.weight), got {type(param).__name__}"
                             f"{' of shape ' + str(list(param.shape)) if isinstance(param, torch.Tensor) else ''}")
    if len({id(p) for p in tied.values()}) != len(tied):
        raise ValueError(f"stage {stage_index} declares one parameter under several tied keys {sorted(tied)}: "
                         "use one key per shared weight")
    return dict(tied)


def _names_in(module: nn.Module, tied: dict[str, nn.Parameter]) -> dict[str, str]:
    """{key: the name `module` gives each tied parameter}."""
    names: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        for key, q in tied.items():
            if q is p:
                names.setdefault(key, name)
    return names


def _found_ties(module: nn.Module) -> dict[str, nn.Parameter]:
    """The ties pc.partition found for `module` (a StageModule, or one wrapped in DDP or FSDP2),
    looked up by name: the parameters it holds now."""
    inner = module.module if isinstance(module, DistributedDataParallel) else module
    if not isinstance(inner, StageModule):
        return {}
    return {key: inner.get_parameter(name) for key, name in inner.tied.items()}
