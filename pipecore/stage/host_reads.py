"""Bytes between the host and a CUDA device without a synchronising call: a step on the device path
never makes the host wait for the whole device (`torch.cuda.set_sync_debug_mode("error")` holds in
tests/test_cuda.py). Uploads go from pinned memory (from pageable memory the host waits for the
device); a read is a copy to pinned memory whose event the host polls, up to a deadline, so a stuck
device ends in a timeout, not a hang."""

from __future__ import annotations

import time

import torch


def to_device(data: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`data` (on the host) on `device`, queued on the current stream."""
    if device.type != "cuda":
        return data.to(device)
    return data.pin_memory().to(device, non_blocking=True)  # (the host allocator keeps it until the copy ran)


def to_host(data: torch.Tensor, deadline: float) -> bytes | None:
    """`data`'s bytes once the current stream reached it; None if that was not before `deadline`
    (time.monotonic())."""
    if data.device.type != "cuda":
        return data.numpy().tobytes()
    host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
    host.copy_(data, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host.numpy().tobytes() if _poll(copied, deadline) else None


def _poll(event, deadline: float) -> bool:
    """Whether `event` completed before `deadline` (queried, never synchronized)."""
    pause = 1e-5
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 5e-4)
    return True
