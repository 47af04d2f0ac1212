"""Split a batch into microbatches and merge per-microbatch outputs back.

Tensors (anywhere inside tuples, lists and dicts) are split along dim 0 into near-equal chunks
(`torch.tensor_split`: the first `batch % n` chunks get one row more); everything else is passed
to every microbatch unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class SplitError(ValueError):
    """The batch cannot be split into the requested microbatches."""


def batch_size(tree: Any) -> int | None:
    """Rows along dim 0 of the first tensor in `tree` (None when it holds no tensor)."""
    if isinstance(tree, torch.Tensor):  # the common case, without a walk of the tree
        return tree.shape[0] if tree.dim() > 0 else None
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return None


def split_sizes(rows: int, n: int) -> list[int] | None:
    """The rows of each of `n` microbatches of a batch of `rows` (None for an unknown batch): the
    first `rows % n` get one more, as `split` cuts them."""
    if rows < n:
        return None
    return [rows // n + (1 if i < rows % n else 0) for i in range(n)]


def split(tree: Any, n: int, what: str = "input") -> list[Any]:
    """`n` microbatches of `tree`. Raises SplitError saying why when it cannot be split."""
    if n < 1:
        raise SplitError(f"cannot split into {n} microbatches: need at least one")
    # the common cases, a tensor or a tuple or dict of tensors (or nothing), without walking or
    # rebuilding trees
    plain = True
    if type(tree) is torch.Tensor:
        leaves, spec = [tree], None
    elif type(tree) in (tuple, dict) and all(type(v) is torch.Tensor for v in _values(tree)):
        leaves, spec = list(_values(tree)), None
    else:
        plain = False
        leaves, spec = tree_flatten(tree)
    rows = None
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        if leaf.dim() == 0:
            raise SplitError(f"{what} leaf {i} is a 0-dim tensor: it has no batch dimension to split into "
                             f"{n} microbatches (pass it through a closure or as a 1-row tensor)")
        if rows is None:
            rows = leaf.shape[0]
        elif leaf.shape[0] != rows:
            raise SplitError(f"{what} tensors disagree on the batch size (dim 0): {rows} and {leaf.shape[0]} "
                             f"(leaf {i}); every tensor must have the same number of rows")
    if rows is not None and rows < n:
        raise SplitError(f"cannot split a batch of {rows} rows into {n} microbatches: every microbatch needs at "
                         f"least one row (use at most {rows} microbatches or a larger batch)")
    if plain:
        parts = [torch.tensor_split(leaf, n, dim=0) for leaf in leaves]
        if type(tree) is torch.Tensor:
            return list(parts[0])
        if type(tree) is tuple:
            return [tuple(p[i] for p in parts) for i in range(n)]
        return [dict(zip(tree, (p[i] for p in parts))) for i in range(n)]
    chunks = [[] for _ in range(n)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            for c, part in zip(chunks, torch.tensor_split(leaf, n, dim=0)):
                c.append(part)
        else:
            for c in chunks:
                c.append(leaf)
    return [tree_unflatten(c, spec) for c in chunks]


def _values(tree: tuple | dict):
    return tree.values() if type(tree) is dict else tree


def merge(chunks: list[Any]) -> Any:
    """Concatenate per-microbatch outputs along dim 0 (non-tensors: the first microbatch's)."""
    if not chunks:
        return None
    if all(type(c) is torch.Tensor and c.dim() > 0 for c in chunks):  # the common case, without a walk
        return torch.cat(chunks, dim=0)
    flat = [tree_flatten(c) for c in chunks]
    spec = flat[0][1]
    out = []
    for i, leaf in enumerate(flat[0][0]):
        if isinstance(leaf, torch.Tensor):
            parts = [f[0][i] for f in flat]
            out.append(torch.cat(parts, dim=0) if leaf.dim() > 0 else torch.stack(parts))
        else:
            out.append(leaf)
    return tree_unflatten(out, spec)


def split_by_specs(args: tuple, kwargs: dict, n: int, args_chunk_spec, kwargs_chunk_spec) -> list[tuple[tuple, dict]]:
    """`n` microbatches of (args, kwargs) as torch.distributed.pipelining's `args_chunk_spec` and
    `kwargs_chunk_spec` say (`TensorChunkSpec(dim)` splits along `dim`, `_Replicate` passes the value
    to every microbatch): torch's own splitter, so that the specs mean what they mean there."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    try:
        args_split, kwargs_split = split_args_kwargs_into_chunks(args, kwargs, n, args_chunk_spec, kwargs_chunk_spec)
    except (AssertionError, ValueError, IndexError) as exc:
        raise SplitError(f"cannot split the inputs into {n} microbatches as args_chunk_spec={args_chunk_spec!r}, "
                         f"kwargs_chunk_spec={kwargs_chunk_spec!r} say: {exc}") from None
    return list(zip(args_split, kwargs_split))


def merge_by_spec(chunks: list[Any], output_merge_spec) -> Any:
    """Per-microbatch outputs merged as torch.distributed.pipelining's `output_merge_spec` says
    (torch's own merger)."""
    from torch.distributed.pipelining.microbatch import merge_chunks

    return merge_chunks(chunks, output_merge_spec)
