"""What this rank's state is called in a checkpoint, keyed by MODEL stage so that a checkpoint does
not depend on the schedule.

- Model stage j's first copy on this rank is `stage{j}`, its state dict entries
  `stage{j}.{name in the stage module}`; a further copy of it on this rank (pipeline stage s, e.g.
  dualpipe's mirror) is `copy{s}`, neither saved nor read: it is loaded from `stage{j}`.
- The optimizer's state in DCP's flattened form (`state.stage{j}.{name}.exp_avg`,
  `param_groups.stage{j}.{name}.lr`), so that each rank's optimizer is saved and loaded by name.
- `pipecore.extra` (rank 0's `extra`, pickled) and `pipecore.rng.rank{r}.{cpu,cuda}` (rank r's
  RNG states).
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from pipecore.errors import InputError
from pipecore.stage.dtensor import is_dtensor

EXTRA_KEY = "pipecore.extra"
# one optimizer per rank over stages that differ between ranks: DCP's nested optimizer state dict
# would save rank 0's param_groups list under the same keys as rank 1's; flattened, every entry is
# named by its parameter
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class StageModules:
    """This rank's stage modules under checkpoint names (`stage{j}`, `copy{s}`: above). DCP's state
    dict helpers name parameters through it."""

    def __init__(self, pipe, optimizer: torch.optim.Optimizer | None):
        model_stage = pipe.schedule.topology.model_stage
        self.modules = nn.ModuleDict()
        self.copies: dict[str, str] = {}  # copy{s} -> stage{j}
        for stage in sorted(pipe.stages, key=lambda s: s.stage_index):
            name = f"stage{model_stage[stage.stage_index]}"
            if name not in self.modules:
                self.modules[name] = stage.module
            elif stage.module is not self.modules[name]:  # the same module object twice is one copy
                self.copies[f"copy{stage.stage_index}"] = name
                self.modules[f"copy{stage.stage_index}"] = stage.module
        # each parameter under the name DCP gives it (a checkpoint_wrapper's or DDP's prefix left out,
        # as TorchTitan's activation checkpointing wraps its blocks), every name of a shared one
        self._params = {fqn: p for name, p in self.modules.named_parameters(remove_duplicate=False)
                        for fqn in _dcp_names(self.modules, name)}
        self._names = set(self._params)
        _check_within_pipeline(pipe, self.modules)
        self.optimizer = optimizer
        if optimizer is not None:
            _check_optimizer(optimizer, self.modules)

    def model_state(self) -> dict[str, Any]:
        """Every stage module's state dict (the live tensors), copies included."""
        if not self.modules.state_dict():  # DCP refuses an empty model state dict
            return {}
        return get_model_state_dict(self.modules, options=OPTIONS)

    def set_model_state(self, model_state: dict[str, Any]) -> None:
        """Copies the loaded `model_state` (saved entries) into every stage module, copies included."""
        if model_state:  # DCP refuses an empty model state dict (a rank of parameterless stages)
            set_model_state_dict(self.modules, self.with_copies(model_state), options=OPTIONS)

    def optimizer_state_for_save(self) -> dict[str, Any]:
        """The optimizer's flattened state dict. DCP initialises a never-stepped optimizer's state
        (a step at lr 0) to name it; saved is what it had: its param_groups, no state."""
        if self.optimizer.state:
            return get_optimizer_state_dict(self.modules, self.optimizer, options=OPTIONS)
        before = self.optimizer.state
        self.optimizer.state = defaultdict(dict)  # what DCP initialises in place is dropped after
        try:
            state = get_optimizer_state_dict(self.modules, self.optimizer, options=OPTIONS)
        finally:
            self.optimizer.state = before
        return {k: v for k, v in state.items() if not k.startswith("state.")}

    def optimizer_state_for_load(self) -> dict[str, Any]:
        """The flattened state dict of a freshly initialised state (the caller swapped the
        optimizer's state for an empty one: `OptimizerStateSwap`): one new tensor per state entry of
        every parameter, which DCP reads into. DCP initialises only while no parameter has a gradient."""
        grads = _stash_grads(self.optimizer)
        try:
            return get_optimizer_state_dict(self.modules, self.optimizer, options=OPTIONS)
        finally:
            _restore_grads(grads)

    def check_optimizer_keys(self, state: dict[str, Any], stored: dict) -> tuple[list[str], list[str]]:
        """Problems (a parameter's state entries differ from the checkpoint's) and the parameters
        that had no state when saved (they get none: their first step starts it, as it would have)."""
        wanted: dict[str, set[str]] = defaultdict(set)
        for key in state:
            if key.startswith("state.") and self._is_saved(key):
                owner = self.state_owner(key)
                wanted[owner].add(key[len("state.") + len(owner) + 1:])
        there: dict[str, set[str]] = defaultdict(set)
        for key in stored:
            owner = self.state_owner(key) if key.startswith("state.") else None
            if owner in wanted:
                there[owner].add(key[len("state.") + len(owner) + 1:])
        problems, stateless = [], []
        for fqn in sorted(wanted, key=natural):
            if not there[fqn]:
                stateless.append(fqn)
            elif there[fqn] != wanted[fqn]:
                problems.append(f"the optimizer state of {fqn} holds {sorted(there[fqn])} in the checkpoint and "
                                f"{sorted(wanted[fqn])} here: load into an optimizer built with the same settings")
        return problems, stateless

    def set_optimizer_state(self, state: dict[str, Any], stateless: list[str]) -> None:
        """Sets the loaded flattened state (copies get their own tensors of their model stage's);
        parameters without saved state are left without state."""
        for copy, name in self.copies.items():
            for key, value in list(state.items()):
                group, _, rest = key.partition(".")
                if rest.startswith(name + "."):
                    state[f"{group}.{copy}{rest[len(name):]}"] = value.clone() if isinstance(value, torch.Tensor) \
                        else value
        grads = _stash_grads(self.optimizer)  # DCP initialises state only while no gradient exists
        try:
            # stateless parameters still hold their initial entries here: an optimizer without any state
            # would be initialised again, and its entries looked up in `state`
            set_optimizer_state_dict(self.modules, self.optimizer, state, options=OPTIONS)
        finally:
            _restore_grads(grads)
        for fqn in stateless:
            for name in [fqn, *self._copy_names(fqn)]:
                self.optimizer.state.pop(self._params[name], None)
        for param in [p for p, entries in self.optimizer.state.items() if not entries]:
            del self.optimizer.state[param]  # no entries is no state, as before the save

    def with_copies(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """The loaded model state plus each further copy's entries, taken from its model stage."""
        out = dict(model_state)
        for copy, name in self.copies.items():
            out.update({f"{copy}{k[len(name):]}": v for k, v in model_state.items() if k.startswith(name + ".")})
        return out

    def saved(self, state: dict[str, Any]) -> dict[str, Any]:
        """The entries of `state` that are saved and read (not those of further copies)."""
        return {k: v for k, v in state.items() if self._is_saved(k)}

    def _is_saved(self, key: str) -> bool:
        for prefix in ("state.", "param_groups."):
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        return key.partition(".")[0] not in self.copies

    def state_owner(self, key: str) -> str | None:
        """The parameter of "state.stage0.fc.weight.exp_avg": "stage0.fc.weight" (the longest
        parameter name it starts with: nested entries keep their dots), None if not one of this rank's."""
        rest = key[len("state."):]
        cut = rest.rfind(".")
        while cut > 0:
            if rest[:cut] in self._names:
                return rest[:cut]
            cut = rest.rfind(".", 0, cut)
        return None

    def _copy_names(self, fqn: str) -> list[str]:
        stage, _, rest = fqn.partition(".")
        return [f"{copy}.{rest}" for copy, name in self.copies.items() if name == stage]


class OptimizerStateSwap:
    """A load's optimizer state: swapped for a fresh one that DCP initialises and reads into, and put
    back when the load fails (the model is not touched until every rank has read everything)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.state = None

    def swap(self) -> None:
        # a fresh state to initialise: DCP initialises only an optimizer without state, and then
        # every parameter gets its entries, whatever the old state held
        self.state = self.optimizer.state
        self.optimizer.state = defaultdict(dict)

    def put_back(self) -> None:
        if self.state is not None:
            self.optimizer.state = self.state
            self.state = None


def _dcp_names(modules: nn.Module, name: str) -> set[str]:
    """The names DCP's state dicts give the parameter `modules` calls `name` (its own rule, which drops
    the prefixes of checkpoint_wrapper, DDP and torch.compile)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    return set(_get_fqns(modules, name))


def _check_optimizer(optimizer, modules: nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError(f"optimizer must be a torch.optim.Optimizer (over this rank's stage parameters) or None, got "
                         f"{type(optimizer).__name__}")
    own = {id(p) for p in modules.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    if foreign:
        shapes = ", ".join(str(list(p.shape)) for p in foreign[:4])
        raise InputError(f"the optimizer holds {len(foreign)} parameter(s) that are not in this rank's stages (shapes "
                         f"{shapes}{', ...' if len(foreign) > 4 else ''}): give it this rank's stage parameters only")


def _stash_grads(optimizer) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    grads = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]]
    for p, _ in grads:
        p.grad = None
    return grads


def _restore_grads(grads) -> None:
    for p, g in grads:
        p.grad = g


def optimizer_name(optimizer) -> str | None:
    """The optimizer's class as the layout document records it."""
    return None if optimizer is None else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def natural(key: str) -> tuple:
    """Orders keys by model stage: stage2.x before stage10.x."""
    stage, _, rest = key.partition(".")
    return (int(stage[5:]) if stage[5:].isdigit() else 0, rest)


def pickled(extra: dict) -> bytes:
    # one opaque value under EXTRA_KEY: DCP would split a dict into keys that a load cannot know in advance
    try:
        return pickle.dumps(extra)
    except Exception as exc:
        raise InputError(f"extra cannot be pickled ({type(exc).__name__}: {exc}): give small picklable values such "
                         "as the step, scheduler.state_dict() or a data position") from exc


# -- RNG states ------------------------------------------------------------------------------
def rng_key(rank: int, kind: str) -> str:
    return f"pipecore.rng.rank{rank}.{kind}"


def rng_states(pipe) -> dict[str, torch.Tensor]:
    """This rank's CPU generator state, and the CUDA one of its stages' device when that is CUDA."""
    states = {"cpu": torch.get_rng_state()}
    device = pipe.stages[0].device
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_state(pipe, kind: str, state: torch.Tensor) -> None:
    if kind == "cpu":
        torch.set_rng_state(state)
    elif pipe.stages[0].device.type == "cuda":
        torch.cuda.set_rng_state(state, pipe.stages[0].device)


def _check_within_pipeline(pipe, modules: nn.Module) -> None:
    """A checkpoint is written by the pipeline's own ranks: a DTensor held also by ranks outside it (tensor
    parallel, sharded over other pipelines' ranks) would be written by each pipeline into the same files.
    Refused, saying what to use."""
    mine = set(dist.get_process_group_ranks(pipe.group))
    for name, t in [*modules.named_parameters(), *modules.named_buffers()]:
        if is_dtensor(t):
            outside = sorted(set(t.device_mesh.mesh.flatten().tolist()) - mine)
            if outside:
                raise InputError(f"{pipe.who}: {name} is a DTensor over ranks {outside} outside this pipeline "
                                 f"(tensor parallel): save_checkpoint writes a pipeline's own ranks' state; save "
                                 "such stages with torch.distributed.checkpoint over the whole device mesh")
