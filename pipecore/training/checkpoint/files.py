"""A checkpoint's files: a save writes into a staging directory beside the checkpoint and replaces the
previous checkpoint only once it is complete; a load first reads the layout document and DCP's index
of what is stored. The path must be on a file system every rank sees."""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed.checkpoint as dcp

from pipecore.errors import InputError
from pipecore.version import __version__

LAYOUT_FILE = "pipecore.json"  # the layout document (pipecore/training/checkpoint/layout.py)
FORMAT = 1  # of the layout document this version writes and reads


def normalise(path) -> str:
    return os.path.abspath(os.fspath(path))


def staging_of(path: str) -> str:
    """Where a save of `path` writes until it is complete."""
    return path + ".saving"


def prepare_directory(path: str, staging: str) -> None:
    """Group rank 0, before any rank writes: `path` may be replaced, `staging` is empty."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise InputError(f"{path} is a file: give a directory for the checkpoint")
        if os.listdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in (LAYOUT_FILE, ".metadata")):
            raise InputError(f"{path} holds other files and no checkpoint: give a new or empty directory (a "
                             "previous checkpoint there is replaced)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    discard(staging)  # what a save that died left


def write_layout(staging: str, document: dict) -> None:
    with open(os.path.join(staging, LAYOUT_FILE), "w") as f:
        json.dump(document, f, indent=1)


def replace(staging: str, path: str) -> None:
    """Puts the finished `staging` at `path` (the previous checkpoint is removed once it is there)."""
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(staging, path)
    shutil.rmtree(old, ignore_errors=True)


def discard(staging: str) -> None:
    """An unfinished save's directory goes."""
    shutil.rmtree(staging, ignore_errors=True)


def read_checkpoint(path: str) -> tuple[dict, dict]:
    """The layout document and DCP's {key: storage metadata}, or InputError: no checkpoint there."""
    if not os.path.isdir(path):
        what = "it is a file" if os.path.exists(path) else "the directory does not exist"
        raise InputError(f"no checkpoint at {path}: {what}. Give the directory save_checkpoint wrote")
    layout_file = os.path.join(path, LAYOUT_FILE)
    if not os.path.isfile(layout_file):
        unfinished = f" ({staging_of(path)} is a save that did not finish)" if os.path.isdir(staging_of(path)) else ""
        raise InputError(f"no pipecore checkpoint at {path}: it has no {LAYOUT_FILE}{unfinished}. Give the directory "
                         "save_checkpoint wrote")
    with open(layout_file) as f:
        layout = json.load(f)
    if layout.get("format") != FORMAT:
        raise InputError(f"{layout_file} is of format {layout.get('format')!r}, pipecore {__version__} reads format "
                         f"{FORMAT}")
    return layout, dcp.FileSystemReader(path).read_metadata().state_dict_metadata
