"""Microbatches of their own shapes (`Pipeline.step_microbatches`), on every rank of a pool, next to
one process running the same microbatches: each rank returns how far its gradients and losses are."""

from __future__ import annotations

import copy

import torch
from torch import nn

import pipecore as pc
from exactness import difference
from gpt_cases import small_config, sum_loss, text
from gpt import build_gpt, pipeline_stages
from shaped_message_cases import actions_in_program


def lengths(step: int, m: int, seq_len: int, replica: int = 0) -> list[int]:
    """Each microbatch's sequence length at this step: different per microbatch and per step."""
    g = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randint(seq_len // 4, seq_len + 1, (m,), generator=g).tolist()


def microbatches(step: int, m: int, rows: int, seq_len: int, replica: int = 0):
    """(inputs, targets) per microbatch, each `rows` windows of the text of its own length."""
    out = []
    for mb, n in enumerate(lengths(step, m, seq_len, replica)):
        g = torch.Generator().manual_seed(7 * step + mb + 100 * replica)
        starts = torch.randint(0, text().numel() - n - 1, (rows,), generator=g)
        windows = torch.stack([text()[s:s + n + 1] for s in starts.tolist()]).long()
        out.append((windows[:, :-1], windows[:, 1:]))
    return out


def train_variable(rank: int, world: int, name: str, steps: int = 5, dp: int = 1, device: bool = False) -> dict:
    """The example GPT through step_microbatches, lengths new at every step (dp > 1: replicas of the
    pipeline, each with microbatches of its own lengths), against one process running every
    replica's microbatches; the loss is summed and divided by the step's token count. `device`: the
    device path's protocol emulated, its messages carrying their shapes (variable_shapes=True on
    NCCL); the result then counts forwards beyond one per F action, and messages that outgrew their
    capacity."""
    pp = world // dp
    replica, position = divmod(rank, pp)
    mesh = pc.init_mesh(dp=dp, pp=pp) if dp > 1 else None
    sched = pc.build_schedule(name, pp, 2 * pp)
    m = sched.num_microbatches
    cfg = small_config(sched)
    model = build_gpt(cfg, seed=1)
    reference = copy.deepcopy(model)
    stages = pipeline_stages(model, sched, position)
    parts = pc.partition(model, len(set(sched.topology.model_stage)), method="parameters", verbose=False)
    name_of = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    model_name = {s.stage_index: {n: name_of[id(p)] for n, p in parts[sched.topology.model_stage[s.stage_index]]
                                  .named_parameters()} for s in stages}
    kw = {"group": mesh.get_group("pp"), "dp_group": mesh.get_group("dp")} if mesh is not None else {}
    pipe = pc.Pipeline(stages, sched, m, loss_fn=sum_loss, timeout=120, **kw)
    forwards = [0]
    if device:
        pipe.executor._emulate_device_comm()
        pipe.executor.set_shapes_travel(True)
        for s in stages:
            s.module.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    worst = {"grad": 0.0, "loss": 0.0, "outputs": [], "extra_forwards": 0, "grown": 0}
    for step in range(steps):
        forwards[0] = 0
        every = [microbatches(step, m, 2, cfg.seq_len, r) for r in range(dp)]
        tokens = sum(y.numel() for mbs in every for _, y in mbs)
        mine = every[replica]
        losses: list = []
        out = pipe.step_microbatches([(x,) for x, _ in mine] if pipe.has_first else None,
                                     target_mbs=[y for _, y in mine] if pipe.has_last else None,
                                     losses=losses, loss_divisor=tokens)
        worst.setdefault("lengths", []).append(lengths(step, m, cfg.seq_len, replica))
        if device:
            worst["extra_forwards"] += forwards[0] - actions_in_program(pipe, "F")
            worst["grown"] += pipe.executor.message_counts[2]
            worst["violations"] = pipe.executor._stream_violations()
        if out is not None:
            worst["outputs"].append([None if o is None else tuple(o.shape) for o in out])
        want_losses = []
        for r, mbs in enumerate(every):
            for x, y in mbs:
                loss = sum_loss(reference(x), y)
                (loss / tokens).backward()
                if r == replica:
                    want_losses.append(loss.detach())
        for got, want in zip(losses, want_losses):  # (dualpipe: None where the other direction's last stage is)
            if got is not None:
                worst["loss"] = max(worst["loss"], difference(got, want))
        for s in stages:
            for n, p in s.module.named_parameters():
                want = reference.get_parameter(model_name[s.stage_index][n]).grad
                worst["grad"] = max(worst["grad"], difference(p.grad, want))
                p.grad = None
        reference.zero_grad(set_to_none=True)
    return worst


class Tagged(nn.Module):
    """Stages that pass each microbatch's length on as a Python int beside the hidden states: a
    non-tensor value per microbatch crosses every boundary."""

    def __init__(self, last: bool):
        super().__init__()
        self.last = last
        self.lin = nn.Linear(8, 8)

    def forward(self, h, length=None):
        length = h.shape[1] if length is None else length
        assert length == h.shape[1], (length, h.shape)
        return self.lin(h) * length if self.last else (self.lin(h), length)


def tagged_values(rank: int, world: int, name: str, compat: bool = False) -> float:
    """Lengths new at every step, a Python int beside each microbatch's hidden states. `compat`:
    through pipecore.compat's schedule class and torch's `_step_microbatches` (each microbatch's
    loss weighted 1/m, as torch's scale_grads does for microbatches of equal rows)."""
    sched = pc.build_schedule(name, world, 4)
    torch.manual_seed(0)
    model = [Tagged(last=s == sched.num_stages - 1) for s in range(sched.num_stages)]
    reference = copy.deepcopy(model)
    stages = [pc.PipelineStage(copy.deepcopy(model[s]), s, sched.num_stages) for s in sched.rank_stages(rank)]
    loss_fn = lambda out, y: ((out - y) ** 2).sum()  # noqa: E731
    if compat:
        from pipecore.compat import get_schedule_class
        torch_name = {"1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble"}[name]
        runner = get_schedule_class(torch_name)(stages if len(stages) > 1 else stages[0], 4, loss_fn=loss_fn)
        first, last = runner.pipeline.has_first, runner.pipeline.has_last
    else:
        pipe = pc.Pipeline(stages, sched, 4, loss_fn=loss_fn, timeout=60)
        first, last = pipe.has_first, pipe.has_last
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        mbs = [(torch.randn(2, n, 8, generator=g), torch.randn(2, n, 8, generator=g))
               for n in torch.randint(1, 9, (4,), generator=g).tolist()]
        arg_mbs, target_mbs = [(x,) for x, _ in mbs] if first else None, [y for _, y in mbs] if last else None
        if compat:
            runner._step_microbatches(arg_mbs, target_mbs=target_mbs)
        else:
            pipe.step_microbatches(arg_mbs, target_mbs=target_mbs, loss_divisor=1.0)
        for x, y in mbs:
            value = reference[0](x)
            for layer in reference[1:]:
                value = layer(*value) if isinstance(value, tuple) else layer(value)
            (loss_fn(value, y) / (4 if compat else 1)).backward()
        for s in stages:
            for p, q in zip(s.module.parameters(), reference[s.stage_index].parameters()):
                worst = max(worst, difference(p.grad, q.grad))
                p.grad = None
        for layer in reference:
            layer.zero_grad(set_to_none=True)
    return worst


def wrong_count(rank: int, world: int) -> str:
    """Rank 0 gives 3 microbatches for 4: every rank's error."""
    sched = pc.build_schedule("1f1b", world, 4)
    torch.manual_seed(0)
    stages = [pc.PipelineStage(nn.Linear(8, 8), s, world) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, 4, loss_fn=lambda o, y: ((o - y) ** 2).sum(), timeout=60)
    xs = [(torch.randn(2, 8),) for _ in range(3 if rank == 0 else 4)]
    try:
        pipe.step_microbatches(xs if pipe.has_first else None,
                               target_mbs=[torch.randn(2, 8) for _ in range(4)] if pipe.has_last else None)
    except (pc.InputError, pc.PeerFailedError) as exc:
        return str(exc)
    return "no error"


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale=None):
        return self.lin(x) * (1.0 if scale is None else scale)


def keyword_microbatches(rank: int, world: int) -> dict:
    """kwarg_mbs under keyword_inputs="every_stage" (every stage of the rank they are given on gets
    its microbatch's), then eval_microbatches: gradients and outputs against one process."""
    sched = pc.build_schedule("1f1b", world, 4)
    torch.manual_seed(0)
    model = [Scaled() for _ in range(world)]
    reference = copy.deepcopy(model)
    pipe = pc.Pipeline(pc.PipelineStage(copy.deepcopy(model[rank]), rank, world), sched, 4,
                       loss_fn=lambda out, y: ((out - y) ** 2).sum(), keyword_inputs="every_stage", timeout=60)
    g = torch.Generator().manual_seed(0)
    mbs = [(torch.randn(2, n, 8, generator=g), torch.randn(2, 1, 1, generator=g), torch.randn(2, n, 8, generator=g))
           for n in (3, 5, 2, 7)]

    def forward(x, scale):
        for layer in reference:
            x = layer(x, scale=scale)
        return x

    pipe.step_microbatches([(x,) for x, _, _ in mbs] if pipe.has_first else None, [{"scale": s} for _, s, _ in mbs],
                           [y for _, _, y in mbs] if pipe.has_last else None, loss_divisor=1.0)
    for x, s, y in mbs:
        ((forward(x, s) - y) ** 2).sum().backward()
    grad = max(difference(p.grad, q.grad)
               for p, q in zip(pipe.stages[0].module.parameters(), reference[rank].parameters()))
    out = pipe.eval_microbatches([(x,) for x, _, _ in mbs] if pipe.has_first else None,
                                 [{"scale": s} for _, s, _ in mbs])
    with torch.no_grad():
        outputs = None if out is None else max(difference(o, forward(x, s)) for o, (x, s, _) in zip(out, mbs))
    return {"grad": grad, "outputs": outputs}
