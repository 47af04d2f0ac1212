"""The configurations users run, generated: one independent choice from each axis, trained through
pc.Pipeline on a pool of gloo ranks and compared, in float64, with one process training the same model on
the same whole batch. Twice a real client found silently wrong gradients in a configuration nobody had
thought to write down (FSDP2 at dp=1 under zero-bubble schedules; gradient accumulation with one
`fully_shard` over a list of modules): the suite searches the product of the axes instead of picking cases.

The axes (`AXES`, each value list simplest first: the shrinker moves toward the front):
- model: blocks of attention, MLP and a routed mixture of experts (top-2 of 4 experts over each token;
  grouped expert weights as TorchTitan keeps them, or one module per expert, whose unused experts get no
  gradient at all), pre-norms and a final norm; a tied embedding and head; a parameter two blocks of one
  stage share; a parameter no forward uses;
- wrapping: none, DDP, `fully_shard` of the stage module, `fully_shard` per block then the stage module,
  `fully_shard` over a LIST of modules (one FSDP state, several modules: [norm, head] and each stage's
  blocks, TorchTitan's default) then the stage module; `reshard_after_forward` True or False on the
  inner ones (its int form needs 4 replicas: not drawn); wrapped before the PipelineStage is built, or
  in place after (fully_shard then replaces the Parameters the stage's ties named);
- activation checkpointing: none, pipecore's own (`PipelineStage(activation_checkpointing=True)`),
  full and selective per block (torch's `checkpoint_wrapper`, as TorchTitan applies them);
- schedule: every name in pc.SCHEDULES that trains, as built or round-tripped through torch's CSV;
  pipeline ranks 2 or 3, stages per rank where the schedule takes a number; microbatches fewer than, as
  many as and more than the stages, where the schedule allows;
- steps: one or two optimizer steps, each after 1-3 `step()` calls (gradient accumulation); zero_grad
  after each optimizer step to None or to zeros (the wrappers then set aside and add back zeros); SGD
  with momentum or AdamW;
  a mean loss, or a sum with `loss_divisor` (the token count, some targets ignored);
- clipping: pc.clip_grad_norm_ at half the gradients' norm before each optimizer step, or none;
- checkpoints: after each optimizer step, pc.save_checkpoint, the weights zeroed, pc.load_checkpoint
  (the training goes on from what was loaded), or none;
- dp: 1 or 2 (pipeline ranks 2 then).

What is compared: every `.grad` of every rank's stages after each `step()` and after clipping (None
where one process has None), the losses, the clipped norm, and every weight after each optimizer step
and after a checkpoint's round trip, within FLOAT64_BOUND; after an AdamW step the weights, and what
is computed from them next (gradients, losses, the norm), within `after_adamw`.

Why a seeded generator of our own rather than hypothesis: a configuration runs on every rank of a pool,
and the cost that matters is the round trip to the pool and the Pipeline's first step, so configurations
are drawn up front and sent in batches of one world size; hypothesis draws one example at a time inside
its own loop. The draw is a function of (seed, index), so any configuration is named by its line
(`Config(...)`), and a failing one is shrunk toward the front of each axis (`shrink`) and printed as a
one-line reproducer: `python tests/config_space.py "Config(...)"`.

Combinations that are not a user's configuration are not drawn (`problem` says why each is left out):
DDP with a parameter that gets no gradient (pipecore refuses it, as DDP without find_unused_parameters
does), experts as modules of their own under DDP or FSDP2 (a replica whose tokens skip an expert
reduces fewer gradients than the others: FSDP2 and DDP themselves cannot), a shared parameter split
across FSDP2 groups (FSDP2 would shard it twice; its blocks stay in the stage's own group),
pc.save_checkpoint of stages wrapped over two replicas (refused with the fix: save them with DCP).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import itertools
import random
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pipecore as pc
from pipecore.schedule.builders import unsupported
from exactness import FLOAT64_BOUND, after_adamw, record

VOCAB, WIDTH, SEQ, EXPERTS, TOP_K = 11, 8, 3, 4, 2
ROWS_PER_MICROBATCH = 2
TRAINING_SCHEDULES = tuple(name for name in pc.SCHEDULES if name != "forward_only")
SGD_LR, ADAMW_LR = 0.1, 1e-2

# each axis's values, simplest first
AXES: dict[str, tuple] = {
    "schedule": ("1f1b",) + tuple(n for n in TRAINING_SCHEDULES if n != "1f1b"),
    "from_csv": (False, True),
    "pp": (2, 3),
    "stages_per_rank": (1, 2, 3),
    "microbatches": (2, 1, 3, 4, 5, 6, 8),
    "dp": (1, 2),
    "blocks": (("mlp",), ("attention",), ("moe",), ("attention", "mlp"), ("mlp", "moe"), ("attention", "moe"),
               ("attention", "mlp", "moe")),
    "blocks_per_stage": (1, 2),
    "experts": ("grouped", "modules"),
    "tied": (False, True),
    "shared": (False, True),
    "unused": (False, True),
    "wrapping": ("none", "ddp", "fsdp", "fsdp_blocks", "fsdp_list"),
    "wrap_order": ("before_stage", "after_stage"),
    "reshard": ("true", "false"),
    "checkpointing": ("none", "stage", "full", "selective"),
    "accumulate": ((1,), (2,), (3,), (1, 1), (2, 2), (1, 3), (3, 2)),
    "zero_grad": ("none", "zeros"),
    "optimizer": ("sgd", "adamw"),
    "loss": ("mean", "tokens"),
    "clip": (False, True),
    "checkpoint": (False, True),
}
# reshard_after_forward by name. Its int form (a smaller group to reshard to) needs 4 replicas or more, more
# processes than this machine runs: at 1 or 2 replicas FSDP2 takes an int as True or False. Not drawn.
RESHARD_AFTER_FORWARD = {"true": True, "false": False}
# schedules whose stages per rank is fixed (their builder's default: 1 or 2)
_FIXED_STAGES = {"gpipe": 1, "1f1b": 1, "zbh2": 1, "zb_auto": 1, "zbv": 2, "v_half": 2, "v_min": 2,
                 "dualpipe": 2, "dualpipev": 2}


@dataclasses.dataclass(frozen=True)
class Config:
    schedule: str = "1f1b"
    from_csv: bool = False
    pp: int = 2
    stages_per_rank: int = 1
    microbatches: int = 2
    dp: int = 1
    blocks: tuple = ("mlp",)
    blocks_per_stage: int = 1
    experts: str = "grouped"
    tied: bool = False
    shared: bool = False
    unused: bool = False
    wrapping: str = "none"
    wrap_order: str = "before_stage"  # wrapped before the PipelineStage is built, or in place after
    reshard: str = "true"  # reshard_after_forward of the inner groups: RESHARD_AFTER_FORWARD[reshard]
    checkpointing: str = "none"
    accumulate: tuple = (1,)
    zero_grad: str = "none"  # optimizer.zero_grad(set_to_none=...) after each optimizer step
    optimizer: str = "sgd"
    loss: str = "mean"
    clip: bool = False
    checkpoint: bool = False
    seed: int = 0

    @property
    def world(self) -> int:
        return self.pp * self.dp

    def line(self) -> str:
        """The configuration as one line: only what differs from the simplest choice, and the seed."""
        simplest = Config()
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != getattr(simplest, f.name) or f.name == "seed"]
        return f"Config({', '.join(fields)})"


def problem(c: Config) -> str | None:
    """Why `c` is not drawn (None: it is a configuration users run that pipecore must train exactly)."""
    if c.schedule in _FIXED_STAGES and c.stages_per_rank != _FIXED_STAGES[c.schedule]:
        return "the schedule's stages per rank is fixed"
    if c.dp == 2 and c.pp != 2:
        return "dp=2 runs on 2 pipeline ranks (4 processes)"
    why = unsupported(c.schedule, c.pp, c.microbatches, c.stages_per_rank)
    if why is not None:
        return why
    if c.experts == "modules" and "moe" not in c.blocks:
        return "no experts"
    if c.experts == "modules" and c.wrapping != "none":
        return "a replica whose tokens skip an expert reduces fewer gradients (DDP and FSDP2 cannot either)"
    if c.wrapping == "ddp" and c.unused:
        return "DDP without find_unused_parameters needs every parameter's gradient (pipecore refuses it)"
    if c.wrapping in ("none", "ddp") and c.reshard != "true":
        return "reshard_after_forward is FSDP2's"
    if c.wrapping == "fsdp" and c.reshard != "true":
        return "the stage module's own group is resharded by the pipeline (RESHARD)"
    if c.checkpoint and len(c.accumulate) < 2:
        return "a checkpoint is loaded between two optimizer steps"
    if c.checkpoint and c.dp == 2 and c.wrapping != "none":
        return "pc.save_checkpoint refuses stages wrapped over replicas (DCP saves them; tests/test_checkpoint.py)"
    if c.shared and c.blocks_per_stage < 2:
        return "sharing needs two blocks in a stage"
    return None


def draw(seed: int, index: int) -> Config:
    """The `index`-th configuration of the space under `seed`: one value per axis, drawn again until
    `problem` finds none (a function of (seed, index) alone)."""
    rng = random.Random(f"{seed}/{index}")
    while True:
        c = Config(**{axis: rng.choice(values) for axis, values in AXES.items()}, seed=rng.randrange(1 << 16))
        if c.schedule in _FIXED_STAGES:
            c = dataclasses.replace(c, stages_per_rank=_FIXED_STAGES[c.schedule])
        if c.dp == 2:
            c = dataclasses.replace(c, pp=2)
        if c.wrapping in ("none", "ddp", "fsdp"):
            c = dataclasses.replace(c, reshard="true")
        if "moe" not in c.blocks or c.wrapping != "none":
            c = dataclasses.replace(c, experts="grouped")
        if c.shared:
            c = dataclasses.replace(c, blocks_per_stage=2)
        if problem(c) is None:
            return c


def configurations(seed: int, count: int) -> list[Config]:
    return [draw(seed, i) for i in range(count)]


def value_pairs(c: Config) -> set[tuple]:
    """Every pair of (axis, value) that `c` draws together."""
    values = [(axis, getattr(c, axis)) for axis in AXES]
    return set(itertools.combinations(values, 2))


def covering(seed: int, count: int, among: int = 1000) -> list[Config]:
    """`count` of the first `among` configurations drawn under `seed`, chosen greedily, each the one that draws
    the most pairs of axis values no earlier choice drew (a covering array's greedy construction): a bug that
    needs two choices together shows in a configuration drawing that pair. 80 draw 97.7% of the pairs that
    occur in 3,000 draws, about what the first 200 draws do (97.9%; the first 120: 94.6%)."""
    candidates = configurations(seed, among)
    pairs = [value_pairs(c) for c in candidates]
    drawn: set[tuple] = set()
    chosen: list[int] = []
    for _ in range(count):
        best = max((i for i in range(among) if i not in chosen), key=lambda i: (len(pairs[i] - drawn), -i))
        chosen.append(best)
        drawn |= pairs[best]
    return [candidates[i] for i in sorted(chosen)]


# -- the model ----------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Pre-norm causal self-attention, one head."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MoE(nn.Module):
    """Top-2 of 4 experts per token, weighted by the router's softmax, the last expert never chosen;
    each expert runs on its tokens only, so an expert no token of a microbatch chose gets nothing from
    that microbatch. `modules`: the experts as modules of their own (an expert unused by a whole step
    keeps .grad None: the last always, the others where a replica's tokens skip them), else grouped into
    one weight per projection (TorchTitan's GroupedExperts: unused rows get zeros)."""

    def __init__(self, modules: bool):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.register_buffer("dead", torch.arange(EXPERTS) == EXPERTS - 1, persistent=False)
        if modules:
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH, bias=False), nn.GELU(),
                                                       nn.Linear(2 * WIDTH, WIDTH, bias=False))
                                         for _ in range(EXPERTS))
        else:
            self.w_up = nn.Parameter(torch.randn(EXPERTS, WIDTH, 2 * WIDTH) / WIDTH ** 0.5)
            self.w_down = nn.Parameter(torch.randn(EXPERTS, 2 * WIDTH, WIDTH) / (2 * WIDTH) ** 0.5)

    def expert(self, e: int, h):
        if hasattr(self, "experts"):
            return self.experts[e](h)
        return F.gelu(h @ self.w_up[e]) @ self.w_down[e]

    def forward(self, x):
        h = self.norm(x).reshape(-1, WIDTH)
        # the last expert is never chosen: its weights get no gradient from any token (None as a module
        # of its own, zero rows when grouped), on every rank as in one process
        logits = self.router(h).masked_fill(self.dead, float("-inf"))
        weights, chosen = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
        out = torch.zeros_like(h)
        for e in range(EXPERTS):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, weights[token, slot, None] * self.expert(e, h[token]))
        return x + out.view_as(x)


class StageModule(nn.Module):
    """One model stage: the embedding (first), blocks, the final norm and head (last)."""

    def __init__(self, c: Config, index: int, count: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH) if index == 0 else None
        kinds = [c.blocks[(index * c.blocks_per_stage + j) % len(c.blocks)] for j in range(c.blocks_per_stage)]
        if c.shared and index == count // 2:  # two MLP blocks whose up-projections are one Parameter
            kinds[:2] = ["mlp", "mlp"]
        self.blocks = nn.ModuleList(Attention() if k == "attention" else MLP() if k == "mlp"
                                    else MoE(c.experts == "modules") for k in kinds)
        if c.shared and index == count // 2:
            self.blocks[1].up.weight = self.blocks[0].up.weight
        self.shares = c.shared and index == count // 2
        self.norm = nn.LayerNorm(WIDTH) if index == count - 1 else None
        self.head = nn.Linear(WIDTH, VOCAB, bias=False) if index == count - 1 else None
        if c.unused and index == count - 1:
            self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def build_model(c: Config, count: int) -> list[StageModule]:
    """The whole model (`count` stages), seeded, with the user's activation checkpointing applied."""
    torch.manual_seed(c.seed)
    model = [StageModule(c, i, count) for i in range(count)]
    if c.tied:
        model[-1].head.weight = model[0].embed.weight
    if c.checkpointing in ("full", "selective"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        context = functools.partial(_selective_contexts) if c.checkpointing == "selective" else None
        for stage in model:
            for j, block in enumerate(stage.blocks):
                stage.blocks[j] = (checkpoint_wrapper(block, context_fn=context) if context
                                   else checkpoint_wrapper(block))
    return model


def _save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_matmuls)


def _unwrapped(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def wrap(c: Config, module: StageModule, mesh) -> nn.Module:
    """The user's data-parallel wrapping of one stage module."""
    if c.wrapping == "none":
        return module
    if c.wrapping == "ddp":
        return nn.parallel.DistributedDataParallel(module, process_group=mesh.get_group("dp"))
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh["dp"]
    if c.wrapping == "fsdp_blocks":
        # a Parameter two blocks share stays in one group: the stage module's (FSDP2 would shard it twice)
        for block in (module.blocks[2:] if module.shares else module.blocks):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=RESHARD_AFTER_FORWARD[c.reshard])
    elif c.wrapping == "fsdp_list":  # one state over several modules, as TorchTitan wraps [norm, head]; the
        # blocks' list holds both blocks that share a Parameter, as FSDP2 asks for shared parameters
        fully_shard(list(module.blocks), mesh=dp_mesh, reshard_after_forward=RESHARD_AFTER_FORWARD[c.reshard])
        if module.head is not None:
            fully_shard([module.norm, module.head], mesh=dp_mesh,
                        reshard_after_forward=RESHARD_AFTER_FORWARD[c.reshard])
    return fully_shard(module, mesh=dp_mesh)


# -- one configuration on every rank ----------------------------------------------------------------
_MESHES: dict = {}


def _mesh(dp: int, pp: int):
    if (dp, pp) not in _MESHES:  # making groups is a collective: once per process
        _MESHES[(dp, pp)] = pc.init_mesh(dp=dp, pp=pp)
    return _MESHES[(dp, pp)]


def schedule_of(c: Config) -> pc.Schedule:
    sched = pc.build_schedule(c.schedule, c.pp, c.microbatches, c.stages_per_rank)
    if not c.from_csv:
        return sched
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"{c.schedule}.csv")
        sched.to_csv(path)
        return pc.Schedule.from_csv(path)


def global_batch(c: Config, group: int, call: int):
    """Tokens and targets of one step() call, all replicas' rows; with the token loss, about a third of
    the targets ignored (-100), a different number on each replica."""
    g = torch.Generator().manual_seed(c.seed * 1000 + group * 10 + call)
    rows = c.dp * c.microbatches * ROWS_PER_MICROBATCH
    x = torch.randint(VOCAB, (rows, SEQ), generator=g)
    y = torch.randint(VOCAB, (rows, SEQ), generator=g)
    if c.loss == "tokens":
        y = torch.where(torch.rand(y.shape, generator=g) < 0.3, torch.full_like(y, -100), y)
        y[0, 0] = VOCAB - 1  # at least one token counts
    return x, y


def _loss_fn(reduction: str):
    def loss_fn(out, target):
        return F.cross_entropy(out.flatten(0, 1), target.flatten(), reduction=reduction, ignore_index=-100)
    return loss_fn


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _difference(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())):
        return float("inf")
    largest = float(want.abs().max()) if want.numel() else 0.0
    return float((got - want).abs().max()) / (largest if largest > 0 else 1.0) if want.numel() else 0.0


def run_one(rank: int, c: Config) -> tuple[dict, str | None]:
    """Trains `c` on this rank and in one process. Returns the worst differences and the first one
    over its bound (None if none). A difference does not stop the run: the ranks keep entering the
    same collectives."""
    mesh = _mesh(c.dp, c.pp)
    replica, position = divmod(rank, c.pp)
    sched = schedule_of(c)
    topo = sched.topology
    count = len(set(topo.model_stage))
    model = build_model(c, count)
    reference = copy.deepcopy(model)
    modules, stages = {}, []
    for s in sched.rank_stages(position):
        module = copy.deepcopy(model[topo.model_stage[s]])
        if c.wrap_order == "before_stage":
            module = wrap(c, module, mesh)
        plain = _unwrapped(module)
        tied = {}
        if c.tied and plain.embed is not None:
            tied["embedding"] = plain.embed.weight
        if c.tied and plain.head is not None:
            tied["embedding"] = plain.head.weight
        stage = pc.PipelineStage(module, s, sched.num_stages, tied=tied,
                                 activation_checkpointing=c.checkpointing == "stage")
        if c.wrap_order == "after_stage":  # fully_shard in place (new Parameter objects); DDP through submod
            wrapped = wrap(c, module, mesh)
            if wrapped is not module:
                stage.submod = wrapped
            module = wrapped
        modules[s] = module
        stages.append(stage)
    loss_fn = _loss_fn("sum" if c.loss == "tokens" else "mean")
    pipe = pc.Pipeline(stages, sched, c.microbatches, loss_fn, group=mesh.get_group("pp"),
                       dp_group=mesh.get_group("dp") if c.dp > 1 else None, timeout=60)
    params = pipe.parameters()
    ref_params = list({id(p): p for m in reference for p in m.parameters()}.values())
    if c.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref_params, lr=ADAMW_LR, weight_decay=0.1)
        weight_bound = after_adamw(ADAMW_LR, len(c.accumulate))
        # AdamW turns a gradient's rounding into a step of up to lr / eps of it (after_adamw), and what the
        # next group computes from those weights moves with them: its gradients and losses are held to the
        # weights' bound after an AdamW step (the search found 3.9e-12 in a norm's bias after one step)
        computed_bound = lambda group: FLOAT64_BOUND if group == 0 else after_adamw(ADAMW_LR, group)  # noqa: E731
    else:
        opt = torch.optim.SGD(params, lr=SGD_LR, momentum=0.9)
        ref_opt = torch.optim.SGD(ref_params, lr=SGD_LR, momentum=0.9)
        weight_bound = FLOAT64_BOUND
        computed_bound = lambda group: FLOAT64_BOUND  # noqa: E731
    pairs = [(f"stage {s} {name}", p, reference[topo.model_stage[s]].get_parameter(name))
             for s, module in modules.items() for name, p in _unwrapped(module).named_parameters()]
    worst = {"grad": 0.0, "weight": 0.0, "loss": 0.0, "after_adamw": 0.0}
    counts = {"none": 0, "losses": 0}  # gradients None on both sides; losses compared
    first: list[str] = []

    def differs(where: str) -> None:
        if not first:
            first.append(where)

    def check(key: str, err: float, bound: float, where: str) -> None:
        key = key if bound == FLOAT64_BOUND else "after_adamw"  # the float64 summary holds 2^-38's alone
        worst[key] = max(worst[key], err)
        if not err <= bound:
            differs(f"{where}: {err:.3e} off one process, relative to the largest entry (bound {bound:.1e})")

    def compare_grads(when: str, bound: float) -> None:
        for where, p, q in pairs:
            if q.grad is None or p.grad is None:
                counts["none"] += q.grad is None and p.grad is None
                if (q.grad is None) != (p.grad is None):
                    differs(f"{where}, {when}: .grad is {'not ' if p.grad is not None else ''}None, one "
                            f"process's is {'not ' if q.grad is not None else ''}None")
                continue
            check("grad", _difference(_full(p.grad), q.grad), bound, f"{where} .grad, {when}")

    def zero(set_to_none: bool) -> None:
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)

    for group, calls in enumerate(c.accumulate):
        for call in range(calls):
            x, y = global_batch(c, group, call)
            ref_loss = _loss_fn("sum")(_forward(reference, x), y)
            divisor = (y != -100).sum()
            (ref_loss / divisor).backward()
            mine = slice(replica * len(x) // c.dp, (replica + 1) * len(x) // c.dp)
            losses: list = []
            extra = {"loss_divisor": divisor} if c.loss == "tokens" and pipe.has_last else {}
            pipe.step(*((x[mine],) if pipe.has_first else ()), target=y[mine] if pipe.has_last else None,
                      losses=losses, return_outputs=False, **extra)
            when = f"group {group} call {call}"
            compare_grads(when, computed_bound(group))
            if pipe.has_last:
                rows = torch.tensor_split(torch.arange(len(x))[mine], c.microbatches)
                for mb, (got, idx) in enumerate(zip(losses, rows)):
                    if got is None:  # dualpipe: the other direction's last stage computed it
                        continue
                    with torch.no_grad():
                        want = _loss_fn("sum" if c.loss == "tokens" else "mean")(_forward(reference, x[idx]), y[idx])
                    check("loss", _difference(got, want), computed_bound(group),
                          f"loss of microbatch {mb}, {when}")
                    counts["losses"] += 1
        if c.clip:
            max_norm = 0.5 * float(torch.linalg.vector_norm(torch.stack(
                [q.grad.norm() for q in ref_params if q.grad is not None])))
            norm = pc.clip_grad_norm_(pipe, max_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
            check("grad", _difference(norm, ref_norm), computed_bound(group), f"the clipped norm, group {group}")
            compare_grads(f"group {group}, clipped", computed_bound(group))
        opt.step()
        ref_opt.step()
        for where, p, q in pairs:
            check("weight", _difference(_full(p.detach()), q.detach()), weight_bound, f"{where} after optimizer "
                  f"step {group}")
        zero(c.zero_grad == "none")
        if c.checkpoint:
            _round_trip(pipe, opt, params)
            for where, p, q in pairs:
                check("weight", _difference(_full(p.detach()), q.detach()), weight_bound, f"{where} after a "
                      f"checkpoint's round trip, group {group}")
    here = list(map(_unwrapped, modules.values()))
    none_expected = ((c.unused and any(m.head is not None for m in here))
                     or (c.experts == "modules" and any(isinstance(getattr(b, "_checkpoint_wrapped_module", b), MoE)
                                                        for m in here for b in m.blocks)))
    if none_expected and not counts["none"]:  # a comparison of None with None must have happened
        differs("no parameter kept .grad None, though this rank holds one no forward uses or an expert never chosen")
    return {**worst, **counts}, (first[0] if first else None)


def _round_trip(pipe, opt, params) -> None:
    """pc.save_checkpoint into a temporary folder every rank shares, the weights zeroed and the optimizer's
    state dropped, pc.load_checkpoint (the next group's optimizer step needs the state back)."""
    import shutil
    import tempfile

    from pipecore.stage.dtensor import local_part

    folder = [tempfile.mkdtemp(prefix="pipecore-config-space-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    try:
        pc.save_checkpoint(folder[0], pipe, opt)
        with torch.no_grad():  # what the load must bring back: the weights and the optimizer's state
            for p in params:
                local_part(p).zero_()
        opt.state.clear()
        pc.load_checkpoint(folder[0], pipe, opt)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)


def _forward(model, x):
    for module in model:
        x = module(x)
    return x


def run_batch(rank: int, world: int, lines: list[str]) -> list[tuple[str | None, dict, bool]]:
    """A rank pool case: each configuration (given by its line) on every rank of this pool, in turn.
    Returns (what went wrong or None, worst differences, whether it raised) per configuration run. The
    ranks meet at a barrier after each. A configuration that raises ends the batch, and the driver runs
    the rest on a new pool."""
    import warnings

    # pipecore's one-time notes (OVERLAP_F_B pairs of wrapped stages run in sequence, a split that ran at
    # I): what is compared is the numbers
    warnings.filterwarnings("ignore", message="pipecore: ")
    out = []
    for line in lines:
        c = parse(line)
        assert c.world == world, (line, world)
        try:
            worst, why = run_one(rank, c)
            raised = False
            if why is None:
                record("float64 (the generated configuration space)", max(worst["grad"], worst["loss"]))
        except Exception:  # noqa: BLE001 - reported with the configuration
            # a timeout closes gloo's pairs of the groups it waited on (the mesh's, kept for the next
            # configurations): the driver runs the rest on a new pool
            out.append((traceback.format_exc(limit=-6), {}, True))
            break
        out.append((why, worst, raised))
        try:  # bounded: a rank that raised after the last collective does not hold the others for gloo's 30 min
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
        except Exception:  # noqa: BLE001 - the group is gone: the driver starts a new pool
            break
    return out


def tie_sharded_on_one_side(rank: int, world: int) -> str:
    """dp=2 x pp=2: the embedding's stage in fully_shard, the head's plain, one tie between them: the
    copies' shards differ, and every rank refuses the first step saying so."""
    c = Config(dp=2, tied=True)
    mesh = _mesh(2, 2)
    position = rank % 2
    model = build_model(c, 2)
    module = copy.deepcopy(model[position])
    if position == 0:
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, mesh=mesh["dp"])
    weight = module.embed.weight if position == 0 else module.head.weight
    stage = pc.PipelineStage(module, position, 2, tied={"embedding": weight})
    pipe = pc.Pipeline([stage], "1f1b", 2, _loss_fn("mean"), group=mesh.get_group("pp"),
                       dp_group=mesh.get_group("dp"), timeout=60)
    x, y = global_batch(c, 0, 0)
    half = slice(0, len(x) // 2) if rank < 2 else slice(len(x) // 2, len(x))
    try:
        pipe.step(*((x[half],) if pipe.has_first else ()), target=y[half] if pipe.has_last else None)
    except pc.InputError as exc:
        return str(exc)
    return "no error"


def parse(line: str) -> Config:
    """A Config from its line (`Config.line()`)."""
    return eval(line, {"Config": Config})  # noqa: S307 - the tests' own reproducer lines


# -- the driver (pytest process) ----------------------------------------------------------------------
def run(configs: list[Config], batch: int = 16, timeout_per_config: float = 90.0) -> list[tuple[Config, str | None]]:
    """Runs `configs` on rank pools (one per world size), `batch` at a time. Returns each
    configuration with None, or what went wrong on which rank."""
    from dist_pool import pool

    results: list[tuple[Config, str | None]] = []
    by_world: dict[int, list[Config]] = {}
    for c in configs:
        by_world.setdefault(c.world, []).append(c)
    for world, todo in sorted(by_world.items()):
        while todo:
            chunk, ranks = todo[:batch], pool(world)
            try:
                per_rank = ranks.run(run_batch, [c.line() for c in chunk], timeout=timeout_per_config * len(chunk))
            except Exception as exc:  # noqa: BLE001 - a rank died or hung past every timeout
                ranks.broken = True
                if len(chunk) > 1:  # again one at a time, to name the configuration
                    alone = run(chunk, batch=1, timeout_per_config=timeout_per_config)
                    if all(why is None for _, why in alone):  # state leaked from one configuration to the next
                        alone[0] = (chunk[0], f"a batch of {len(chunk)} from this configuration on failed, and each "
                                              f"passed alone: {exc}")
                    results.extend(alone)
                else:
                    results.append((chunk[0], f"the rank pool failed: {exc}"))
                todo = todo[len(chunk):]
                continue
            done = min(len(r) for r in per_rank)
            assert done >= 1, "a batch returned no result"
            if done < len(chunk) or any(r[done - 1][2] for r in per_rank if len(r) >= done):
                ranks.broken = True  # a configuration raised: the groups it waited on may be closed
            for i, c in enumerate(chunk[:done]):
                errors = [f"rank {r}: {res[i][0]}" for r, res in enumerate(per_rank) if res[i][0] is not None]
                compared = sum(res[i][1].get("losses", 0) for res in per_rank)
                if not errors and compared != c.dp * c.microbatches * sum(c.accumulate):
                    errors.append(f"{compared} microbatch losses compared, {c.dp * c.microbatches * sum(c.accumulate)} "
                                  "computed")
                results.append((c, "\n".join(errors) if errors else None))
            todo = todo[max(done, 1):]
    return results


def fails(c: Config, fresh: bool = False) -> str | None:
    """What goes wrong with `c` (None: nothing); `fresh`: on new processes, as a reproducer runs."""
    if fresh:
        from dist_pool import pool

        pool(c.world).broken = True  # the next run spawns a new pool
    return run([c], batch=1)[0][1]


def _kind(failure: str) -> str:
    """What sort of failure: a difference from one process, or the exception a rank raised."""
    if "off one process" in failure or ".grad is" in failure or "losses compared" in failure:
        return "a difference from one process"
    raised = [line.split(":")[0] for line in failure.splitlines() if line and not line[0].isspace()
              and line.split(":")[0].endswith(("Error", "Exception"))]
    return raised[-1] if raised else failure.splitlines()[0][:80]


def shrink(c: Config, failure: str, budget: int = 60) -> tuple[Config, str]:
    """A simpler configuration that fails the same way (`_kind`), on new processes: each axis in turn set
    to each simpler value (toward the front of its list), kept where such a failure stays; until no axis
    moves or `budget` runs."""
    runs = 0
    kind = _kind(failure)
    changed = True
    while changed and runs < budget:
        changed = False
        for axis, values in list(AXES.items()) + [("seed", (0,))]:
            current = getattr(c, axis)
            simpler = values[:values.index(current)] if current in values else values
            for value in simpler:
                candidate = _normalise(dataclasses.replace(c, **{axis: value}))
                if candidate == c or problem(candidate) is not None:
                    continue
                runs += 1
                why = fails(candidate, fresh=True)
                if why is not None and _kind(why) == kind:
                    c, failure, changed = candidate, why, True
                    break
                if runs >= budget:
                    return c, failure
    return c, failure


def _normalise(c: Config) -> Config:
    if c.schedule in _FIXED_STAGES:
        c = dataclasses.replace(c, stages_per_rank=_FIXED_STAGES[c.schedule])
    return c


def main(argv: list[str]) -> int:
    """`python tests/config_space.py "Config(...)"`: that configuration; `--seed S --count N`: N drawn."""
    import argparse
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from exactness import use_exact_dtype

    use_exact_dtype()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="a configuration's line, as a failing test prints it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--start", type=int, default=0, help="the first index drawn")
    parser.add_argument("--shrink", action="store_true", help="shrink each failing configuration")
    args = parser.parse_args(argv)
    configs = [parse(args.config)] if args.config else [draw(args.seed, i) for i in
                                                       range(args.start, args.start + args.count)]
    started = time.monotonic()
    failed = 0
    try:
        for start in range(0, len(configs), 100):  # progress every 100
            for c, why in run(configs[start:start + 100]):
                if why is not None:
                    failed += 1
                    if args.shrink:
                        c, why = shrink(c, why)
                    print(f"FAILED {c.line()}\n{why}\n", flush=True)
            print(f"[{min(start + 100, len(configs))} of {len(configs)}: {failed} failed, "
                  f"{time.monotonic() - started:.0f} s]", flush=True)
    finally:
        from dist_pool import close_all

        close_all()
    print(f"{len(configs) - failed} passed, {failed} failed in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
