"""A checkpoint's layout: which rank holds which model stages, and the layout document
(`pipecore.json`: per model stage, its state names and shapes; the schedule, world size, placement,
optimizer class and pipecore version) that a load compares with its own pipeline before reading
anything else, so that a checkpoint of another stage layout fails on every rank with one message."""

from __future__ import annotations

from typing import Any

import torch

from pipecore.training.checkpoint.files import FORMAT
from pipecore.training.checkpoint.names import natural
from pipecore.version import __version__

MAX_LISTED = 8  # differing keys named per kind in a layout error


def placement(pipe) -> list[list[int]]:
    """Per rank, the model stages of its pipeline stages in stage order."""
    topo = pipe.schedule.topology
    return [[topo.model_stage[s] for s in range(len(topo.stage_rank)) if topo.stage_rank[s] == r]
            for r in range(pipe.world)]


def same_placement(saved: dict | None, pipe) -> bool:
    """Does every rank hold the model stages it held at the save (then its RNG streams continue)?"""
    return saved is not None and saved["world"] == pipe.world and saved["placement"] == placement(pipe)


def shapes(entries: dict[str, Any]) -> dict[str, list[int] | None]:
    """{key: shape} of a rank's saved model entries (None: not a tensor)."""
    return {k: list(v.shape) if isinstance(v, torch.Tensor) else None for k, v in entries.items()}


def document(pipe, optimizer: str | None, layouts: list[dict]) -> dict:
    """The layout document, from every rank's `shapes`."""
    stages: dict[str, dict] = {f"stage{j}": {} for j in range(_model_stage_count(pipe))}
    for layout in layouts:
        for key, shape in layout.items():
            stage, _, name = key.partition(".")
            stages[stage][name] = shape
    return {"format": FORMAT, "pipecore": __version__, "schedule": pipe.schedule.name or "a custom Schedule",
            "world": pipe.world, "model_stages": len(stages), "placement": placement(pipe), "optimizer": optimizer,
            "stages": stages}


def mismatch(path: str, pipe, saved: dict, layouts: list[dict]) -> list[str]:
    """What in the saved layout document keeps the checkpoint from loading into this pipeline, whose
    ranks' `shapes` are `layouts` (the same text on every rank)."""
    here: dict[str, list[int] | None] = {}
    for layout in layouts:
        here.update(layout)
    there = {f"{stage}.{name}": shape for stage, names in saved["stages"].items() for name, shape in names.items()}
    only_there = sorted((k for k in there if k not in here), key=natural)
    only_here = sorted((k for k in here if k not in there), key=natural)
    differ = sorted((k for k in there if k in here and there[k] != here[k]), key=natural)
    if not (only_there or only_here or differ):
        return []
    details = []
    if only_there:
        details.append(f"only in the checkpoint: {_listed(only_there)}")
    if only_here:
        details.append(f"only here: {_listed(only_here)}")
    if differ:
        details.append("other shapes: " + _listed([f"{k} ({there[k]} there, {here[k]} here)" for k in differ]))
    details[0] = details[0][0].upper() + details[0][1:]
    return [f"checkpoint {path} was saved by a pipeline of {saved['model_stages']} model stages (schedule "
            f"{saved['schedule']} on {saved['world']} ranks); this one has {_model_stage_count(pipe)} model stages "
            f"(schedule {pipe.schedule.name or 'a custom Schedule'} on {pipe.world} ranks). {'; '.join(details)}. "
            "Load it into the same stage layout: the same model split into the same stages (the schedule and the "
            "number of ranks may differ)"]


def optimizer_mismatch(path: str, saved: dict, given: str | None) -> list[str]:
    """What keeps the checkpoint's optimizer state from loading into the optimizer class every rank
    gave (`given`; None: no optimizer)."""
    if given is not None and saved["optimizer"] is None:
        return [f"checkpoint {path} holds no optimizer state (it was saved without an optimizer): load it "
                "with optimizer=None"]
    if given is not None and given != saved["optimizer"]:
        return [f"checkpoint {path} holds the state of a {saved['optimizer']}, this optimizer is a "
                f"{given}: load it into the same kind of optimizer"]
    return []


def _model_stage_count(pipe) -> int:
    return len(set(pipe.schedule.topology.model_stage))


def _listed(items: list[str]) -> str:
    more = len(items) - MAX_LISTED
    return ", ".join(items[:MAX_LISTED]) + (f" and {more} more" if more > 0 else "")
