"""Checkpoints of a `Pipeline` with torch.distributed.checkpoint (DCP).

Both calls are collectives over the pipeline's group: every rank calls them, with its own optimizer
(the one over its stages' parameters):

    pc.save_checkpoint("ckpt/step1000", pipe, optimizer,
                       extra={"step": 1000, "scheduler": scheduler.state_dict()})
    ...
    extra = pc.load_checkpoint("ckpt/step1000", pipe, optimizer)   # in place, on every rank
    scheduler.load_state_dict(extra["scheduler"])
    step = extra["step"]

What is saved, keyed by MODEL stage so that a checkpoint does not depend on the schedule:
  - every model stage's state dict as `stage{j}.{name in the stage module}` (dualpipe's mirrored
    copies hold the same keys on two ranks: DCP writes them once; when one rank holds several
    copies of one model stage, its lowest pipeline stage is saved and the others are loaded from it);
  - the optimizer's state in DCP's flattened form (`state.stage{j}.{name}.exp_avg`,
    `param_groups.stage{j}.{name}.lr`), so that each rank's optimizer is saved and loaded by name;
  - `extra` (rank 0's, pickled) and each rank's torch RNG states (CPU, and CUDA on a CUDA stage
    device), so a resumed run draws the same dropout masks as an uninterrupted one;
  - `pipecore.json`: the stage layout (per model stage, its state names and shapes), schedule, world
    size, optimizer class and pipecore version. Load compares it with this pipeline before reading
    anything else, so a checkpoint of another stage layout fails on every rank with one message.

A save goes to `<path>.saving` and replaces `<path>` only once every rank's part and the layout are
written: a failed save leaves the previous checkpoint as it was. A load reads into new tensors and
copies them into the model and optimizer only after every rank read everything: a failed load leaves
them as they were (at the cost of one more copy of this rank's state while loading). The path must
be on a file system every rank sees.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from pipecore.version import __version__
from pipecore.errors import InputError

LAYOUT_FILE = "pipecore.json"
_FORMAT = 1
_EXTRA_KEY = "pipecore.extra"
# one optimizer per rank over stages that differ between ranks: DCP's nested optimizer state dict
# would save rank 0's param_groups list under the same keys as rank 1's; flattened, every entry is
# named by its parameter
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_MAX_LISTED = 8  # differing keys named per kind in a layout error


def save_checkpoint(path: str | os.PathLike, pipe, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None) -> None:
    """Saves every stage of `pipe`, `optimizer`'s state, rank 0's `extra` and every rank's RNG
    states to the directory `path` (created if missing; a previous checkpoint there is replaced).
    A collective: every rank of the pipeline's group calls it. Raises InputError on every rank,
    having written nothing, when a rank's arguments are wrong. With data-parallel replicas
    (`dp_group=`) every rank calls it too; replica 0 writes (the replicas' states are equal, RNG
    states included: each rank's are replica 0's after loading)."""
    path = _normalise(path)
    dp = pipe.gradients.dp
    if dp is not None:  # data-parallel replicas hold the same state: replica 0 writes it
        if dp.wrapped:
            raise InputError(f"rank {pipe.rank}: save_checkpoint saves plain stages; this Pipeline has stages wrapped "
                             "in DDP or FSDP2: save those with torch.distributed.checkpoint over the device mesh")
        failed = None
        if dp.rank == 0:
            try:
                _save(path, pipe, optimizer, extra)
            except BaseException as exc:
                failed = exc
        # the others wait with the group's own timeout (a save may take longer than a step)
        anyone = torch.tensor([int(failed is not None)], device=pipe.comm.device_for(dp.group))
        dist.all_reduce(anyone, group=dp.group)
        if failed is not None:
            raise failed
        if anyone:
            raise RuntimeError(f"save_checkpoint({path!r}): data-parallel replica 0, which writes the checkpoint, "
                               "failed (its ranks raised why)")
        return
    _save(path, pipe, optimizer, extra)


def _save(path: str, pipe, optimizer, extra) -> None:
    staging = path + ".saving"
    rng = _rng_states(pipe)  # first, as the caller left them
    problem, info, failure, state = None, None, None, {}
    try:
        stages = _StageModules(pipe, optimizer)
        if extra is not None and not isinstance(extra, dict):
            raise InputError(f"extra must be a dict (step, scheduler state, data position) or None, got "
                             f"{type(extra).__name__}")
        model_state = stages.model_state()
        state.update(stages.saved(model_state))
        if optimizer is not None:
            state.update(stages.saved(stages.optimizer_state_for_save()))
        state.update({_rng_key(pipe.rank, kind): value for kind, value in rng.items()})
        if pipe.rank == 0:
            state[_EXTRA_KEY] = _pickled(extra if extra is not None else {})
            _prepare_directory(path, staging)  # before the agreement: no rank writes into staging earlier
        info = {"layout": stages.layout(model_state), "optimizer": _optimizer_name(optimizer)}
    except Exception as exc:  # noqa: BLE001 - every rank learns it below and raises
        problem = _describe(exc)
        failure = exc
    rows = _gather(pipe, (problem, info))
    problems = _rank_problems([row[0] for row in rows])
    if not problems and len({row[1]["optimizer"] for row in rows}) > 1:
        names = ", ".join(f"rank {r} {row[1]['optimizer'] or 'None'}" for r, row in enumerate(rows))
        problems.append(f"the ranks gave different optimizers ({names}): pass each rank's optimizer on every "
                        "rank, or none on every rank")
    if problems:
        raise InputError(f"save_checkpoint({path!r}) wrote nothing: {'; '.join(problems)}") from (
            failure if problem is not None else None)

    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(staging), process_group=pipe.group)
    except Exception:
        if pipe.rank == 0:  # DCP raised on every rank: what was written is incomplete
            shutil.rmtree(staging, ignore_errors=True)
        raise

    finished = None
    if pipe.rank == 0:
        try:
            layout = _layout_document(pipe, rows[0][1]["optimizer"], [row[1]["layout"] for row in rows])
            with open(os.path.join(staging, LAYOUT_FILE), "w") as f:
                json.dump(layout, f, indent=1)
            _replace(staging, path)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others learnt it
            finished = exc
            shutil.rmtree(staging, ignore_errors=True)
    outcome = _gather(pipe, None if finished is None else _describe(finished))[0]
    if finished is not None:
        raise finished
    if outcome is not None:
        raise RuntimeError(f"save_checkpoint({path!r}): rank 0 could not finish the checkpoint ({outcome}); the "
                           "previous checkpoint there, if any, is unchanged")


def load_checkpoint(path: str | os.PathLike, pipe, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Loads a checkpoint of `save_checkpoint` into `pipe`'s stages and `optimizer` (in place;
    a freshly built optimizer gets its complete state) and restores every rank's RNG states.
    Returns the saved `extra` on every rank. A collective: every rank calls it. The checkpoint's
    stage layout is checked first on every rank: a different one (or no checkpoint at `path`) raises
    InputError on every rank and leaves the model and optimizer unchanged."""
    path = _normalise(path)
    problem, info, failure = None, None, None
    saved: dict | None = None
    request, keep, stateless, undo = {}, {}, [], _Undo(optimizer)
    try:
        stages = _StageModules(pipe, optimizer)
        model_state = stages.model_state()
        info = {"layout": stages.layout(model_state), "optimizer": _optimizer_name(optimizer)}
        saved, stored = _read_checkpoint(path)
        # what DCP reads into: new tensors for the model, the optimizer's state swapped for a fresh one
        request = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
                   for k, v in stages.saved(model_state).items()}
        if optimizer is not None:
            undo.swap_state()
            optim_state = stages.optimizer_state_for_load()
            local_problems, stateless = stages.check_optimizer_keys(optim_state, stored)
            if local_problems:
                raise InputError("; ".join(local_problems))
            for key, value in stages.saved(optim_state).items():
                if key in stored:
                    request[key] = value
                else:  # a param_groups entry the checkpoint lacks (initial_lr: no scheduler then) keeps its value;
                    keep[key] = value  # a parameter without saved state keeps its initial entries until set
        request[_EXTRA_KEY] = b""
        if _same_placement(saved, pipe):
            for kind, value in _rng_states(pipe).items():
                if _rng_key(pipe.rank, kind) in stored:
                    request[_rng_key(pipe.rank, kind)] = torch.empty_like(value)
    except Exception as exc:  # noqa: BLE001 - every rank learns it below and raises
        problem = _describe(exc)
        failure = exc
    rows = _gather(pipe, (problem, info))
    problems = _rank_problems([row[0] for row in rows])
    if not problems:
        problems = _load_mismatch(path, pipe, saved, [row[1] for row in rows])
    if problems:
        undo()
        raise InputError(f"load_checkpoint({path!r}) loaded nothing: {'; '.join(problems)}") from (
            failure if problem is not None else None)

    try:
        dcp.load(request, storage_reader=dcp.FileSystemReader(path), process_group=pipe.group)
    except Exception:
        undo()
        raise

    # every rank read everything: copy it in
    model_state = {k: request[k] for k in model_state if k in request}
    if model_state:  # DCP refuses an empty model state dict (a rank of parameterless stages)
        set_model_state_dict(stages.modules, stages.with_copies(model_state), options=_OPTIONS)
    if optimizer is not None:
        optim_state = {k: v for k, v in (*request.items(), *keep.items()) if k.startswith(("state.", "param_groups."))}
        stages.set_optimizer_state(optim_state, stateless)
    if not _same_placement(saved, pipe):
        warnings.warn(f"load_checkpoint({path!r}): the random number generators keep their states: the checkpoint "
                      f"was saved by {saved['world']} ranks holding model stages {saved['placement']}, this pipeline's "
                      f"{pipe.world} ranks hold {_placement(pipe)}", stacklevel=2)
    for kind in ("cpu", "cuda"):
        value = request.get(_rng_key(pipe.rank, kind))
        if value is not None:
            _set_rng_state(pipe, kind, value)
    return pickle.loads(request[_EXTRA_KEY])


class _StageModules:
    """This rank's stage modules under checkpoint names: model stage j's first copy here is
    `stage{j}`; a further copy of it on this rank (pipeline stage s) is `copy{s}`, neither saved
    nor read (it is loaded from `stage{j}`). DCP's state dict helpers name parameters through it."""

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
        self._names = {n for n, _ in self.modules.named_parameters(remove_duplicate=False)}
        self.optimizer = optimizer
        if optimizer is not None:
            _check_optimizer(optimizer, self.modules)

    def model_state(self) -> dict[str, Any]:
        """Every stage module's state dict (the live tensors), copies included."""
        if not self.modules.state_dict():  # DCP refuses an empty model state dict
            return {}
        return get_model_state_dict(self.modules, options=_OPTIONS)

    def optimizer_state_for_save(self) -> dict[str, Any]:
        """The optimizer's flattened state dict. DCP initialises a never-stepped optimizer's state
        (a step at lr 0) to name it; saved is what it had: its param_groups, no state."""
        if self.optimizer.state:
            return get_optimizer_state_dict(self.modules, self.optimizer, options=_OPTIONS)
        before = self.optimizer.state
        self.optimizer.state = defaultdict(dict)  # what DCP initialises in place is dropped after
        try:
            state = get_optimizer_state_dict(self.modules, self.optimizer, options=_OPTIONS)
        finally:
            self.optimizer.state = before
        return {k: v for k, v in state.items() if not k.startswith("state.")}

    def optimizer_state_for_load(self) -> dict[str, Any]:
        """The flattened state dict of a freshly initialised state (the caller swapped the
        optimizer's state for an empty one): one new tensor per state entry of every parameter,
        which DCP reads into. DCP initialises only while no parameter has a gradient."""
        grads = _stash_grads(self.optimizer)
        try:
            return get_optimizer_state_dict(self.modules, self.optimizer, options=_OPTIONS)
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
        for fqn in sorted(wanted, key=_natural):
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
            set_optimizer_state_dict(self.modules, self.optimizer, state, options=_OPTIONS)
        finally:
            _restore_grads(grads)
        params = dict(self.modules.named_parameters(remove_duplicate=False))
        for fqn in stateless:
            for name in [fqn, *self._copy_names(fqn)]:
                self.optimizer.state.pop(params[name], None)
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

    def layout(self, model_state: dict[str, Any]) -> dict[str, list[int] | None]:
        """{key: shape} of this rank's saved model entries (None: not a tensor)."""
        return {k: list(v.shape) if isinstance(v, torch.Tensor) else None
                for k, v in self.saved(model_state).items()}

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


class _Undo:
    """Puts back an optimizer state that a failed load swapped out (the model is not touched
    until every rank has read everything)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.state = None

    def swap_state(self) -> None:
        # a fresh state to initialise: DCP initialises only an optimizer without state, and then
        # every parameter gets its entries, whatever the old state held
        self.state = self.optimizer.state
        self.optimizer.state = defaultdict(dict)

    def __call__(self) -> None:
        if self.state is not None:
            self.optimizer.state = self.state
            self.state = None


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


def _optimizer_name(optimizer) -> str | None:
    return None if optimizer is None else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


# -- the layout --------------------------------------------------------------------------------
def _placement(pipe) -> list[list[int]]:
    """Per rank, the model stages of its pipeline stages in stage order."""
    topo = pipe.schedule.topology
    return [[topo.model_stage[s] for s in range(len(topo.stage_rank)) if topo.stage_rank[s] == r]
            for r in range(pipe.world)]


def _model_stage_count(pipe) -> int:
    return len(set(pipe.schedule.topology.model_stage))


def _layout_document(pipe, optimizer: str | None, layouts: list[dict]) -> dict:
    stages: dict[str, dict] = {f"stage{j}": {} for j in range(_model_stage_count(pipe))}
    for layout in layouts:
        for key, shape in layout.items():
            stage, _, name = key.partition(".")
            stages[stage][name] = shape
    return {"format": _FORMAT, "pipecore": __version__, "schedule": pipe.schedule.name or "a custom Schedule",
            "world": pipe.world, "model_stages": len(stages), "placement": _placement(pipe), "optimizer": optimizer,
            "stages": stages}


def _read_checkpoint(path: str) -> tuple[dict, dict]:
    """The layout document and DCP's {key: storage metadata}, or InputError: no checkpoint there."""
    if not os.path.isdir(path):
        what = "it is a file" if os.path.exists(path) else "the directory does not exist"
        raise InputError(f"no checkpoint at {path}: {what}. Give the directory save_checkpoint wrote")
    layout_file = os.path.join(path, LAYOUT_FILE)
    if not os.path.isfile(layout_file):
        unfinished = f" ({path}.saving is a save that did not finish)" if os.path.isdir(path + ".saving") else ""
        raise InputError(f"no pipecore checkpoint at {path}: it has no {LAYOUT_FILE}{unfinished}. Give the directory "
                         "save_checkpoint wrote")
    with open(layout_file) as f:
        layout = json.load(f)
    if layout.get("format") != _FORMAT:
        raise InputError(f"{layout_file} is of format {layout.get('format')!r}, pipecore {__version__} reads format "
                         f"{_FORMAT}")
    return layout, dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def _load_mismatch(path: str, pipe, saved: dict, infos: list[dict]) -> list[str]:
    """What keeps the checkpoint from loading into this pipeline (the same text on every rank)."""
    here: dict[str, list[int] | None] = {}
    for info in infos:
        here.update(info["layout"])
    there = {f"{stage}.{name}": shape for stage, names in saved["stages"].items() for name, shape in names.items()}
    only_there = sorted((k for k in there if k not in here), key=_natural)
    only_here = sorted((k for k in here if k not in there), key=_natural)
    shapes = sorted((k for k in there if k in here and there[k] != here[k]), key=_natural)
    problems = []
    if only_there or only_here or shapes:
        details = []
        if only_there:
            details.append(f"only in the checkpoint: {_listed(only_there)}")
        if only_here:
            details.append(f"only here: {_listed(only_here)}")
        if shapes:
            details.append("other shapes: " + _listed([f"{k} ({there[k]} there, {here[k]} here)" for k in shapes]))
        details[0] = details[0][0].upper() + details[0][1:]
        problems.append(
            f"checkpoint {path} was saved by a pipeline of {saved['model_stages']} model stages (schedule "
            f"{saved['schedule']} on {saved['world']} ranks); this one has {_model_stage_count(pipe)} model stages "
            f"(schedule {pipe.schedule.name or 'a custom Schedule'} on {pipe.world} ranks). {'; '.join(details)}. "
            "Load it into the same stage layout: the same model split into the same stages (the schedule and the "
            "number of ranks may differ)")
    given = {info["optimizer"] for info in infos}
    if len(given) > 1:
        names = ", ".join(f"rank {r} {info['optimizer'] or 'None'}" for r, info in enumerate(infos))
        problems.append(f"the ranks gave different optimizers ({names}): pass each rank's optimizer on every rank, "
                        "or none on every rank")
    elif given != {None} and saved["optimizer"] is None:
        problems.append(f"checkpoint {path} holds no optimizer state (it was saved without an optimizer): load it "
                        "with optimizer=None")
    elif given != {None} and given != {saved["optimizer"]}:
        problems.append(f"checkpoint {path} holds the state of a {saved['optimizer']}, this optimizer is a "
                        f"{given.pop()}: load it into the same kind of optimizer")
    return problems


def _listed(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED
    return ", ".join(items[:_MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def _natural(key: str) -> tuple:
    """stage2.x before stage10.x."""
    stage, _, rest = key.partition(".")
    return (int(stage[5:]) if stage[5:].isdigit() else 0, rest)


def _same_placement(saved: dict | None, pipe) -> bool:
    """Does every rank hold the model stages it held at the save (then its RNG streams continue)?"""
    return saved is not None and saved["world"] == pipe.world and saved["placement"] == _placement(pipe)


# -- RNG ---------------------------------------------------------------------------------------
def _rng_key(rank: int, kind: str) -> str:
    return f"pipecore.rng.rank{rank}.{kind}"


def _rng_states(pipe) -> dict[str, torch.Tensor]:
    """This rank's CPU generator state, and the CUDA one of its stages' device when that is CUDA."""
    states = {"cpu": torch.get_rng_state()}
    device = pipe.stages[0].device
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_state(pipe, kind: str, state: torch.Tensor) -> None:
    if kind == "cpu":
        torch.set_rng_state(state)
    elif pipe.stages[0].device.type == "cuda":
        torch.cuda.set_rng_state(state, pipe.stages[0].device)


# -- files and agreement -----------------------------------------------------------------------
def _normalise(path) -> str:
    return os.path.abspath(os.fspath(path))


def _pickled(extra: dict) -> bytes:
    # one opaque value: DCP would split a dict into keys that a load cannot know in advance
    try:
        return pickle.dumps(extra)
    except Exception as exc:
        raise InputError(f"extra cannot be pickled ({type(exc).__name__}: {exc}): give small picklable values such "
                         "as the step, scheduler.state_dict() or a data position") from exc


def _prepare_directory(path: str, staging: str) -> None:
    """Group rank 0, before any rank writes: `path` may be replaced, `staging` is empty."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise InputError(f"{path} is a file: give a directory for the checkpoint")
        if os.listdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in (LAYOUT_FILE, ".metadata")):
            raise InputError(f"{path} holds other files and no checkpoint: give a new or empty directory (a "
                             "previous checkpoint there is replaced)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    shutil.rmtree(staging, ignore_errors=True)  # what a save that died left


def _replace(staging: str, path: str) -> None:
    """Puts the finished `staging` at `path` (the previous checkpoint is removed once it is there)."""
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(staging, path)
    shutil.rmtree(old, ignore_errors=True)


def _gather(pipe, obj) -> list:
    """Every rank's `obj`, on every rank: the ranks agree before any of them writes or loads."""
    out = [None] * pipe.world
    dist.all_gather_object(out, obj, group=pipe.group)
    return out


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, InputError) else f"{type(exc).__name__}: {exc}"


def _rank_problems(problems: list[str | None]) -> list[str]:
    """The ranks' problems, said once when every rank has the same one."""
    found = [(r, p) for r, p in enumerate(problems) if p is not None]
    if found and len(found) == len(problems) and len({p for _, p in found}) == 1:
        return [found[0][1]]
    return [f"rank {r}: {p}" for r, p in found]
