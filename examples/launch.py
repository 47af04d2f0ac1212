"""Starting an example's ranks on this machine's CPUs: torchrun when not started by it, then gloo."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist


def under_torchrun(ranks: int) -> None:
    """Not started by torchrun: start the calling script under it, one process per rank on this
    machine, and exit with its status; under torchrun: return."""
    if "LOCAL_RANK" in os.environ:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           os.path.abspath(sys.argv[0]), *sys.argv[1:]]
    print("launching:", " ".join(cmd[2:]), flush=True)
    sys.exit(subprocess.call(cmd))


def init_gloo() -> tuple[int, int]:
    """The process group over gloo, the machine's cores shared between its ranks: (rank, world)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()
