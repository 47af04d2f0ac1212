"""DTensors (FSDP2's parameters and gradients, tensor-parallel activations), recognised without
importing torch.distributed.tensor: no tensor can be a DTensor before it is imported, and importing
it costs a second."""

from __future__ import annotations

import itertools
import sys

import torch

from pipecore.errors import InputError


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


def layout_of(t: torch.Tensor, any_shape: bool = False) -> tuple | None:
    """How a DTensor crossing a stage boundary is rebuilt on the receiving stage: (its mesh's dimension
    names, the mesh's shape, its placements, its global shape and stride; those two None with
    `any_shape`, where messages carry their shapes); None for any other tensor. The mesh itself does not
    travel: the receiver uses its own mesh of those names and shape (`mesh_in`), as torch's stage does
    through get_mesh."""
    if not is_dtensor(t):
        return None
    mesh = t.device_mesh
    shape, stride = (None, None) if any_shape else (tuple(t.shape), tuple(t.stride()))
    if any_shape:  # the receiver derives the global shape from its part: exact only for even shards
        for i, p in enumerate(t.placements):
            dim = getattr(p, "dim", None)
            if dim is not None and t.shape[dim] % mesh.size(i):
                raise InputError(f"a DTensor of shape {tuple(t.shape)} sharded unevenly ({p} over {mesh.size(i)} "
                                 "ranks) crosses a stage boundary whose shapes travel in the messages: its "
                                 "receiver could not tell its global shape. Keep the sharded dimension a "
                                 "multiple of the mesh's size, or the batch's shapes fixed")
    return tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape), tuple(t.placements), shape, stride


def mesh_in(module: torch.nn.Module, names: tuple, shape: tuple):
    """A DeviceMesh of these dimension names and shape that `module`'s DTensor parameters or buffers
    live on (or a part of one: a (dp, tp) mesh holds a (tp,) one), or None."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if not is_dtensor(t):
            continue
        mesh = t.device_mesh
        held = tuple(mesh.mesh_dim_names or ())
        if names and held != names and set(names) <= set(held):
            mesh = mesh[names]
        if tuple(mesh.mesh_dim_names or ()) == names and tuple(mesh.shape) == shape:
            return mesh
    return None


def from_local(local: torch.Tensor, mesh, layout: tuple) -> torch.Tensor:
    """`local`, this rank's part of a DTensor of `layout` (`layout_of`), as that DTensor on `mesh`: no
    communication, and differentiable (its gradient comes back as this rank's part)."""
    _, _, placements, shape, stride = layout
    given = {} if shape is None else {"shape": torch.Size(shape), "stride": stride}
    return _module().DTensor.from_local(local, mesh, placements, run_check=False, **given)
