"""`partition`: split a model into pipeline stages, contiguous runs of its layers.

    parts = pc.partition(layers, 4, "parameters")   # 4 StageModules (nn.Sequential), model order
    h = x
    for part in parts:                               # computes exactly what the layers compute in order
        h = part(h)

`layers` is the model as a list of layers that run one after another:
  nn.Sequential               its children, names kept ("0", "1", ... or the names given)
  nn.ModuleList, list, tuple  of modules, named "0", "1", ...
  list/tuple of (name, module)
  a Hugging Face causal LM    (Llama, Qwen2/3, Mistral, GPT-2 and models built alike) its embedding,
                              decoder layers and head (norm + LM head), read by pipecore/stage/hf.py,
                              which checks that they compute the model's logits; "uniform" spreads
                              the decoder layers evenly and adds the embedding to the first stage
                              and the head to the last
  any other nn.Module         its children in order (named_children), with nn.Sequential and
                              nn.ModuleList children expanded into their items ("blocks.0", ...).
                              Its forward must be these layers composed in that order: the layer
                              list is what the stages run, the model's own forward never runs.

A layer's output feeds the next layer the way a stage's output feeds the next stage in a
`Pipeline` (pipecore.stage.boundary.as_call): a tuple or list becomes positional arguments, a dict keyword
arguments, anything else the one argument; so the result does not depend on where the cuts fall.

Each stage is a `StageModule` (an nn.Sequential) holding the SAME layer objects: no copies, the
parameters are those of `layers`. Layer names become the stage's child names with '.' replaced
by '_' ("blocks.0" -> "blocks_0"; module names cannot hold dots), so a stage's state_dict keys
read "blocks_0.mlp.weight" where the model's read "blocks.0.mlp.weight".

Methods (every stage gets at least one layer; ties are broken the same way on every call):
  "uniform"     by layer count; when the count does not divide evenly, the earlier stages take
                one layer more (as DeepSpeed's partition_uniform).
  "parameters"  the contiguous split whose largest stage holds the fewest parameter elements.
                A stage counts each parameter once, however many of its layers share it (a tied
                embedding and head in one stage), and once in every stage it appears in (each
                stage's rank stores it). Frozen parameters (requires_grad=False) count too: they
                take memory all the same. Buffers do not count.
  "time"        the split whose slowest stage is fastest, from each layer's forward+backward time
                measured on `example` (the first layer's input: a tensor, a tuple of arguments or
                a dict of keyword arguments): one warm-up pass, then the median of 3. Backward is
                the gradient of the sum of the layer's floating outputs with respect to its
                floating inputs and its parameters (torch.autograd.grad: no `.grad` accumulates),
                `.grad`, training modes and the random number generators are left as they were.
  [n0, n1, ...] explicit layer counts per stage: reproduces a split found elsewhere, e.g. one
                measured with "time" on rank 0 and broadcast, since ranks that each measure can
                pick different splits.
Among the splits with the best bottleneck, "parameters" and "time" take the most even one (the
smallest sum of squared stage costs, then of squared layer counts); remaining ties give the
earlier stages more layers, as "uniform" does.

In a pipeline, call partition with the number of MODEL stages and build this rank's
`PipelineStage`s from `schedule.topology`: `model_stage[s]` is the model stage that stage `s`
computes. For loop and V placements (gpipe, 1f1b, interleaved_1f1b, zbv, ...) it is `s` itself;
for dualpipe, stage R+j mirrors model stage j, so there are R model stages:

    sched = pc.build_schedule("zbv", world, num_microbatches)      # rank r: stages r, 2R-1-r
    topo = sched.topology
    num_model_stages = len(set(topo.model_stage))                   # dualpipe: R, else sched.num_stages
    parts = pc.partition(build_layers(), num_model_stages, "parameters")
    stages = [pc.PipelineStage(parts[topo.model_stage[s]], s, sched.num_stages) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, num_microbatches, loss_fn=loss_fn)

Parameters that layers in different stages share and train (an LM head that is the embedding,
ALBERT-style shared layers) are ties: each stage holding one lists it in its `tied` under the
parameter's name in the first stage that holds it ("tok.weight"), the printout names them, and `PipelineStage`
declares them as tied weights (training/ties.py: the copies start equal and their gradients are
summed after each step, also when the stages are on different ranks). Within one stage a shared
parameter is simply one parameter.

Every rank builds the whole model (seeded alike, or on the meta device for "uniform" and
"parameters") and keeps its own parts; a dualpipe mirror is then already a copy (the one in this
rank's model), and no rank holds a model stage twice (dualpipe rank r: model stages r and R-1-r,
R even). To run several ranks in one process, deepcopy the parts each rank takes.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from pipecore.stage import hf
from pipecore.stage.boundary import as_call
from pipecore.stage.stage_module import StageModule

METHODS = ("uniform", "parameters", "time")
_WARMUP, _REPS = 1, 3


def partition(layers: Any, num_stages: int, method: str | Sequence[int] = "uniform", example: Any = None, *,
              verbose: bool = True) -> list[StageModule]:
    """Split `layers` into `num_stages` contiguous stages (see the module docstring); returns one
    `StageModule` per stage, in model order, holding the original layer objects."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise TypeError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages}")
    counts = _explicit_counts(method, num_stages)
    if counts is None and method not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; use one of {', '.join(map(repr, METHODS))} "
                         f"or a list of layer counts per stage")
    if method == "time" and example is None:
        raise ValueError("method='time' measures each layer on an example input: pass example=<the first layer's "
                         "input: a tensor, a tuple of arguments or a dict of keyword arguments>")
    lm = hf.is_causal_lm(layers)
    named = _named_layers(hf.causal_lm_layers(layers) if lm else layers)
    if lm:
        hf.check_layers(layers, named)
    n = len(named)
    if n < num_stages:
        raise ValueError(f"cannot give every one of {num_stages} stages a layer: the model has {n} "
                         f"layer{'s' if n != 1 else ''}; use fewer stages or split layers further")
    modules = [m for _, m in named]
    layer_ms = None
    if counts is not None:
        if sum(counts) != n:
            raise ValueError(f"the layer counts {list(counts)} add up to {sum(counts)}, the model has {n} layers")
        bounds = _bounds_from_counts(counts)
    elif method == "uniform":
        lm_counts = hf.decoder_layer_counts(n - 2, num_stages) if lm else None
        bounds = _bounds_from_counts(lm_counts) if lm_counts else _uniform_bounds(n, num_stages)
    elif method == "parameters":
        bounds = _balanced_bounds(_parameter_costs(modules), num_stages)
    else:
        layer_ms = _profile_layers(modules, example)
        bounds = _balanced_bounds(_additive_costs(layer_ms), num_stages)
    stages = [StageModule(OrderedDict((_child_name(name), m) for name, m in named[a:b]))
              for a, b in zip(bounds, bounds[1:])]
    ties = _find_ties(stages)
    for key, (_, holders) in ties.items():
        for s, name in holders:
            stages[s].tied[key] = name
    if verbose and _is_printing_rank():
        _print_balance(named, bounds, layer_ms, method if counts is None else "explicit layer counts", ties)
    return stages


def _find_ties(stages: list[StageModule]) -> dict[str, tuple[nn.Parameter, list[tuple[int, str]]]]:
    """Parameters that several stages hold (an LM head that is the embedding, ALBERT-style shared
    layers): {its name in the first stage holding it: (the parameter, [(stage, its name there)])}.
    The names come from the model's layer names, so every rank that builds the model alike finds
    the same keys."""
    return {held[0][1]: (p, held) for p, held in shared_parameters(stages)}


def shared_parameters(modules: Sequence[nn.Module]) -> list[tuple[nn.Parameter, list[tuple[int, str]]]]:
    """The trainable parameters that several of `modules` hold, in the order first met: (the
    parameter, [(module index, its name there)]). Frozen ones have no gradient to sum: left out."""
    holders: dict[int, tuple[nn.Parameter, list[tuple[int, str]]]] = {}
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():  # each parameter once per module
            if p.requires_grad:
                holders.setdefault(id(p), (p, []))[1].append((i, name))
    return [(p, held) for p, held in holders.values() if len(held) > 1]


# -- the layer list -------------------------------------------------------------------------------
def _named_layers(layers: Any) -> list[tuple[str, nn.Module]]:
    """`layers` as (name, module) pairs, checked: modules, each listed once, usable names."""
    if isinstance(layers, (nn.Sequential, nn.ModuleList)):
        named = list(layers.named_children())
    elif isinstance(layers, nn.Module):
        named = _flatten(layers)
    elif isinstance(layers, (list, tuple)):
        pairs = bool(layers) and isinstance(layers[0], tuple)
        named = []
        for i, entry in enumerate(layers):
            if pairs:
                if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
                    raise TypeError(f"layers[{i}] is {_show(entry)}: a list that starts with (name, module) pairs "
                                    "must hold only such pairs")
                named.append(entry)
            else:
                named.append((str(i), entry))
    else:
        raise TypeError(f"layers must be an nn.Module, a list/tuple of modules or of (name, module) pairs, "
                        f"got {type(layers).__name__}")
    seen_objects: dict[int, str] = {}
    seen_names: dict[str, str] = {}
    reserved = StageModule()
    for i, (name, module) in enumerate(named):
        if not isinstance(module, nn.Module):
            raise TypeError(f"layer {i} ({name!r}) is {_show(module)}, not an nn.Module; wrap functions in a "
                            "module (e.g. a small nn.Module whose forward calls them)")
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            raise TypeError(f"layer {name!r} is an {type(module).__name__}, which has no forward; list its items "
                            "as layers instead")
        if id(module) in seen_objects:
            raise ValueError(f"layers {seen_objects[id(module)]!r} and {name!r} are the same module object; list "
                             "each layer once (share parameters between distinct modules instead)")
        seen_objects[id(module)] = name
        child = _child_name(name)
        if not child or child in seen_names:
            other = f"{seen_names[child]!r} and {name!r} both become" if child in seen_names else f"{name!r} is"
            raise ValueError(f"layer names {other} {child!r} as a stage's child name; give the layers distinct, "
                             "non-empty names")
        if hasattr(reserved, child):
            raise ValueError(f"layer name {name!r} clashes with an nn.Module attribute; rename that layer")
        seen_names[child] = name
    return named


def _flatten(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """A model's children in order, containers expanded: the layers its forward must compose."""
    own = [n for n, _ in model.named_parameters(recurse=False)] + [n for n, _ in model.named_buffers(recurse=False)]
    if own:
        raise ValueError(f"{type(model).__name__} holds parameters/buffers of its own ({', '.join(own)}) that no "
                         "child layer holds: they would be lost; move them into a layer or pass the layer list")
    children = list(model.named_children())
    if not children:
        return [("0", model)]  # a leaf module is a model of one layer
    named = []
    for name, child in children:
        if _is_plain_container(child):
            named += [(f"{name}.{sub}", m) for sub, m in _flatten(child)] if len(child) else []
        elif isinstance(child, nn.ModuleDict):
            raise ValueError(f"{type(model).__name__}.{name} is an nn.ModuleDict: the order its modules run in is "
                             "unknown; pass the layer list (a list of (name, module) pairs) instead")
        else:
            named.append((name, child))
    return named


def _is_plain_container(module: nn.Module) -> bool:
    """A ModuleList, or a Sequential whose forward runs its items in order (not a subclass with
    a forward of its own): expanding it into its items keeps what the model computes."""
    if isinstance(module, nn.ModuleList):
        return True
    return isinstance(module, nn.Sequential) and type(module).forward in (nn.Sequential.forward, StageModule.forward)


def _child_name(layer_name: str) -> str:
    return layer_name.replace(".", "_")


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"


# -- where the cuts fall --------------------------------------------------------------------------
def _explicit_counts(method: Any, num_stages: int) -> list[int] | None:
    if isinstance(method, str) or not isinstance(method, Sequence):
        return None
    counts = list(method)
    if len(counts) != num_stages or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"explicit layer counts must be {num_stages} positive integers (one per stage), "
                         f"got {counts!r}")
    return counts


def _bounds_from_counts(counts: Sequence[int]) -> list[int]:
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return bounds


def _uniform_bounds(n: int, num_stages: int) -> list[int]:
    size, extra = divmod(n, num_stages)
    return _bounds_from_counts([size + (s < extra) for s in range(num_stages)])


def _parameter_costs(modules: list[nn.Module]) -> list[list[int]]:
    """cost[i][j]: parameter elements held by layers i..j-1, each parameter counted once."""
    n = len(modules)
    params = [list(m.parameters()) for m in modules]  # parameters() already skips repeats within a layer
    cost = [[0] * (n + 1) for _ in range(n)]
    for i in range(n):
        seen: set[int] = set()
        total = 0
        for j in range(i, n):
            for p in params[j]:
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
            cost[i][j + 1] = total
    return cost


def _stage_parameters(modules: list[nn.Module]) -> int:
    return sum(p.numel() for p in {id(p): p for m in modules for p in m.parameters()}.values())


def _additive_costs(weights: list[float]) -> list[list[float]]:
    n = len(weights)
    cost = [[0.0] * (n + 1) for _ in range(n)]
    for i in range(n):
        total = 0.0
        for j in range(i, n):
            total += weights[j]
            cost[i][j + 1] = total
    return cost


def _balanced_bounds(cost: list[list[float]], num_stages: int) -> list[int]:
    """Stage boundaries minimising the largest stage cost (exact, by dynamic programming over
    contiguous splits), then, among those, the most even split. cost[i][j] is the cost of a stage
    holding layers i..j-1 and never drops when a stage grows."""
    n, S = len(cost), num_stages
    inf = float("inf")
    # pass 1: the smallest achievable bottleneck; worst[k][j]: best max over k stages holding layers 0..j-1
    worst = [[inf] * (n + 1) for _ in range(S + 1)]
    worst[0][0] = 0
    for k in range(1, S + 1):
        for j in range(k, n - (S - k) + 1):
            worst[k][j] = min(max(worst[k - 1][i], cost[i][j]) for i in range(k - 1, j))
    bottleneck = worst[S][n]
    # pass 2: within that bottleneck, the smallest (sum of squared costs, sum of squared layer counts);
    # scanning i upwards with <= keeps the largest i on ties: later stages shorter, earlier ones longer
    spread: list[list[tuple[float, int] | None]] = [[None] * (n + 1) for _ in range(S + 1)]
    cut = [[0] * (n + 1) for _ in range(S + 1)]
    spread[0][0] = (0, 0)
    for k in range(1, S + 1):
        for j in range(k, n - (S - k) + 1):
            best = None
            for i in range(k - 1, j):
                prev = spread[k - 1][i]
                if prev is None or cost[i][j] > bottleneck:
                    continue
                cand = (prev[0] + cost[i][j] ** 2, prev[1] + (j - i) ** 2)
                if best is None or cand <= best:
                    best, cut[k][j] = cand, i
            spread[k][j] = best
    bounds = [n]
    for k in range(S, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


# -- measuring layer times ------------------------------------------------------------------------
def _profile_layers(modules: Sequence[nn.Module], example: Any) -> list[float]:
    """Milliseconds of forward + backward for each layer, run in order from `example` (median of
    3 after a warm-up). Leaves `.grad`, training modes and the RNG states as they were."""
    params = {id(p): p for m in modules for p in m.parameters()}.values()
    grads_before = [(p, p.grad) for p in params]
    cuda = _cuda_devices(modules, example)
    sync = (lambda: [torch.cuda.synchronize(d) for d in cuda]) if cuda else (lambda: None)
    runs: list[list[float]] = []
    try:
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            for rep in range(_WARMUP + _REPS):
                times = _time_once(modules, example, sync)
                if rep >= _WARMUP:
                    runs.append(times)
    finally:
        for p, grad in grads_before:  # autograd.grad leaves .grad alone; this undoes hooks that did not
            p.grad = grad
    return [statistics.median(column) for column in zip(*runs)]


def _time_once(modules: Sequence[nn.Module], example: Any, sync: Callable[[], Any]) -> list[float]:
    times = []
    value = example
    for layer in modules:
        leaves: list[torch.Tensor] = []
        args, kwargs = tree_map(lambda v: _fresh_input(v, leaves), as_call(value))
        sync()
        start = time.perf_counter()
        value = layer(*args, **kwargs)
        outs = [t for t in tree_flatten(value)[0]
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
        wrt = leaves + [p for p in layer.parameters() if p.requires_grad]
        if outs and wrt:
            torch.autograd.grad(sum(t.sum() for t in outs), wrt, allow_unused=True)
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _fresh_input(value: Any, leaves: list[torch.Tensor]) -> Any:
    """A layer's input as a stage boundary hands it over: cut from the previous layer's graph (so
    each layer's backward is timed alone), needing a gradient when it did. A clone of the leaf is
    passed so in-place layers (ReLU(inplace=True)) work and `example` is never modified."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.requires_grad and value.is_floating_point():
        leaves.append(value.detach().requires_grad_())
        return leaves[-1].clone()
    return value.detach().clone()


def _cuda_devices(modules: Sequence[nn.Module], example: Any) -> list[int]:
    tensors = [p for m in modules for p in m.parameters()] + [
        t for t in tree_flatten(example)[0] if isinstance(t, torch.Tensor)]
    return sorted({t.device.index if t.device.index is not None else torch.cuda.current_device()
                   for t in tensors if t.device.type == "cuda"})


# -- the balance printout -------------------------------------------------------------------------
def _is_printing_rank() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _print_balance(named: list[tuple[str, nn.Module]], bounds: list[int], layer_ms: list[float] | None,
                   method: Any, ties: dict[str, tuple[nn.Parameter, list[tuple[int, str]]]]) -> None:
    rows = []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        span = named[a][0] if b - a == 1 else f"{named[a][0]} .. {named[b - 1][0]}"
        row = [str(s), span, str(b - a), f"{_stage_parameters([m for _, m in named[a:b]]):,}"]
        if layer_ms is not None:
            row.append(f"{sum(layer_ms[a:b]):.2f}")
        rows.append(row)
    header = ["stage", "layers", "#layers", "parameters"] + (["ms fwd+bwd"] if layer_ms is not None else [])
    widths = [max(len(r[c]) for r in rows + [header]) for c in range(len(header))]
    line = lambda r: "  ".join(v.ljust(w) if c == 1 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths)))
    print(f"pc.partition: {len(named)} layers into {len(rows)} stages by {method}")
    print(line(header))
    for r in rows:
        print(line(r))
    for key, (param, holders) in ties.items():
        where = ", ".join(f"stage {s} ({name})" for s, name in holders)
        print(f"tied: {key} {list(param.shape)}, one weight in {where}: declared tied (copies start equal, "
              "gradients summed)")
