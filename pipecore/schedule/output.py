"""Where pipecore writes a file (CSV, pictures, traces, the benchmarks' plots)."""

from __future__ import annotations

import os


def writable(path: str | os.PathLike) -> str:
    """`path` as a string, after creating the folders it needs: every writer of a file calls this first,
    so `--out results/run1/x.png` works in a fresh checkout."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    return path
