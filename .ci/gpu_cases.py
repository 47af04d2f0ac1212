"""The multi-GPU cases of `make gpu-check` (.ci/gpu_check.py), one per run, under torchrun: one process
per GPU, NCCL. `--cpu` runs them on gloo (the check's own dry run). Each rank prints one line,
`RESULT <rank> <ok|FAIL> <detail>`."""

from __future__ import annotations

import argparse
import copy
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import pipecore as pc
from pipecore.errors import CommunicationError, InputError


def _setup(cpu: bool):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", **({} if cpu else {"device_id": device}))
    return rank, world, device


def _grads_match(stage, ref, rank) -> str:
    worst = 0.0
    for p, q in zip(stage.module.parameters(), ref[rank].parameters()):
        worst = max(worst, ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item())
    return "" if worst <= 1e-12 else f"gradient differs by {worst:.2e} of its largest entry"


def growth(rank, world, device) -> str:
    """variable_shapes=True, float64, sequences that grow past 8 MiB per message (64 MiB), then shrink."""
    torch.manual_seed(0)
    model = [nn.Linear(128, 128).double().to(device) for _ in range(world)]
    ref = copy.deepcopy(model)
    stage = pc.PipelineStage(copy.deepcopy(model[rank]), rank, world)
    pipe = pc.Pipeline(stage, pc.build_schedule("1f1b", world, 2, 1), 2, loss_fn=nn.MSELoss(), timeout=120,
                       variable_shapes=True)
    for step, length in enumerate([64, 32, 65536, 32768]):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(2, length, 128, generator=g, dtype=torch.float64).to(device) for _ in range(2))
        for q in [*stage.module.parameters(), *(p for m in ref for p in m.parameters())]:
            q.grad = None
        pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
        out = x
        for m in ref:
            out = m(out)
        nn.MSELoss()(out, y).backward()
        problem = _grads_match(stage, ref, rank)
        if problem:
            return f"step {step} (length {length}): {problem}"
    return ""


class _Side(nn.Module):
    def __init__(self, first):
        super().__init__()
        self.first, self.fc = first, nn.Linear(16, 16)

    def forward(self, h, mask=None, freqs=None):
        if self.first:
            with torch.no_grad():
                mask = (h[..., :4] > 0).to(torch.int16)
                freqs = torch.polar(torch.ones_like(h[..., :4]).float(), h[..., :4].float())
            return torch.tanh(self.fc(h)), mask, freqs
        return self.fc(h) + (mask.to(h.dtype) * freqs.real.to(h.dtype)).sum(-1, keepdim=True)


def complex_boundary(rank, world, device) -> str:
    """A complex64 and an int16 tensor beside the activations, on 2 ranks."""
    torch.manual_seed(0)
    model = [_Side(True).double().to(device), _Side(False).double().to(device)]
    ref = copy.deepcopy(model)
    stage = pc.PipelineStage(copy.deepcopy(model[rank]), rank, world)
    pipe = pc.Pipeline(stage, pc.build_schedule("1f1b", world, 4, 1), 4, loss_fn=nn.MSELoss(), timeout=60)
    x, y = (torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(k)).to(device)
            for k in range(2))
    pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
    nn.MSELoss()(ref[1](*ref[0](x)), y).backward()
    return _grads_match(stage, ref, rank)


def shapes_on_one_rank(rank, world, device) -> str:
    """variable_shapes=True on rank 0 only: an InputError on every rank, not a hang."""
    stage = pc.PipelineStage(nn.Linear(16, 16).to(device), rank, world)
    pipe = pc.Pipeline(stage, pc.build_schedule("1f1b", world, 2, 1), 2, loss_fn=nn.MSELoss(), timeout=60,
                       variable_shapes=rank == 0)
    x, y = torch.randn(4, 16, device=device), torch.randn(4, 16, device=device)
    start = time.monotonic()
    try:
        pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
    except InputError as exc:
        return "" if "variable_shapes" in str(exc) else f"InputError without the fix: {exc}"
    return f"no error after {time.monotonic() - start:.1f} s"


def stopped_rank(rank, world, device) -> str:
    """Rank 1 stops itself (SIGSTOP) before its third step: rank 0 raises CommunicationError with the
    abort of the communicator within its timeout (10 s), not by c10d's watchdog. (The check kills the
    stopped rank.)"""
    stage = pc.PipelineStage(nn.Linear(16, 16).to(device), rank, world)
    pipe = pc.Pipeline(stage, pc.build_schedule("1f1b", world, 4, 1), 4, loss_fn=nn.MSELoss(), timeout=10)
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 16, device=device)
    for step in range(3):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
        start = time.monotonic()
        try:
            pipe.step(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None)
        except CommunicationError as exc:
            seconds = time.monotonic() - start
            wanted = "aborted the group's NCCL communicator" in str(exc) or device.type == "cpu"
            return "" if wanted and seconds < 30 else f"after {seconds:.1f} s: {exc}"
    return "" if rank == 1 else "rank 1 stopped, and the step still finished"


CASES = {"growth": growth, "complex_boundary": complex_boundary, "shapes_on_one_rank": shapes_on_one_rank,
         "stopped_rank": stopped_rank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    rank, world, device = _setup(args.cpu)
    try:
        problem = CASES[args.case](rank, world, device)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    print(f"RESULT {rank} {'FAIL' if problem else 'ok'} {problem}", flush=True)
    os._exit(0)  # no teardown: a stopped or failed peer could block it


if __name__ == "__main__":
    main()
