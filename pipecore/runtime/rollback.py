"""Module state a step must not leave behind when it does not count.

A step does not count when it fails (this rank's error or a peer's) or runs again because a first
stage's batch changed shape. Its gradients are the caller's to zero (PeerFailedError says so) or
carry nothing (a "shapes changed" pass), but its forwards also draw random numbers (dropout) and
move buffers (batch-norm statistics). On NCCL a rank even computes on stand-in messages (zeros of
the old shapes) before it learns their status, since the host never waits for a message
(csrc/device_comm.h). `Rollback` saves RNG states and the buffers forwards change when a step
starts and puts them back when the step does not count, so the next run draws and normalises as
if the failed or replaced pass had never run.

A DTensor buffer (tensor parallelism's, e.g. a rope cache) is saved, compared and put back as the
part this rank holds: DTensor's own `torch.equal` reduces every rank's answer over the default group,
a collective per buffer that pipeline ranks holding different numbers of them would enter unevenly.

What it cannot put back is Python state a forward changes (a counter in an attribute)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipecore.stage.dtensor import is_dtensor


class Rollback:
    """RNG states and forward-changed buffers of `modules`, saved per run, restorable.

    Which buffers a forward changes is learnt by value in the runs that learn a batch signature's plan
    (where the host reads every message anyway, so comparing costs no extra wait): kernels such as batch norm's update
    their running statistics in place without moving the tensor's version counter. Buffers are looked
    up by owner and name at every save, so one a forward rebinds (`self.ema = 0.9 * self.ema + ...`)
    or that `.to()` replaced is the current one."""

    def __init__(self, modules: Sequence[nn.Module], devices: Sequence[torch.device]):
        self._slots = [(owner, name) for m in modules for owner in m.modules() for name in owner._buffers]
        self._cuda = sorted({d.index if d.index is not None else torch.cuda.current_device()
                             for d in devices if d.type == "cuda"})
        self._changing: list[int] = []  # slots some forward changed
        self._copies: dict[int, torch.Tensor] = {}  # slot -> its saved value (local part), kept from run to run
        self._layouts: dict[int, tuple | None] = {}  # slot -> its layout when saved (`_layout`; None: no DTensor)
        self._due: bool | None = None  # save at the next forward (learning: True) or not at all (None)
        self._learning = False
        self._saved: list[int] | None = None  # the slots saved in this run; None: nothing saved
        self._rng = None
        self._cuda_rng: list = []

    def arm(self, learn: bool) -> None:
        """Before a run of the step's program; `learn`: the run learns its batch signature's plan. The state
        is saved at the run's first forward (`before_forward`), where a failure to save (out of memory)
        is the rank's own error in the step, which releases its peers."""
        self._due, self._saved = learn, None

    def before_forward(self) -> None:
        if self._due is None:
            return
        learn, self._due = self._due, None
        self._rng = torch.get_rng_state()
        self._cuda_rng = [torch.cuda.get_rng_state(d) for d in self._cuda]  # host state: no device wait
        self._learning = learn
        with torch.no_grad():
            buffers = {i: self._buffer(i, saving=True) for i in (range(len(self._slots)) if learn else self._changing)}
            buffers = {i: b for i, b in buffers.items() if b is not None}
            same, into = [], []
            for i, b in buffers.items():
                if _fits(self._copies.get(i), b):
                    same.append(b)
                    into.append(self._copies[i])
                else:
                    self._copies[i] = b.clone()
            if into:
                torch._foreach_copy_(into, same)  # one launch per device and dtype, no allocation
        self._saved = list(buffers)

    def finished(self) -> None:
        """After a run that ended well."""
        if self._learning and self._saved is not None:
            seen = set(self._changing)
            self._changing += [i for i in self._saved if i not in seen and not self._same(i)]
            for i in set(self._saved) - set(self._changing):  # learnt unchanged: no copy kept
                self._copies.pop(i, None)
        self._due, self._saved, self._learning = None, None, False

    def restore(self) -> None:
        """After a run that does not count: RNG streams and buffers as when its first forward began."""
        self._due = None
        if self._saved is None:  # no forward ran: nothing moved
            return
        torch.set_rng_state(self._rng)
        for d, state in zip(self._cuda, self._cuda_rng):
            torch.cuda.set_rng_state(state, d)
        with torch.no_grad():
            for i in self._saved:
                b, copy = self._buffer(i), self._copies[i]
                if self._as_saved(i, b):
                    b.copy_(copy)
                else:  # the run rebound it to another shape, type or layout: the saved tensor becomes the buffer
                    owner, name = self._slots[i]
                    owner._buffers[name] = self._rebuilt(i, copy.clone())

    def restore_or_explain(self) -> str:
        """`restore()` for a step that failed or runs again: returns why it could not put everything
        back ('' if it did), since the step's own error is the one to raise."""
        try:
            self.restore()
        except Exception as exc:  # noqa: BLE001
            return f"pipecore: the step's RNG states and buffers could not be put back: {type(exc).__name__}: {exc}"
        return ""

    def _buffer(self, i: int, saving: bool = False) -> torch.Tensor | None:
        """Slot i's buffer as this rank holds it (under no_grad: a DTensor's local tensor itself, whose
        changes are the buffer's); `saving`: its layout is noted for `_rebuilt`."""
        owner, name = self._slots[i]
        b = owner._buffers.get(name)
        if saving:
            self._layouts[i] = _layout(b)
        return b.to_local() if is_dtensor(b) else b

    def _as_saved(self, i: int, held: torch.Tensor | None) -> bool:
        """Is slot i's buffer, whose local part is `held`, laid out as when it was saved (the saved
        values can be copied into it)?"""
        owner, name = self._slots[i]
        return _fits(held, self._copies[i]) and _layout(owner._buffers.get(name)) == self._layouts.get(i)

    def _rebuilt(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """A saved local part as the buffer it was: a DTensor of its layout again (no communication)."""
        if self._layouts.get(i) is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = self._layouts[i]
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def _same(self, i: int) -> bool:
        with torch.no_grad():
            b, copy = self._buffer(i), self._copies[i]
            return self._as_saved(i, b) and torch.equal(b, copy)


def _layout(t: torch.Tensor | None) -> tuple | None:
    """A DTensor's layout (mesh, placements, global shape and stride); None for any other tensor."""
    return (t.device_mesh, tuple(t.placements), t.shape, t.stride()) if is_dtensor(t) else None


def _fits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Can one be copied into the other as it is (same shape, dtype and device)?"""
    return a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
