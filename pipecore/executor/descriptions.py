"""Boundary descriptions between ranks: the first step of a batch signature (pipecore/runtime/discovery.py)
sends what each stage's output is to the rank of the next stage point to point, as messages travel,
never through the store (whose server one rank holds for every pipeline of the job).

A description is one chunk of CHUNK bytes: a header of int64 words (MAGIC, the step, the stage, the
microbatch, the payload's length or -1 for "no output: the step failed before this forward"), then the
first bytes of the payload; a longer payload's rest follows at its exact size. Messages from one rank
arrive in the order that rank sent them: on the pipeline's gloo group under a tag of their own
(DESCRIPTION_TAG, csrc/comm.h), or on a communicator of their own where the group has no gloo (NCCL
matches by order alone, so they must not share the stages' communicator). A receiver takes a peer's
descriptions in that order and keeps those it does not need yet, so a sender's order (its forwards')
need not be the receiver's (its receives'). One left from an earlier step, which a receiver's aborted
step no longer read, is dropped by its step.

On CUDA the chunks are sent and received on a stream of their own, which waits for nothing else: a
description must not queue behind the step's batches, whose transfers may need the receiver to read
it first. The host reads a received chunk through pinned memory, polling its event (a stuck peer ends
in a timeout, not in a hang).
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from datetime import timedelta

import torch

from pipecore.stage.host_reads import to_device, to_host
from pipecore.executor.native import C

CHUNK = 1024  # bytes of a description's first message: most boundaries' descriptions fit in one
_HEADER = struct.Struct("<5q")
MAGIC = 0x70697065_64657363  # "pipedesc"
DESCRIPTION_TAG: int = C.DESCRIPTION_TAG


class DescriptionTimeout(Exception):
    """A description did not arrive within the timeout (its sender hung, died, or is still in its forward)."""


class OutOfStep(Exception):
    """What arrived is not a description: the channel to that peer is out of step."""


class Descriptions:
    """Sends and receives boundary descriptions over `backend` (a process group, or a communicator of
    its own), on `device` (CPU for gloo), under `tag`."""

    def __init__(self, backend, tag: int, device: torch.device):
        self._backend = backend
        self._tag = tag
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._post = threading.Lock()  # a description's chunks follow each other (pairs send from two threads)
        self._sending: list[tuple[list, list[torch.Tensor]]] = []  # (Works, their buffers) until settled
        self._kept: dict[int, dict[tuple[int, int, int], bytes | None]] = {}  # per peer: arrived, not yet asked for
        self._stuck: list[torch.Tensor] = []  # buffers of receives that timed out (the transfer may still write)

    def send(self, peer: int, step: int, stage: int, mb: int, payload: bytes | None) -> None:
        """Stage `stage`'s output for `mb` in `step` is described by `payload` (None: there is none)."""
        data = payload or b""
        room = CHUNK - _HEADER.size
        first = _HEADER.pack(MAGIC, step, stage, mb, -1 if payload is None else len(data)) + data[:room]
        parts = [first.ljust(CHUNK, b"\0")] + ([data[room:]] if len(data) > room else [])
        with self._post:
            with self._on_stream():
                wire = [to_device(torch.frombuffer(bytearray(p), dtype=torch.uint8), self._device) for p in parts]
                works = [self._backend.send([t], peer, self._tag) for t in wire]
            self._sending.append((works, wire))

    def receive(self, peer: int, step: int, stage: int, mb: int, timeout: float) -> bytes | None:
        """The payload of stage `stage`'s output for `mb` in `step`, from `peer` (None: it has none).
        Raises DescriptionTimeout after `timeout` seconds, OutOfStep if something else arrived."""
        kept = self._kept.setdefault(peer, {})
        for key in [k for k in kept if k[0] < step]:
            del kept[key]  # left from an earlier step
        deadline = time.monotonic() + timeout
        while (step, stage, mb) not in kept:
            first = self._take(peer, CHUNK, deadline)
            magic, their_step, their_stage, their_mb, length = _HEADER.unpack_from(first)
            if magic != MAGIC:
                raise OutOfStep(f"{CHUNK} bytes from rank {peer} that are not a boundary description")
            room = CHUNK - _HEADER.size
            data = first[_HEADER.size:_HEADER.size + max(length, 0)]
            if length > room:
                data += self._take(peer, length - room, deadline)
            if their_step >= step:
                kept[(their_step, their_stage, their_mb)] = None if length < 0 else data
        return kept.pop((step, stage, mb))

    def settle(self, timeout: float) -> None:
        """After a step every rank ran to its end: each description sent so far was read (a receiver
        reads a peer's descriptions in order, an earlier step's too), so their sends are complete; their
        buffers go. (A gloo send counts as complete only once waited for, and one whose Work is dropped
        may never arrive.)"""
        with self._post:
            for works, _ in self._sending:
                for work in works:
                    work.wait(timedelta(seconds=timeout))
            self._sending.clear()

    @property
    def unsettled(self) -> int:
        """Descriptions sent and not yet known to be read."""
        return len(self._sending)

    def waiting(self, peer: int, step: int, stage: int, mb: int) -> bool:
        """Whether that description already arrived (read, and kept for it)."""
        return (step, stage, mb) in self._kept.get(peer, {})

    def _take(self, peer: int, size: int, deadline: float) -> bytes:
        """The next `size` bytes from `peer`."""
        with self._on_stream():
            buffer = torch.empty(size, dtype=torch.uint8, device=self._device)
            work = self._backend.recv([buffer], peer, self._tag)
            if self._stream is None:
                try:
                    done = work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                except RuntimeError:  # (gloo: its connections are closed then)
                    done = False
            else:
                done = True
                work.wait()  # (this stream waits for the transfer; the host does not)
            data = to_host(buffer, deadline) if done else None  # (on a device: read after the transfer)
        if data is None:
            self._stuck.append(buffer)
            raise DescriptionTimeout(f"nothing arrived from rank {peer}")
        return data

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

