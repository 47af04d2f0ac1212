"""What crosses a stage boundary for one microbatch, and how it travels.

A stage's output goes to the next stage as one message: its tensors in flattening order, then, when
the output also holds other values (ints, floats, bools, None, small picklable objects), one byte
tensor carrying those values pickled, so that they reach the next stage as the forward returned
them, every step. A `Boundary` describes such a message: the output's structure, each tensor's
shape, dtype and gradient flag, and the byte tensor's capacity. The first step of each batch signature
learns every boundary from the forwards it runs (pipecore/runtime/discovery.py); later steps check
every output against them: its shapes too on the device path, its structure, dtypes, ranks and
gradient flags where messages carry their shapes (gloo: `any_shape`).
"""

from __future__ import annotations

import hashlib
import io
import math
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from pipecore.errors import InputError
from pipecore.stage.dtensor import from_local, is_dtensor, layout_of, local_part
from pipecore.stage.host_reads import to_device, to_host


@dataclass(frozen=True)
class TensorMeta:
    """A tensor as it travels: this rank's part of it (a DTensor's local tensor), and for a DTensor
    its `layout` (stage/dtensor.py layout_of), with which the receiver rebuilds it."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    layout: tuple | None = None

    @staticmethod
    def of(t: torch.Tensor, any_shape: bool = False) -> "TensorMeta":
        """`any_shape`: the shape as its rank only (each dimension -1), where messages carry shapes."""
        local = local_part(t)
        return TensorMeta((-1,) * local.dim() if any_shape else tuple(local.shape), t.dtype,
                          bool(t.requires_grad and t.is_floating_point()), layout_of(t, any_shape))

    def anyshaped(self) -> "TensorMeta":
        layout = None if self.layout is None else (*self.layout[:3], None, None)
        return TensorMeta((-1,) * len(self.shape), self.dtype, self.requires_grad, layout)

    def meta_tensor(self) -> torch.Tensor:
        t = torch.empty(self.shape, dtype=self.dtype, device="meta")
        return t.requires_grad_(self.requires_grad) if self.requires_grad else t


def describe(tree: Any, any_shape: bool = False) -> Any:
    """`tree` with every tensor replaced by its TensorMeta (picklable, comparable); `any_shape`: with
    their ranks, not their shapes."""
    return tree_map(lambda x: TensorMeta.of(x, any_shape) if isinstance(x, torch.Tensor) else x, tree)


def signature(obj: Any) -> int:
    """A stable 62-bit hash of a description (equal shapes/dtypes/values give equal hashes)."""
    data = pickle.dumps(obj, protocol=4)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 62) - 1)


def tensor_leaves(desc: Any) -> list[TensorMeta]:
    return [x for x in tree_flatten(desc)[0] if isinstance(x, TensorMeta)]


def as_call(value: Any) -> tuple[tuple, dict]:
    """How a stage's output feeds the next stage: tuple/list -> positional args, dict -> kwargs."""
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    return (value,), {}


# The byte tensor of a message's values: a 4-byte length, then the pickled values. Its capacity is
# fixed on the first step of a batch signature (receives are posted at that size): room for values that
# grow, within reason.
_LENGTH_BYTES = 4
_MIN_VALUE_BYTES = 256


@dataclass(frozen=True)
class Boundary:
    """One microbatch's message from a stage to the next (see the module doc)."""
    tree: Any             # the output with TensorMeta for its tensors; other values as of the first step
    value_bytes: int = 0  # capacity of the values' byte tensor; 0: the output holds only tensors
    tensors: tuple = field(init=False, repr=False, compare=False)
    # the tree flattened once: its leaves and structure, compared and rebuilt every step
    _leaves: tuple = field(init=False, repr=False, compare=False)
    _spec: Any = field(init=False, repr=False, compare=False)
    single: bool = field(init=False, repr=False, compare=False)  # the output is one tensor, in no container

    def __post_init__(self):
        leaves, spec = tree_flatten(self.tree)
        object.__setattr__(self, "_leaves", tuple(leaves))
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "tensors", tuple(x for x in leaves if isinstance(x, TensorMeta)))
        object.__setattr__(self, "single", isinstance(self.tree, TensorMeta))

    def fits(self, t: torch.Tensor, any_shape: bool = False) -> bool:
        """Whether tensor `t`, a stage's whole output, fits a `single` boundary: the steady path's
        check, without flattening (`mismatch` says what differs); `any_shape`: of any shape of its rank
        (messages carry their shapes)."""
        m = self.tree
        if m.layout is not None or is_dtensor(t):
            return TensorMeta.of(t, any_shape) == (m.anyshaped() if any_shape else m)
        return t.dtype == m.dtype and (t.dim() == len(m.shape) if any_shape else t.shape == m.shape) and \
            (t.requires_grad and t.is_floating_point()) == m.requires_grad

    @staticmethod
    def of(out: Any, what: str) -> "Boundary":
        """The boundary of output `out` (`what` names it in errors)."""
        leaves = tree_flatten(out)[0]
        tree = describe(out)
        values = _values(leaves)
        if not values:
            return Boundary(tree)
        size = len(_pickled(values, what))
        return Boundary(tree, max(_MIN_VALUE_BYTES, 2 * (size + _LENGTH_BYTES) + 63 & ~63))

    def metas(self) -> list[TensorMeta]:
        """The message's tensors: the output's, then the values' byte tensor (no gradient)."""
        extra = [TensorMeta((self.value_bytes,), torch.uint8, False)] if self.value_bytes else []
        return [*self.tensors, *extra]

    def meta_tensors(self) -> list[torch.Tensor]:
        """metas() as meta tensors, as the executor takes shapes."""
        return [m.meta_tensor() for m in self.metas()]

    def mismatch(self, leaves: list, spec: Any, any_shape: bool = False) -> str | None:
        """Why an output, flattened to `leaves` and `spec` (tree_flatten), does not fit this boundary
        (None: it does); `any_shape`: its tensors may have any shapes of their ranks."""
        if spec != self._spec or [isinstance(x, torch.Tensor) for x in leaves] != [
                isinstance(x, TensorMeta) for x in self._leaves]:
            out = tree_unflatten(leaves, spec)
            return (f"an output structured as {_structure(out)} where the first step had {_structure(self.tree)} "
                    "(a list or tuple is structure: one whose length changes travels as a tensor, or inside an "
                    "object torch's pytree does not flatten, pickled)")
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        want = [m.anyshaped() if any_shape else m for m in self.tensors]
        if any(TensorMeta.of(t, any_shape) != w for t, w in zip(tensors, want)):
            got = [_show(TensorMeta.of(t, any_shape)) for t in tensors]
            want = [_show(w) for w in want]
            return f"tensors {got} where {want} were expected"
        return None

    def encode(self, leaves: list, device: torch.device, what: str) -> list[torch.Tensor]:
        """The message of an output flattened to `leaves` (which fits this boundary)."""
        # a DTensor sends this rank's part (to_local: its gradient comes back as this rank's part too)
        tensors = [local_part(x) for x in leaves if isinstance(x, torch.Tensor)]
        if not self.value_bytes:
            return tensors
        data = _pickled(_values(leaves), what)
        if len(data) + _LENGTH_BYTES > self.value_bytes:
            raise InputError(f"{what} holds non-tensor values of {len(data)} bytes pickled, but its messages carry at "
                             f"most {self.value_bytes - _LENGTH_BYTES} (sized on the first step of this batch "
                             "signature): return large values as tensors")
        buf = bytearray(self.value_bytes)
        buf[:_LENGTH_BYTES] = len(data).to_bytes(_LENGTH_BYTES, "little")
        buf[_LENGTH_BYTES:_LENGTH_BYTES + len(data)] = data
        return [*tensors, to_device(torch.frombuffer(buf, dtype=torch.uint8), device)]

    def decode(self, received: list[torch.Tensor], timeout: float = math.inf, mesh_for=None) -> Any:
        """The output a message carried: its tensors (DTensors rebuilt on `mesh_for(names, shape)`, the
        receiving stage's mesh), and its values as sent this step (read on the host: TimeoutError if they
        had not arrived within `timeout` seconds)."""
        if any(m.layout is not None for m in self.tensors):
            received = [t if m.layout is None else from_local(t, mesh_for(*m.layout[:2]), _layout_for(t, m))
                        for t, m in zip(received, self.tensors)] + list(received[len(self.tensors):])
        if self.single:
            return received[0]
        tensors = iter(received)
        values = None
        if self.value_bytes:
            raw = to_host(received[len(self.tensors)], time.monotonic() + timeout)  # a device's values to the host
            if raw is None:
                raise TimeoutError("its non-tensor values did not arrive")
            size = int.from_bytes(raw[:_LENGTH_BYTES], "little")
            # zero: an aborted message whose status the device checks later (its payload is zeros); the
            # first step's values stand in, the step fails at its end anyway
            values = iter(pickle.loads(raw[_LENGTH_BYTES:_LENGTH_BYTES + size])) if size else None
        out = [next(tensors) if isinstance(x, TensorMeta) else (next(values) if values else x) for x in self._leaves]
        return tree_unflatten(out, self._spec)


def _values(leaves: list) -> list:
    return [x for x in leaves if not isinstance(x, torch.Tensor)]


class _HiddenTensor(Exception):
    pass


class _ValuePickler(pickle.Pickler):
    """Pickles values, refusing tensors: a tensor inside an object pytree does not flatten (a
    dataclass, a namespace) would travel as a copy, cut from the autograd graph."""

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            raise _HiddenTensor
        return None


def _pickled(values: list, what: str) -> bytes:
    buf = io.BytesIO()
    try:
        _ValuePickler(buf, protocol=4).dump(values)
    except _HiddenTensor:
        kinds = sorted({type(v).__name__ for v in values if not isinstance(v, (int, float, bool, str, type(None)))})
        raise InputError(f"{what} holds a tensor inside a {' or '.join(kinds) or 'value'} that torch's pytree does not "
                         "flatten: it would reach the next stage without its gradient. Return tensors in tuples, lists "
                         "or dicts, or register the class (torch.utils._pytree.register_dataclass or "
                         "register_pytree_node)") from None
    except Exception as exc:  # noqa: BLE001 - any pickling failure says the same
        kinds = sorted({type(v).__name__ for v in values})
        raise InputError(f"{what} holds non-tensor values ({', '.join(kinds)}) that cannot be pickled ({exc}): only "
                         "tensors and picklable values can cross a stage boundary") from None
    return buf.getvalue()


def _layout_for(local: torch.Tensor, m: TensorMeta) -> tuple:
    """The layout to rebuild a received part with: as learnt, or where the message carried another shape
    (shapes travel), with the global shape left to follow from the part (even shards: the sender's
    layout_of checked that)."""
    return m.layout if tuple(local.shape) == m.shape else (*m.layout[:3], None, None)


def _show(m: TensorMeta) -> tuple:
    shape = f"{len(m.shape)}-d" if m.shape and all(d < 0 for d in m.shape) else m.shape  # any shape of that rank
    return shape, str(m.dtype), "grad" if m.requires_grad else "no grad"


def _structure(tree: Any) -> str:
    leaves, spec = tree_flatten(tree)
    kinds = ["tensor" if isinstance(x, (torch.Tensor, TensorMeta)) else type(x).__name__ for x in leaves]
    return f"{tree_unflatten(kinds, spec)!r}".replace("'", "")


@dataclass
class StagePlan:
    """Per microbatch: the message the stage receives (None: a first stage, or not learnt) and the
    one it sends (absent for a last stage)."""
    inputs: dict[int, Boundary | None] = field(default_factory=dict)
    outputs: dict[int, Boundary] = field(default_factory=dict)
