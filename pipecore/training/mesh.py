"""The data x pipeline device mesh: which ranks form a pipeline, which replicate one stage.

    mesh = pc.init_mesh(dp=2, pp=2)          # on 4 ranks
    pipe = pc.Pipeline(stages, "1f1b", m, loss_fn, group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"))

A torch DeviceMesh with dimensions ("dp", "pp") over the default group: rank = d * pp + p, so a
pipeline is `pp` consecutive ranks (its point-to-point traffic stays between neighbours, within a
node where nodes hold consecutive ranks) and stage position p is replicated on ranks p, pp + p, ...
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def init_mesh(dp: int = 1, pp: int = 1, *, device_type: str | None = None) -> DeviceMesh:
    """A DeviceMesh of shape (dp, pp) named ("dp", "pp") over every rank of the default group.

    Checks before any communication that dp x pp is the world size. `device_type`: "cpu" for a
    gloo world, "cuda" where the default group runs NCCL (guessed from the backend when omitted)."""
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs torch.distributed: call dist.init_process_group first")
    for name, value in (("dp", dp), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"init_mesh: {name} must be a positive integer, got {value!r}")
    world = dist.get_world_size()
    if dp * pp != world:
        raise ValueError(f"init_mesh: dp x pp must equal the world size, but dp={dp} x pp={pp} = {dp * pp} and the "
                         f"world has {world} ranks (rank {dist.get_rank()}). Choose dp and pp with dp * pp == "
                         f"{world}")
    if device_type is None:
        backend = str(dist.get_backend())
        device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))


__all__ = ["init_mesh"]
