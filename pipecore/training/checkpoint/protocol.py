"""The collective steps of `save_checkpoint` and `load_checkpoint`. Every rank calls them; each first
checks what it can alone, then the ranks gather their problems (one gather through `Comm`, at the
group's own pace: see `Comm.patient_gather_objects`) and all raise the same InputError before
anything is written or loaded. Then DCP writes or reads over the pipeline's group, and a save ends
with group rank 0 putting the layout document and the finished directory in place (files.py) and
telling the others how that went.

A load reads into new tensors and copies them into the model and optimizer only after every rank read
everything: a failed load leaves them as they were (at the cost of one more copy of this rank's state
while loading)."""

from __future__ import annotations

import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp

from pipecore.errors import InputError
import pipecore.training.checkpoint.files as files
import pipecore.training.checkpoint.layout as layout
from pipecore.training.checkpoint.names import (EXTRA_KEY, OptimizerStateSwap, StageModules, optimizer_name, pickled,
                                                rng_key, rng_states, set_rng_state)


def save_checkpoint(path: str | os.PathLike, pipe, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None) -> None:
    """Saves every stage of `pipe`, `optimizer`'s state, rank 0's `extra` and every rank's RNG
    states to the directory `path` (created if missing; a previous checkpoint there is replaced).
    A collective: every rank of the pipeline's group calls it. Raises InputError on every rank,
    having written nothing, when a rank's arguments are wrong. With data-parallel replicas
    (`dp_group=`) every rank calls it too; replica 0 writes (the replicas' states are equal, RNG
    states included: each rank's are replica 0's after loading)."""
    path = files.normalise(path)
    dp = pipe.gradients.dp
    if dp is not None:  # data-parallel replicas hold the same state: replica 0 writes it
        if dp.wrapped:
            raise InputError(f"{pipe.who}: save_checkpoint saves plain stages; this Pipeline has stages wrapped "
                             "in DDP or FSDP2: save those with torch.distributed.checkpoint over the device mesh")
        failed = None
        if dp.rank == 0:
            try:
                _save(path, pipe, optimizer, extra)
            except BaseException as exc:
                failed = exc
        # the others wait with the group's own timeout (a save may take longer than a step)
        anyone = pipe.comm.patient_any(failed is not None, dp.group)
        if failed is not None:
            raise failed
        if anyone:
            raise RuntimeError(f"save_checkpoint({path!r}): data-parallel replica 0, which writes the checkpoint, "
                               "failed (its ranks raised why)")
        return
    _save(path, pipe, optimizer, extra)


def _save(path: str, pipe, optimizer, extra) -> None:
    staging = files.staging_of(path)
    rng = rng_states(pipe)  # first, as the caller left them
    problem, info, failure, state = None, None, None, {}
    try:
        stages = StageModules(pipe, optimizer)
        if extra is not None and not isinstance(extra, dict):
            raise InputError(f"extra must be a dict (step, scheduler state, data position) or None, got "
                             f"{type(extra).__name__}")
        model_state = stages.model_state()
        state.update(stages.saved(model_state))
        if optimizer is not None:
            state.update(stages.saved(stages.optimizer_state_for_save()))
        state.update({rng_key(pipe.rank, kind): value for kind, value in rng.items()})
        if pipe.rank == 0:
            state[EXTRA_KEY] = pickled(extra if extra is not None else {})
            files.prepare_directory(path, staging)  # before the agreement: no rank writes into staging earlier
        info = {"layout": layout.shapes(stages.saved(model_state)), "optimizer": optimizer_name(optimizer)}
    except Exception as exc:  # noqa: BLE001 - every rank learns it below and raises
        problem = _describe(exc)
        failure = exc
    rows, problems = _agreed_problems(pipe, problem, info, _different_optimizers)
    if problems:
        raise InputError(f"save_checkpoint({path!r}) wrote nothing: {'; '.join(problems)}") from (
            failure if problem is not None else None)

    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(staging), process_group=pipe.group)
    except Exception:
        if pipe.rank == 0:  # DCP raised on every rank: what was written is incomplete
            files.discard(staging)
        raise

    finished = None
    if pipe.rank == 0:
        try:
            document = layout.document(pipe, rows[0][1]["optimizer"], [row[1]["layout"] for row in rows])
            files.write_layout(staging, document)
            files.replace(staging, path)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others learnt it
            finished = exc
            files.discard(staging)
    outcome = pipe.comm.patient_gather_objects(None if finished is None else _describe(finished))[0]
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
    path = files.normalise(path)
    problem, info, failure = None, None, None
    saved: dict | None = None
    request, keep, stateless, swap = {}, {}, [], OptimizerStateSwap(optimizer)
    try:
        stages = StageModules(pipe, optimizer)
        model_state = stages.model_state()
        info = {"layout": layout.shapes(stages.saved(model_state)), "optimizer": optimizer_name(optimizer)}
        saved, stored = files.read_checkpoint(path)
        # what DCP reads into: new tensors for the model, the optimizer's state swapped for a fresh one
        request = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
                   for k, v in stages.saved(model_state).items()}
        if optimizer is not None:
            swap.swap()
            optim_state = stages.optimizer_state_for_load()
            local_problems, stateless = stages.check_optimizer_keys(optim_state, stored)
            if local_problems:
                raise InputError("; ".join(local_problems))
            for key, value in stages.saved(optim_state).items():
                if key in stored:
                    request[key] = value
                else:  # a param_groups entry the checkpoint lacks (initial_lr: no scheduler then) keeps its value;
                    keep[key] = value  # a parameter without saved state keeps its initial entries until set
        request[EXTRA_KEY] = b""
        if layout.same_placement(saved, pipe):
            for kind, value in rng_states(pipe).items():
                if rng_key(pipe.rank, kind) in stored:
                    request[rng_key(pipe.rank, kind)] = torch.empty_like(value)
    except Exception as exc:  # noqa: BLE001 - every rank learns it below and raises
        problem = _describe(exc)
        failure = exc
    _, problems = _agreed_problems(pipe, problem, info, lambda infos: _load_mismatch(path, pipe, saved, infos))
    if problems:
        swap.put_back()
        raise InputError(f"load_checkpoint({path!r}) loaded nothing: {'; '.join(problems)}") from (
            failure if problem is not None else None)

    try:
        dcp.load(request, storage_reader=dcp.FileSystemReader(path), process_group=pipe.group)
    except Exception:
        swap.put_back()
        raise

    # every rank read everything: copy it in
    stages.set_model_state({k: request[k] for k in model_state if k in request})
    if optimizer is not None:
        optim_state = {k: v for k, v in (*request.items(), *keep.items()) if k.startswith(("state.", "param_groups."))}
        stages.set_optimizer_state(optim_state, stateless)
    if not layout.same_placement(saved, pipe):
        warnings.warn(f"load_checkpoint({path!r}): the random number generators keep their states: the checkpoint "
                      f"was saved by {saved['world']} ranks holding model stages {saved['placement']}, this pipeline's "
                      f"{pipe.world} ranks hold {layout.placement(pipe)}", stacklevel=2)
    for kind in ("cpu", "cuda"):
        value = request.get(rng_key(pipe.rank, kind))
        if value is not None:
            set_rng_state(pipe, kind, value)
    return pickle.loads(request[EXTRA_KEY])


def _load_mismatch(path: str, pipe, saved: dict, infos: list[dict]) -> list[str]:
    """What keeps the checkpoint from loading into this pipeline (the same text on every rank)."""
    problems = layout.mismatch(path, pipe, saved, [info["layout"] for info in infos])
    different = _different_optimizers(infos)
    return problems + (different or layout.optimizer_mismatch(path, saved, infos[0]["optimizer"]))


def _different_optimizers(infos: list[dict]) -> list[str]:
    """The ranks must give optimizers of one class, or none on every rank."""
    if len({info["optimizer"] for info in infos}) == 1:
        return []
    names = ", ".join(f"rank {r} {info['optimizer'] or 'None'}" for r, info in enumerate(infos))
    return [f"the ranks gave different optimizers ({names}): pass each rank's optimizer on every rank, or none on "
            "every rank"]


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, InputError) else f"{type(exc).__name__}: {exc}"


def _agreed_problems(pipe, problem, info, mismatch) -> tuple[list, list[str]]:
    """Every rank's (problem, info), and what stops the save or load, the same list on every rank: each
    rank's own problem, or where none had one, what `mismatch` finds in every rank's `info`."""
    rows = pipe.comm.patient_gather_objects((problem, info))
    return rows, _rank_problems([row[0] for row in rows]) or mismatch([row[1] for row in rows])


def _rank_problems(problems: list[str | None]) -> list[str]:
    """The ranks' problems, said once when every rank has the same one."""
    found = [(r, p) for r, p in enumerate(problems) if p is not None]
    if found and len(found) == len(problems) and len({p for _, p in found}) == 1:
        return [found[0][1]]
    return [f"rank {r}: {p}" for r, p in found]
