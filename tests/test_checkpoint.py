"""pc.save_checkpoint / pc.load_checkpoint on 2 gloo ranks: a resumed run equals an uninterrupted one
bit for bit (AdamW with weight decay, an LR scheduler's state in `extra`, dropout through the
restored RNG states) under every kind of schedule; a checkpoint of another stage layout, or none,
fails at once on every rank and changes nothing; a failed save keeps the previous checkpoint."""

from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipecore as pc
from dist_pool import pool
from models import NEVER, Head, make_batch, make_stages, pipeline_step
from pipecore.errors import InputError
from pipecore.executor.comm import Comm

WORLD, MICROBATCHES, ROWS = 2, 4, 10
SCHEDULES = ["1f1b", "interleaved_1f1b", "zbv", "dualpipe"]


class DropoutBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(torch.tanh(self.fc(x)))


def model_stages(n: int, seed: int, dropout: bool, width: int = 16) -> list[nn.Module]:
    if not dropout:
        return make_stages("mlp", n, width, seed)
    torch.manual_seed(seed)
    stages = [DropoutBlock(width) for _ in range(n)]
    stages[-1] = nn.Sequential(DropoutBlock(width), Head(width))
    return stages


def build(rank, name, seed, dropout=False, width=16):
    """This rank's Pipeline (every model stage initialised from `seed`), AdamW and an LR scheduler."""
    sched = pc.build_schedule(name, WORLD, MICROBATCHES, 1 if name == "1f1b" else 2)
    topo = sched.topology
    model = model_stages(len(set(topo.model_stage)), seed, dropout, width)
    # dualpipe's mirrored stage holds a copy of its model stage
    stages = [pc.PipelineStage(copy.deepcopy(model[topo.model_stage[s]]), s, sched.num_stages)
              for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, MICROBATCHES, loss_fn=nn.CrossEntropyLoss(), timeout=NEVER)
    optimizer = torch.optim.AdamW([p for s in stages for p in s.module.parameters()], lr=0.02, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    return pipe, optimizer, scheduler


def train(pipe, optimizer, scheduler, step):
    x, y = make_batch(ROWS, seed=step + 1)
    losses: list = []
    pipeline_step(pipe, x, y, losses=losses)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return losses


def weights(pipe) -> dict:
    return {(s.stage_index, n): t.detach().clone() for s in pipe.stages for n, t in s.module.state_dict().items()}


def assert_equal_state(got: dict, want: dict, what: str):
    """Optimizer state dicts equal bit for bit."""
    assert got["param_groups"] == want["param_groups"], what
    assert got["state"].keys() == want["state"].keys(), what
    for pid, entries in want["state"].items():
        for k, v in entries.items():
            assert torch.equal(got["state"][pid][k], v), f"{what}: state {pid} {k}"


def resume_equals_uninterrupted(rank, world, name, dropout, root):
    path = os.path.join(root, "ckpt")
    pipe, optimizer, scheduler = build(rank, name, seed=0, dropout=dropout)
    torch.manual_seed(100 + rank)
    for step in range(2):
        train(pipe, optimizer, scheduler, step)
    pc.save_checkpoint(path, pipe, optimizer, extra={"step": 2, "scheduler": scheduler.state_dict()})
    at_save = copy.deepcopy(optimizer.state_dict())
    want_losses = [train(pipe, optimizer, scheduler, step) for step in (2, 3)]
    want = weights(pipe)

    # resumed: modules initialised from another seed, a fresh optimizer and scheduler, another RNG stream
    pipe, optimizer, scheduler = build(rank, name, seed=1, dropout=dropout)
    torch.manual_seed(999)
    extra = pc.load_checkpoint(path, pipe, optimizer)
    scheduler.load_state_dict(extra["scheduler"])
    assert_equal_state(optimizer.state_dict(), at_save, f"rank {rank}: optimizer state after load")
    got_losses = [train(pipe, optimizer, scheduler, step) for step in range(extra["step"], 4)]
    got = weights(pipe)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"rank {rank}: {key} differs from the uninterrupted run"
    assert len(got_losses) == len(want_losses)
    for g, w in zip(got_losses, want_losses):
        assert len(g) == len(w) and all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g, w))
    if not dropout:
        return None
    # the same resume, but the RNG streams started anew after the load: other dropout masks
    pipe, optimizer, scheduler = build(rank, name, seed=1, dropout=dropout)
    extra = pc.load_checkpoint(path, pipe, optimizer)
    scheduler.load_state_dict(extra["scheduler"])
    torch.manual_seed(999)
    for step in range(extra["step"], 4):
        train(pipe, optimizer, scheduler, step)
    return any(not torch.equal(t, want[k]) for k, t in weights(pipe).items())


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_resume_equals_uninterrupted(name, dropout, tmp_path):
    differs_without_rng = pool(WORLD).run(resume_equals_uninterrupted, name, dropout, str(tmp_path))
    if dropout:
        assert all(differs_without_rng), "dropout masks do not depend on the RNG states: the test shows nothing"
    layout = json.loads((tmp_path / "ckpt" / "pipecore.json").read_text())
    assert layout["schedule"] == name and layout["world"] == WORLD and layout["pipecore"] == pc.__version__
    assert layout["model_stages"] == (2 if name in ("1f1b", "dualpipe") else 4)
    assert layout["stages"]["stage0"]["fc.weight"] == [16, 16]
    assert not (tmp_path / "ckpt.saving").exists()


def layout_mismatch(rank, world, root):
    path = os.path.join(root, "two-stages")
    pipe, optimizer, scheduler = build(rank, "1f1b", seed=0)
    train(pipe, optimizer, scheduler, 0)
    pc.save_checkpoint(path, pipe, optimizer)
    messages = []
    for name, width in (("interleaved_1f1b", 16), ("1f1b", 8)):  # 4 model stages; 2 narrower ones
        other, other_optimizer, _ = build(rank, name, seed=1, width=width)
        before = weights(other)
        with pytest.raises(InputError) as caught:  # the Pipelines' timeout is NEVER: no rank waited one out
            pc.load_checkpoint(path, other, other_optimizer)
        after = weights(other)
        assert all(torch.equal(after[k], v) for k, v in before.items()), f"rank {rank}: the model changed"
        assert not other_optimizer.state, f"rank {rank}: the optimizer changed"
        messages.append(str(caught.value))
    return messages


def test_layout_mismatch_fails_on_every_rank(tmp_path):
    results = pool(WORLD).run(layout_mismatch, str(tmp_path), timeout=60)
    assert results[0] == results[1], "the ranks raised different errors"
    more, narrower = results[0]
    assert "2 model stages (schedule 1f1b on 2 ranks); this one has 4 model stages" in more
    assert "Only in the checkpoint: stage1.0.fc.bias, stage1.0.fc.weight, stage1.1.out.bias" in more
    assert "only here: stage1.fc.bias, stage1.fc.weight, stage2.fc.bias" in more
    assert "Load it into the same stage layout" in more
    assert "Other shapes: stage0.fc.bias ([16] there, [8] here), stage0.fc.weight ([16, 16] there, [8, 8] here)" \
        in narrower
    assert "stage1.1.out.weight ([5, 16] there, [5, 8] here)" in narrower


def missing_checkpoint(rank, world, root):
    pipe, optimizer, _ = build(rank, "1f1b", seed=0)
    messages = []
    for path in (os.path.join(root, "never-saved"), os.path.join(root, "empty")):
        with pytest.raises(InputError) as caught:
            pc.load_checkpoint(path, pipe, optimizer)
        messages.append(str(caught.value))
    return messages


def test_missing_checkpoint_fails_on_every_rank(tmp_path):
    (tmp_path / "empty").mkdir()
    results = pool(WORLD).run(missing_checkpoint, str(tmp_path), timeout=60)
    assert results[0] == results[1]
    never, empty = results[0]
    assert "no checkpoint at" in never and "does not exist" in never
    assert "no pipecore checkpoint at" in empty and "pipecore.json" in empty


def failed_save_keeps_previous(rank, world, root):
    path = os.path.join(root, "ckpt")
    pipe, optimizer, scheduler = build(rank, "zbv", seed=0)
    train(pipe, optimizer, scheduler, 0)
    pc.save_checkpoint(path, pipe, optimizer, extra={"step": 1})
    saved = weights(pipe)
    train(pipe, optimizer, scheduler, 1)
    with pytest.raises(InputError, match="extra cannot be pickled"):  # rank 0's extra; rank 1 learns it
        pc.save_checkpoint(path, pipe, optimizer, extra={"step": 2, "callback": lambda: None})
    assert pc.load_checkpoint(path, pipe, optimizer) == {"step": 1}
    assert all(torch.equal(t, saved[k]) for k, t in weights(pipe).items())
    pc.save_checkpoint(path, pipe, optimizer, extra={"step": 1.5})  # replaces the previous one
    return pc.load_checkpoint(path, pipe, optimizer)


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    assert pool(WORLD).run(failed_save_keeps_previous, str(tmp_path), timeout=60) == [{"step": 1.5}] * WORLD
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def two_copies_on_one_rank(rank, world, root):
    """A rank holding two copies of one model stage saves the first and loads both from it. No
    builder places them so; the checkpoint reads only these attributes of a Pipeline."""
    path = os.path.join(root, "ckpt")
    topology = SimpleNamespace(model_stage=(0, 1, 1, 0), stage_rank=(0, 1, 1, 0))

    def fake_pipe(seed):
        model = model_stages(2, seed, dropout=False)
        first, second = copy.deepcopy(model[rank]), copy.deepcopy(model[rank])
        with torch.no_grad():
            for p in second.parameters():
                p.add_(1.0)  # the second copy drifted: it is not what is saved
        stages = [pc.PipelineStage(first, rank, 4), pc.PipelineStage(second, 3 - rank, 4)]
        pipe = SimpleNamespace(stages=stages, schedule=SimpleNamespace(name="custom", topology=topology),
                               group=dist.group.WORLD, rank=rank, world=world,
                               comm=Comm(dist.group.WORLD, NEVER, torch.device("cpu")),
                               gradients=SimpleNamespace(dp=None))
        optimizer = torch.optim.AdamW([p for s in stages for p in s.module.parameters()], lr=0.1)
        return pipe, first, second, optimizer

    pipe, first, _, optimizer = fake_pipe(seed=0)
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    optimizer.step()
    want = {n: p.detach().clone() for n, p in first.named_parameters()}
    want_state = {n: optimizer.state[p]["exp_avg"].clone() for n, p in first.named_parameters()}
    pc.save_checkpoint(path, pipe, optimizer)

    pipe, first, second, optimizer = fake_pipe(seed=1)
    pc.load_checkpoint(path, pipe, optimizer)
    for module in (first, second):
        for n, p in module.named_parameters():
            assert torch.equal(p, want[n]), f"rank {rank}: {n}"
            assert torch.equal(optimizer.state[p]["exp_avg"], want_state[n]), f"rank {rank}: exp_avg of {n}"
    for (n, p), q in zip(first.named_parameters(), second.parameters()):
        assert optimizer.state[p]["exp_avg"] is not optimizer.state[q]["exp_avg"], "copies share optimizer state"
    return sorted(dcp_keys(path))


def dcp_keys(path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata().state_dict_metadata.keys()


def test_two_copies_of_a_model_stage_on_one_rank(tmp_path):
    keys = pool(WORLD).run(two_copies_on_one_rank, str(tmp_path), timeout=60)[0]
    assert not [k for k in keys if "copy" in k], keys
    assert {"stage0.fc.weight", "stage1.1.out.weight", "state.stage0.fc.weight.exp_avg",
            "param_groups.stage1.0.fc.bias.lr", "pipecore.extra", "pipecore.rng.rank1.cpu"} <= set(keys)


def save_before_first_step(rank, world, root):
    """An optimizer that never stepped is saved as it is (DCP's helpers would initialise its state):
    a resumed run's first step starts the state as the uninterrupted run's does."""
    path = os.path.join(root, "ckpt")
    pipe, optimizer, scheduler = build(rank, "interleaved_1f1b", seed=0)
    initial = weights(pipe)
    pc.save_checkpoint(path, pipe, optimizer, extra={"step": 0})
    assert not optimizer.state, "saving initialised the optimizer's state"
    assert all(torch.equal(t, initial[k]) for k, t in weights(pipe).items()), "saving changed the weights"
    train(pipe, optimizer, scheduler, 0)
    want = weights(pipe)
    pipe, optimizer, scheduler = build(rank, "interleaved_1f1b", seed=1)
    pc.load_checkpoint(path, pipe, optimizer)
    assert not optimizer.state
    train(pipe, optimizer, scheduler, 0)
    assert all(torch.equal(t, want[k]) for k, t in weights(pipe).items())


def test_save_before_the_first_step(tmp_path):
    pool(WORLD).run(save_before_first_step, str(tmp_path), timeout=60)


def load_into_another_schedule(rank, world, root):
    """Keys name model stages: a zbv checkpoint loads into interleaved 1F1B, whose ranks hold other
    model stages (their RNG streams do not continue: a warning says so)."""
    path = os.path.join(root, "ckpt")
    pipe, optimizer, scheduler = build(rank, "zbv", seed=0)
    train(pipe, optimizer, scheduler, 0)
    pc.save_checkpoint(path, pipe, optimizer)
    model_stage = pipe.schedule.topology.model_stage
    saved = {(model_stage[s], n): t for (s, n), t in weights(pipe).items()}
    other, other_optimizer, _ = build(rank, "interleaved_1f1b", seed=1)
    with pytest.warns(UserWarning, match="random number generators keep their states"):
        pc.load_checkpoint(path, other, other_optimizer)
    assert len(other_optimizer.state) == len(other_optimizer.param_groups[0]["params"])
    return saved, weights(other)  # interleaved 1F1B: stage s is model stage s


def test_load_into_another_schedule(tmp_path):
    results = pool(WORLD).run(load_into_another_schedule, str(tmp_path), timeout=60)
    saved = {k: v for r in results for k, v in r[0].items()}
    loaded = {k: v for r in results for k, v in r[1].items()}
    assert saved.keys() == loaded.keys() and len(saved) == 10
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
