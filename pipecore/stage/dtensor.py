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


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def rows_held(t: torch.Tensor) -> tuple:
    """Which entries of `t` this rank holds, as a (start, length) per dimension: the whole tensor for a
    plain one; for a DTensor sharded (torch.chunk's rule, FSDP2's) or replicated over its mesh, the
    block its mesh coordinate holds. Two ranks whose values agree hold the same entries. A DTensor of
    other placements is described by its layout (placements, mesh shape, coordinate) instead."""
    if not is_dtensor(t):
        return tuple((0, n) for n in t.shape)
    dt = _module()
    mesh, placements = t.device_mesh, t.placements
    coordinate = mesh.get_coordinate()
    ranges = [(0, n) for n in t.shape]
    if coordinate is None or not all(type(p) in (dt.Shard, dt.Replicate) for p in placements):
        return ("layout", repr(tuple(placements)), tuple(mesh.shape), tuple(coordinate or ()))
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, dt.Shard):
            start, length = ranges[p.dim]
            chunk = -(-length // mesh.size(mesh_dim))  # torch.chunk: ceil-sized pieces, the last ones short
            first = min(start + coordinate[mesh_dim] * chunk, start + length)
            ranges[p.dim] = (first, min(chunk, start + length - first))
    return tuple(ranges)
