"""What crosses each stage boundary: shapes, dtypes and structure, found once per batch shape.

Every stage's output structure is computed on meta tensors (no real compute; a real forward on
placeholder inputs where an op has no meta kernel), or taken from the stage's output_args where
given, and passed down the pipeline once, so that receivers can post buffers of the right size
before the data arrives.
"""

from __future__ import annotations

import copy
import hashlib
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .errors import InputError


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(tuple(t.shape), t.dtype, bool(t.requires_grad and t.is_floating_point()))

    def meta_tensor(self) -> torch.Tensor:
        t = torch.empty(self.shape, dtype=self.dtype, device="meta")
        return t.requires_grad_(self.requires_grad) if self.requires_grad else t


def describe(tree: Any) -> Any:
    """`tree` with every tensor replaced by its TensorMeta (picklable, comparable)."""
    return tree_map(lambda x: TensorMeta.of(x) if isinstance(x, torch.Tensor) else x, tree)


def signature(obj: Any) -> int:
    """A stable 62-bit hash of a description (equal shapes/dtypes/values give equal hashes)."""
    data = pickle.dumps(obj, protocol=4)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 62) - 1)


def tensor_leaves(desc: Any) -> list[TensorMeta]:
    return [x for x in tree_flatten(desc)[0] if isinstance(x, TensorMeta)]


def rebuild(desc: Any, tensors: list[torch.Tensor]) -> Any:
    """The structure `desc` describes, with its tensors taken in order from `tensors`."""
    leaves, spec = tree_flatten(desc)
    it = iter(tensors)
    out = [next(it) if isinstance(x, TensorMeta) else x for x in leaves]
    return tree_unflatten(out, spec)


def as_call(value: Any) -> tuple[tuple, dict]:
    """How a stage's output feeds the next stage: tuple/list -> positional args, dict -> kwargs."""
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    return (value,), {}


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


@contextmanager
def hooks_silenced(module: torch.nn.Module):
    """The user's module hooks do not see the shape-finding forward."""
    saved = []
    for mod in module.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(mod, name, None)
            if hooks:
                saved.append((mod, name, hooks))
                setattr(mod, name, type(hooks)())
    try:
        yield
    finally:
        for mod, name, hooks in saved:
            setattr(mod, name, hooks)


def output_description(module: torch.nn.Module, args_desc: Any, kwargs_desc: Any, device: torch.device,
                       training: bool) -> Any:
    """Describe module(*args, **kwargs) without computing it: on meta tensors, or, where an op has
    no meta kernel, a real forward on zero inputs (module state restored afterwards)."""
    with hooks_silenced(module):
        return _output_description(module, args_desc, kwargs_desc, device, training)


def _output_description(module, args_desc, kwargs_desc, device, training):
    grad_mode = torch.enable_grad() if training else torch.no_grad()
    try:
        state = {n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
                 for n, p in module.named_parameters()}
        state.update({n: torch.empty_like(b, device="meta") for n, b in module.named_buffers()})
        to_meta = lambda x: x.meta_tensor() if isinstance(x, TensorMeta) else x  # noqa: E731
        with grad_mode:
            out = functional_call(module, state, tree_map(to_meta, args_desc), tree_map(to_meta, kwargs_desc))
        return describe(out)
    except Exception:  # an op without a meta kernel, or data-dependent control flow
        pass

    def to_real(x):
        if not isinstance(x, TensorMeta):
            return x
        t = torch.zeros(x.shape, dtype=x.dtype, device=device)
        return t.requires_grad_(x.requires_grad) if x.requires_grad else t

    saved = copy.deepcopy({n: b for n, b in module.named_buffers()})
    try:
        with grad_mode:
            out = module(*tree_map(to_real, args_desc), **tree_map(to_real, kwargs_desc))
        return describe(out)
    finally:
        with torch.no_grad():
            for n, b in module.named_buffers():
                b.copy_(saved[n])


@dataclass
class StagePlan:
    """Per microbatch: what the stage receives (description of its inputs) and what it returns."""
    inputs: dict[int, Any]   # mb -> description of the previous stage's output (None: first stage)
    outputs: dict[int, Any]  # mb -> description of this stage's output
    declared: frozenset = frozenset()  # microbatches whose outputs come from the stage's output_args


def send_object(obj: Any, peer: int, pipe) -> None:
    """Pickled `obj` to group rank `peer`: its length, then its bytes (waits bounded by the timeout)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=4)), dtype=torch.uint8)
    device = pipe._comm_device()
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dst = dist.get_global_rank(pipe.group, peer)
    for t in (length, data.to(device)):
        _wait(dist.isend(t, dst, group=pipe.group), pipe, f"sending stage shapes to rank {peer}")


def recv_object(peer: int, pipe) -> Any:
    device = pipe._comm_device()
    src = dist.get_global_rank(pipe.group, peer)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    _wait(dist.irecv(length, src, group=pipe.group), pipe, f"waiting for stage shapes from rank {peer}")
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    _wait(dist.irecv(data, src, group=pipe.group), pipe, f"waiting for stage shapes from rank {peer}")
    return pickle.loads(data.cpu().numpy().tobytes())


def _wait(work, pipe, what: str) -> None:
    from datetime import timedelta

    from .errors import CommunicationError

    try:
        work.wait(timeout=timedelta(seconds=pipe.timeout))
    except Exception as exc:
        pipe._broken = str(exc)
        raise CommunicationError(f"rank {pipe.rank}: {what} failed within {pipe.timeout} s ({exc}); "
                                 "a rank hung or died: rebuild the process group") from None


# Sent down a chain instead of a description when a stage could not be planned, so that no rank
# waits for a description that will never come.
PLANNING_FAILED = "pipecore: planning failed upstream"


def discover(pipe, first_inputs: dict[int, tuple[Any, Any]], training: bool) -> tuple[dict[int, StagePlan],
                                                                                      Exception | None]:
    """Walk every pipeline chain in order; each rank describes its stages' outputs for all
    microbatches and hands the descriptions to the next stage's rank. A stage that cannot run on its
    inputs does not stop the walk: it and everything after it in its chain pass PLANNING_FAILED on,
    and the error is returned (the caller tells all ranks)."""
    topo = pipe.schedule.topology
    rank = pipe.rank
    plans: dict[int, StagePlan] = {}
    error: Exception | None = None
    chains: list[list[int]] = []
    for s in range(topo.num_stages):
        if topo.prev_stage[s] < 0:
            chain = [s]
            while topo.next_stage[chain[-1]] >= 0:
                chain.append(topo.next_stage[chain[-1]])
            chains.append(chain)
    for chain in chains:
        for s in chain:
            if topo.stage_rank[s] != rank:
                continue
            prev = topo.prev_stage[s]
            if prev < 0:
                in_desc = {mb: None for mb in topo.microbatches[s]}
            elif topo.stage_rank[prev] == rank:
                in_desc = dict(plans[prev].outputs) if prev in plans else PLANNING_FAILED
            else:
                in_desc = recv_object(topo.stage_rank[prev], pipe)
            out_desc = PLANNING_FAILED
            if in_desc != PLANNING_FAILED:
                try:
                    plans[s] = _plan_stage(pipe.stage_by_index[s], topo.microbatches[s], in_desc, first_inputs,
                                           training)
                    out_desc = plans[s].outputs
                except Exception as exc:  # noqa: BLE001 - every rank is told below
                    error = error or exc
            nxt = topo.next_stage[s]
            if nxt >= 0 and topo.stage_rank[nxt] != rank:
                send_object(out_desc, topo.stage_rank[nxt], pipe)
    return plans, error


def _plan_stage(stage, mbs, in_desc, first_inputs, training) -> StagePlan:
    out_desc: dict[int, Any] = {}
    cache: dict[int, Any] = {}
    declared = set()
    for mb in mbs:
        if in_desc[mb] is None:
            args, kwargs = first_inputs[mb]
            a_desc, k_desc = describe(args), describe(kwargs)
        else:
            a_desc, k_desc = as_call(in_desc[mb])
        given = stage.declared_output(a_desc, k_desc, training)
        if given is not None:
            out_desc[mb] = given
            declared.add(mb)
            continue
        key = signature((a_desc, k_desc))
        if key not in cache:
            try:
                cache[key] = output_description(stage.module, a_desc, k_desc, stage.device, training)
            except Exception as exc:
                shapes = [(m.shape, str(m.dtype)) for m in tensor_leaves((a_desc, k_desc))]
                raise InputError(f"stage {stage.stage_index} cannot run on its inputs {shapes} of microbatch {mb} "
                                 f"(found while planning the step's shapes): {type(exc).__name__}: {exc}") from exc
        out_desc[mb] = cache[key]
    return StagePlan(in_desc, out_desc, frozenset(declared))
