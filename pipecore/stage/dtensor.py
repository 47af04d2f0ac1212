"""DTensors (FSDP2's parameters and gradients, tensor-parallel activations), recognised without
importing torch.distributed.tensor: no tensor can be a DTensor before it is imported, and importing
it costs a second."""

from __future__ import annotations

import sys

import torch


def _module():
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(t) -> bool:
    dt = _module()
    return dt is not None and isinstance(t, dt.DTensor)


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor sharded over some mesh dimension (an FSDP2 parameter or gradient)."""
    return is_dtensor(t) and any(isinstance(p, _module().Shard) for p in t.placements)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t
