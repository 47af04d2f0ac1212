"""pc.partition: splitting a layer list into pipeline stages (uniform, by parameters, by time)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pipecore as pc
from pipecore.stage.partitioning import StageModule
from pipecore.stage.boundary import as_call
from models import Sleepy

WIDTH = 8


# -- models ---------------------------------------------------------------------------------------
def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8),
                         nn.Tanh(), nn.Linear(8, 4))


def named_pairs() -> list[tuple[str, nn.Module]]:
    torch.manual_seed(1)
    return [("stem", nn.Linear(6, 12)), ("body.0", nn.Linear(12, 12)), ("body.1", nn.Linear(12, 24)),
            ("act", nn.SiLU()), ("out", nn.Linear(24, 3))]


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(16, WIDTH)

    def forward(self, ids):
        return self.tok(ids)


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, hidden)
        self.down = nn.Linear(hidden, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TiedHead(nn.Module):
    """Final norm + output projection sharing the embedding's weight."""

    def __init__(self, embed: Embed):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.weight = embed.tok.weight

    def forward(self, x):
        return F.linear(self.norm(x), self.weight)


def gpt_layers() -> list[nn.Module]:
    torch.manual_seed(2)
    embed = Embed()
    return [embed, Block(8), Block(32), Block(16), Block(64), TiedHead(embed)]


class FlatNet(nn.Module):
    """A model whose forward is its children composed in order (the flatten path)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = Embed()
        self.blocks = nn.ModuleList([Block(h) for h in (8, 24, 16)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 5)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def run_chain(modules, *args):
    """Run modules one after another, feeding outputs as a Pipeline boundary does."""
    out = modules[0](*args)
    for m in modules[1:]:
        a, k = as_call(out)
        out = m(*a, **k)
    return out


IDS = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
CASES = {
    "sequential_mlp": (mlp, lambda: (torch.randn(3, 6, generator=torch.Generator().manual_seed(0)),)),
    "named_pairs": (named_pairs, lambda: (torch.randn(3, 6, generator=torch.Generator().manual_seed(0)),)),
    "gpt_layer_list": (gpt_layers, lambda: (IDS,)),
    "flattened_module": (FlatNet, lambda: (IDS,)),
}


def layer_list(model) -> list[tuple[str, nn.Module]]:
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    if isinstance(model, FlatNet):
        return ([("embed", model.embed)] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
                + [("norm", model.norm), ("head", model.head)])
    if isinstance(model[0], tuple):
        return list(model)
    return [(str(i), m) for i, m in enumerate(model)]


@pytest.mark.parametrize("method", ["uniform", "parameters"])
@pytest.mark.parametrize("case", list(CASES))
def test_stages_are_the_layers_in_order(case, method):
    build, inputs = CASES[case]
    model = build()
    expected_layers = layer_list(model)
    args = inputs()
    with torch.no_grad():
        reference = model(*args) if isinstance(model, nn.Module) else run_chain([m for _, m in expected_layers], *args)
    params_before = {id(p) for _, m in expected_layers for p in m.parameters()}
    for num_stages in range(1, len(expected_layers) + 1):
        stages = pc.partition(model, num_stages, method, verbose=False)
        assert len(stages) == num_stages
        assert all(isinstance(s, StageModule) and len(s) >= 1 for s in stages)
        got = [(name, m) for s in stages for name, m in s.named_children()]
        assert [m for _, m in got] == [m for _, m in expected_layers]  # same objects, once each, in order
        assert all(a is b for (_, a), (_, b) in zip(got, expected_layers))
        assert [n for n, _ in got] == [n.replace(".", "_") for n, _ in expected_layers]
        assert {id(p) for s in stages for p in s.parameters()} == params_before
        with torch.no_grad():
            assert torch.equal(run_chain(stages, *args), reference)


def test_dotted_names_become_underscores_and_state_dict_keys_follow():
    stages = pc.partition(FlatNet(), 2, verbose=False)
    names = [n for s in stages for n, _ in s.named_children()]
    assert names == ["embed", "blocks_0", "blocks_1", "blocks_2", "norm", "head"]
    assert "blocks_0.up.weight" in stages[0].state_dict()


def test_uniform_gives_extra_layers_to_the_earlier_stages():
    layers = [nn.Identity() for _ in range(7)]
    assert [len(s) for s in pc.partition(layers, 3, verbose=False)] == [3, 2, 2]
    assert [len(s) for s in pc.partition(layers, 4, verbose=False)] == [2, 2, 2, 1]
    # equal weights: "parameters" breaks its ties the same way
    equal = [nn.Linear(3, 3) for _ in range(7)]
    assert [len(s) for s in pc.partition(equal, 3, "parameters", verbose=False)] == [3, 2, 2]


def test_explicit_layer_counts_reproduce_a_split():
    layers = [nn.Identity() for _ in range(6)]
    assert [len(s) for s in pc.partition(layers, 3, [1, 4, 1], verbose=False)] == [1, 4, 1]
    with pytest.raises(ValueError, match="add up to 5, the model has 6 layers"):
        pc.partition(layers, 3, [1, 3, 1])
    with pytest.raises(ValueError, match="3 positive integers"):
        pc.partition(layers, 3, [2, 4])


# -- "parameters": exact against brute force ------------------------------------------------------
class Holder(nn.Module):
    """A layer holding given parameters (some possibly shared with other layers)."""

    def __init__(self, params):
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", p)

    def forward(self, x):
        return x


def stage_cost(layers) -> int:
    return sum(p.numel() for p in {id(p): p for m in layers for p in m.parameters()}.values())


def brute_force_bottleneck(layers, num_stages) -> int:
    n = len(layers)
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        worst = max(stage_cost(layers[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(-1, 8)), min_size=1, max_size=8), st.data())
def test_parameters_split_is_optimal(spec, data):
    # each layer: a parameter of its own (size 0: none) and maybe one shared with an earlier layer
    own = [nn.Parameter(torch.zeros(size)) if size else None for size, _ in spec]
    layers = []
    for i, (_, share) in enumerate(spec):
        params = [own[i]] if own[i] is not None else []
        if 0 <= share < i and own[share] is not None:
            params.append(own[share])
        layers.append(Holder(params))
    num_stages = data.draw(st.integers(1, len(layers)))
    stages = pc.partition(layers, num_stages, "parameters", verbose=False)
    assert [m for s in stages for m in s] == layers
    assert max(stage_cost(list(s)) for s in stages) == brute_force_bottleneck(layers, num_stages)
    again = pc.partition(layers, num_stages, "parameters", verbose=False)
    assert [len(s) for s in again] == [len(s) for s in stages]  # deterministic


def test_parameters_counts_a_tied_weight_once_per_stage_and_frozen_parameters():
    layers = gpt_layers()
    stages = pc.partition(layers, 1, "parameters", verbose=False)
    tied = layers[0].tok.weight
    assert sum(p is tied for p in stages[0].parameters()) == 1
    assert stage_cost(layers) == sum(p.numel() for m in layers for p in m.parameters()) - tied.numel()
    # a frozen layer still takes memory: it is balanced like any other
    frozen = nn.Linear(10, 10).requires_grad_(False)  # 110 elements
    small = [nn.Linear(5, 5) for _ in range(4)]       # 30 each
    stages = pc.partition([frozen] + small, 2, "parameters", verbose=False)
    assert [len(s) for s in stages] == [1, 4]


def test_parameters_shared_across_stages_become_ties(capsys):
    """ALBERT-style sharing: one Linear's weight in layers 0, 2 and 3. Stages that hold it each list
    it under one key (its name in the first); a stage holding it twice lists it once; none elsewhere."""
    shared = nn.Linear(6, 6)
    layers = [nn.Linear(6, 6) for _ in range(5)]
    for i in (0, 2, 3):
        layers[i].weight = shared.weight
    stages = pc.partition(layers, 3, [1, 1, 3])
    assert [s.tied for s in stages] == [{"0.weight": "0.weight"}, {}, {"0.weight": "2.weight"}]
    assert "tied: 0.weight [6, 6], one weight in stage 0 (0.weight), stage 2 (2.weight)" in capsys.readouterr().out
    first = pc.PipelineStage(stages[0], 0, 3)
    assert first.tied == {"0.weight": shared.weight}
    assert pc.PipelineStage(stages[2], 2, 3, tied={}).tied == {}  # tied= given: exactly those
    assert pc.partition(layers, 1, verbose=False)[0].tied == {}   # within one stage: one parameter
    shared.weight.requires_grad_(False)  # frozen (LoRA's base weights): nothing to sum, no tie
    assert [s.tied for s in pc.partition(layers, 3, [1, 1, 3], verbose=False)] == [{}, {}, {}]


# -- "time" ---------------------------------------------------------------------------------------
def test_time_balances_measured_forward_and_backward():
    # costs (ms, forward + backward): 40 | 5 x 6 | 40 ; only the split [1, 6, 1] keeps every stage <= 40
    layers = [Sleepy(20, 20)] + [Sleepy(5) for _ in range(3)] + [Sleepy(0, 5) for _ in range(3)] + [Sleepy(40)]
    layers[2].eval()
    layers[3].scale.grad = torch.full((), 7.0)
    grad_before = layers[3].scale.grad
    torch.manual_seed(5)
    stages = pc.partition(layers, 3, "time", torch.randn(4), verbose=False)
    assert [len(s) for s in stages] == [1, 6, 1]
    assert layers[3].scale.grad is grad_before and grad_before.item() == 7.0
    assert all(layers[i].scale.grad is None for i in range(8) if i != 3)
    assert [m.training for m in layers] == [True, True, False] + [True] * 5


def test_time_leaves_the_random_number_generator_alone():
    layers = [nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4)]
    torch.manual_seed(11)
    pc.partition(layers, 2, "time", torch.randn(2, 4), verbose=False)
    after = torch.rand(3)
    torch.manual_seed(11)
    torch.randn(2, 4)
    assert torch.equal(after, torch.rand(3))


def test_time_handles_integer_inputs_in_place_layers_and_tuples():
    layers = [Embed(), nn.ReLU(inplace=True), Split(), Join(), nn.Linear(WIDTH, 2)]
    ids = IDS.clone()
    stages = pc.partition(layers, 3, "time", ids, verbose=False)
    assert torch.equal(ids, IDS) and len(stages) == 3
    with torch.no_grad():
        assert torch.equal(run_chain(stages, IDS), run_chain(layers, IDS))


# -- several values between layers ----------------------------------------------------------------
class Split(nn.Module):
    def forward(self, x):
        return x, x.mean(dim=-1, keepdim=True)


class Join(nn.Module):
    def forward(self, x, mean):
        return x - mean


class ToDict(nn.Module):
    def forward(self, x):
        return {"x": x, "scale": 3.0}


class FromDict(nn.Module):
    def forward(self, x, scale):
        return x * scale


def test_tuple_and_dict_outputs_feed_the_next_layer():
    torch.manual_seed(4)
    layers = [nn.Linear(4, 4), Split(), Join(), ToDict(), FromDict(), nn.Linear(4, 2)]
    x = torch.randn(3, 4)
    with torch.no_grad():
        reference = run_chain(layers, x)
        for num_stages in range(1, len(layers) + 1):
            stages = pc.partition(layers, num_stages, verbose=False)
            assert torch.equal(run_chain(stages, x), reference)
        assert torch.equal(pc.partition(layers, 1, verbose=False)[0](x), reference)


# -- building a pipeline's stages from the model stages -------------------------------------------
@pytest.mark.parametrize("name,ranks", [("1f1b", 3), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipe", 4)])
def test_docstring_recipe_builds_every_ranks_stages(name, ranks):
    sched = pc.build_schedule(name, ranks, 8)
    topo = sched.topology
    num_model_stages = len(set(topo.model_stage))
    assert num_model_stages == (ranks if name == "dualpipe" else sched.num_stages)
    layers = [nn.Linear(4, 4) for _ in range(8)]
    parts = pc.partition(layers, num_model_stages, "parameters", verbose=False)
    held = []
    for rank in range(ranks):
        stages = [pc.PipelineStage(parts[topo.model_stage[s]], s, sched.num_stages) for s in sched.rank_stages(rank)]
        modules = [s.module for s in stages]
        assert len({id(m) for m in modules}) == len(modules)  # no rank holds a model stage twice
        held += [topo.model_stage[s.stage_index] for s in stages]
    # every model stage is computed; dualpipe computes each twice (once per direction)
    assert sorted(held) == sorted(list(range(num_model_stages)) * (2 if name == "dualpipe" else 1))


# -- errors ---------------------------------------------------------------------------------------
def test_too_few_layers():
    with pytest.raises(ValueError, match="cannot give every one of 4 stages a layer: the model has 3 layers; "
                                         "use fewer stages or split layers further"):
        pc.partition([nn.Linear(2, 2) for _ in range(3)], 4)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "2", None])
def test_num_stages_must_be_a_positive_int(bad):
    with pytest.raises((TypeError, ValueError), match="num_stages must be a positive integer"):
        pc.partition([nn.Linear(2, 2)], bad)


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown partition method 'flops'.*'uniform', 'parameters', 'time'"):
        pc.partition([nn.Linear(2, 2)], 1, "flops")


def test_time_needs_an_example():
    with pytest.raises(ValueError, match="method='time' measures each layer on an example input: pass example="):
        pc.partition([nn.Linear(2, 2)], 1, "time")


def test_entries_must_be_modules():
    with pytest.raises(TypeError, match=r"layer 1 \('1'\) is builtin_function_or_method .* not an nn.Module"):
        pc.partition([nn.Linear(2, 2), torch.relu], 1)
    with pytest.raises(TypeError, match="layers must be an nn.Module"):
        pc.partition("model", 1)
    with pytest.raises(TypeError, match=r"layers\[1\] is Linear.*\(name, module\) pairs"):
        pc.partition([("a", nn.Linear(2, 2)), nn.Linear(2, 2)], 1)
    with pytest.raises(TypeError, match="ModuleList, which has no forward; list its items"):
        pc.partition([nn.ModuleList([nn.Linear(2, 2)])], 1)


def test_a_module_listed_twice():
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="layers '0' and '2' are the same module object; list each layer once"):
        pc.partition([shared, nn.ReLU(), shared], 2)


def test_names_that_cannot_be_child_names():
    with pytest.raises(ValueError, match="'a.b' and 'a_b' both become 'a_b'"):
        pc.partition([("a.b", nn.ReLU()), ("a_b", nn.ReLU())], 1)
    with pytest.raises(ValueError, match="'x' and 'x' both become 'x'"):
        pc.partition([("x", nn.ReLU()), ("x", nn.Tanh())], 1)
    with pytest.raises(ValueError, match="clashes with an nn.Module attribute"):
        pc.partition([("forward", nn.ReLU())], 1)


def test_flattening_refuses_what_it_would_lose():
    class OwnParameter(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(3))
            self.body = nn.Linear(3, 3)

    with pytest.raises(ValueError, match=r"parameters/buffers of its own \(pos\).*move them into a layer"):
        pc.partition(OwnParameter(), 1)

    class WithDict(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleDict({"a": nn.Linear(2, 2)})

    with pytest.raises(ValueError, match="WithDict.heads is an nn.ModuleDict"):
        pc.partition(WithDict(), 1)


# -- the balance printout -------------------------------------------------------------------------
def test_balance_printout(capsys):
    pc.partition(FlatNet(), 2, "parameters")
    out = capsys.readouterr().out
    assert "6 layers into 2 stages by parameters" in out
    assert "stage" in out and "#layers" in out and "parameters" in out
    assert "embed .. " in out and ".. head" in out
    pc.partition([Sleepy(1), Sleepy(1)], 2, "time", torch.randn(2))
    assert "ms fwd+bwd" in capsys.readouterr().out
    pc.partition(FlatNet(), 2, "parameters", verbose=False)
    pc.partition([Sleepy(1), Sleepy(1)], 2, "time", torch.randn(2), verbose=False)
    assert capsys.readouterr().out == ""
