"""Python-side phases of a step as NVTX ranges, so that they show in Nsight Systems beside the
executor's per-action ranges (the `nvtx` package; a no-op without it)."""

from __future__ import annotations

from contextlib import nullcontext

try:
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - optional
    _nvtx = None


def nvtx_range(name: str):
    """A context manager: an NVTX range named `name` in the "pipecore" domain."""
    if _nvtx is None:
        return nullcontext()
    return _nvtx.annotate(name, domain="pipecore")
