"""Tokens/s of the example GPT (examples/gpt.py) on gloo CPU ranks: pipecore against
torch.distributed.pipelining, with each side's peak memory per rank.

Every rank builds the same GPT (seed 0) and splits it with `pc.partition` into the schedule's
model stages. pipecore runs this rank's stages from `pipeline_stages` (the LM head tied to the
token embedding, a tie pc.partition finds); torch runs deep copies of the same partition's
stages as `torch.distributed.pipelining.PipelineStage`s under the matching torch schedule class
(Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, ScheduleGPipe), same microbatches,
same loss (`lm_loss`), same batches. One training step is, on both sides:

    pipeline step -> tied embedding/head gradients summed -> clip to global norm 1.0 -> AdamW -> zero_grad

pipecore: `pipe.step`, then `pc.clip_grad_norm_(pipe, 1.0)` (the tie is summed inside the step).
torch has neither tied weights nor pipeline-wide clipping, so they are done by hand: the two
copies' gradients are summed (an all-reduce on a group of the two ranks holding them, or a local
sum where one rank holds both, as in zbv's V placement), and the global norm is the sum of each
rank's squared gradient norms (the head's tied copy left out, as pipecore counts a tie once)
all-reduced over the ranks. Both sides keep the last stage's outputs (`return_outputs=True`).

Before timing, both run one step on the same batch from the same weights; the mean losses, the
global gradient norms and the clipped gradients of every parameter are compared (printed under the
table), so the two sides compute the same thing. After `--warmup` more steps each, pipecore and
torch alternate in timed blocks of `--steps` steps (A B A B ..., a barrier around each block);
the step time is the median over blocks of block time / steps (the slowest rank's median), and
tokens/s = rows * seq_len / step time. "CPU ms" is the CPU time of a step summed over the ranks'
processes (all their threads, `time.process_time`): where the ranks outnumber the cores, as in the
default run on a 2-core machine, throughput is bounded by it, so torch/pipecore CPU is the most
tokens/s that cutting pipecore's own work could give over torch there.

The timed blocks run under glibc's default allocator, as users' processes do. Memory (CPU,
/proc/self/status) is measured in ranks spawned a second time for it, which run the same first
step and warm-up and then `--memory-blocks` blocks of each side (A B A B ...), with glibc told from
their start (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, as bench/memory.py does) to serve
blocks >= 64 KiB by mmap and to trim on free, so freed tensors leave the resident set. That makes
every large tensor a fresh mmap whose pages fault in (a step took 1.45-1.69x the CPU time of one
with the thresholds raised to 32 and 128 MiB, both sides), so no timing is taken under it.
Before each memory block the peak RSS (VmHWM) is reset to the current RSS; after it, VmHWM is read.
"peak MiB" is the largest VmHWM over that side's blocks: the process's whole resident set at its
peak, which includes both sides' weights and AdamW states and torch itself (each rank holds both
pipelines), so only the difference between the two columns is the executor's. "step +MiB" is the
largest (VmHWM - RSS at the block's start) over that side's blocks: what one side's steps add on top
of what is resident between steps (activations, gradients, messages in flight, receive buffers
allocated during the block). Per rank, r0/r1/...

    python bench/gpt.py                                  # 1f1b, interleaved_1f1b, zbv on 4 ranks
    python bench/gpt.py --schedules 1f1b gpipe --width 256 --layers 6 --rows 64
    python bench/gpt.py --plot gpt.png
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import textwrap
import time
import traceback

import _harness  # noqa: F401  (puts the repo on sys.path)
from _harness import ROOT, bar_plot, spawn, table
from memory import _reset_peak, _status_mib, resident_follows_tensors_in_spawned
from vs_torch import TORCH_CLASS

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zbv"]
DEFAULT_SCHEDULES = ["1f1b", "interleaved_1f1b", "zbv"]
SIDES = ("pipecore", "torch")


def _say(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def _rank(rank, world, name, cfg_kw, m, rows, steps, warmup, blocks, torch_timeout):
    try:
        return _bench_rank(rank, world, name, cfg_kw, m, rows, steps, warmup, blocks, torch_timeout)
    except Exception:  # noqa: BLE001  (returned, so that the parent reports it instead of waiting forever)
        return {"fatal": traceback.format_exc()}


def _bench_rank(rank, world, name, cfg_kw, m, rows, steps, warmup, blocks, torch_timeout):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import pipecore as pc

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPTConfig, build_gpt, get_batch, lm_loss, pipeline_stages, stdlib_bytes

    V = 1 if name in ("gpipe", "1f1b") else 2
    sched = pc.build_schedule(name, world, m, V)
    topo = sched.topology
    n = sched.num_stages
    mine = sched.rank_stages(rank)
    first, last = topo.stage_rank[0] == rank, topo.stage_rank[n - 1] == rank
    cfg = GPTConfig(**cfg_kw)
    model = build_gpt(cfg, seed=0)
    data = stdlib_bytes(1_000_000)
    batches = [get_batch(data, i, rows, cfg.seq_len) for i in range(8)]

    # -- pipecore ------------------------------------------------------------------------------
    pstages = pipeline_stages(model, sched, rank)
    pipe = pc.Pipeline(pstages, sched, m, loss_fn=lm_loss)
    pparams = list({id(p): p for s in pstages for p in s.module.parameters()}.values())
    popt = torch.optim.AdamW(pparams, lr=3e-4, weight_decay=0.1)

    def pc_grads(batch, losses=None):
        x, y = batch
        pipe.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        return pc.clip_grad_norm_(pipe, 1.0)

    def pc_update():
        popt.step()
        popt.zero_grad(set_to_none=True)

    # -- torch: the same partition, deep copies of the same stage modules ----------------------
    parts = pc.partition(model, len(set(topo.model_stage)), method="parameters", verbose=False)
    tmods = {s: copy.deepcopy(parts[topo.model_stage[s]]) for s in mine}
    embed_stage = next(s for s in range(n) if hasattr(parts[topo.model_stage[s]], "embed"))
    head_stage = next(s for s in range(n) if hasattr(parts[topo.model_stage[s]], "head"))
    tied = embed_stage != head_stage
    holders = sorted({topo.stage_rank[embed_stage], topo.stage_rank[head_stage]})
    # every rank creates every group, in the same order; a timeout so that a torch failure on one
    # rank ends the others' waits with an error instead of a hang
    tgroup = dist.new_group(list(range(world)), timeout=timedelta(seconds=torch_timeout))
    tie_group = (dist.new_group(holders, timeout=timedelta(seconds=torch_timeout))
                 if tied and len(holders) == 2 else None)
    t_emb = tmods[embed_stage].embed.tok.weight if tied and embed_stage in mine else None
    t_head = tmods[head_stage].head.lm.weight if tied and head_stage in mine else None
    tparams = list({id(p): p for mod in tmods.values() for p in mod.parameters()}.values())
    topt = torch.optim.AdamW(tparams, lr=3e-4, weight_decay=0.1)
    torch_error = None
    tsched = None
    try:
        from torch.distributed.pipelining import PipelineStage as TorchStage
        from torch.distributed.pipelining import schedules as ts

        tstages = [TorchStage(tmods[s], s, n, torch.device("cpu"), group=tgroup) for s in mine]
        tsched = getattr(ts, TORCH_CLASS[name])(tstages[0] if V == 1 else tstages, m, loss_fn=lm_loss)
        placement = getattr(tstages[0], "stage_index_to_group_rank", None)
        if placement is not None and [placement[s] for s in range(n)] != list(topo.stage_rank):
            raise RuntimeError(f"torch places stages on ranks {[placement[s] for s in range(n)]}, "
                               f"pipecore on {list(topo.stage_rank)}")
    except Exception as exc:  # noqa: BLE001
        torch_error = f"{type(exc).__name__}: {exc}"
    torch_error = _first_error(dist, world, torch_error)

    def t_grads(batch, losses=None):
        x, y = batch
        kwargs = {"target": y} if last else {}
        if losses is not None and last:
            kwargs["losses"] = losses
        tsched.step(*((x,) if first else ()), **kwargs)
        # the tie: each copy's gradient becomes the sum of both
        if t_emb is not None and t_head is not None:
            total = t_emb.grad + t_head.grad
            t_emb.grad.copy_(total)
            t_head.grad.copy_(total)
        elif tie_group is not None and (t_emb is not None or t_head is not None):
            dist.all_reduce((t_emb if t_emb is not None else t_head).grad, group=tie_group)
        # global-norm clipping, the tie counted once
        grads = [p.grad for p in tparams if p.grad is not None]
        counted = [p.grad for p in tparams if p.grad is not None and p is not t_head]
        local = (torch.stack([torch.linalg.vector_norm(g.detach(), 2.0) for g in counted]).double().pow(2).sum()
                 if counted else torch.zeros((), dtype=torch.float64)).reshape(1)
        dist.all_reduce(local, group=tgroup)
        total = local[0].sqrt()
        clip = (1.0 / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.detach().mul_(clip.to(g.dtype))
        return total.float()

    def t_update():
        topt.step()
        topt.zero_grad(set_to_none=True)

    # -- the same first step on both: losses, global norms, clipped gradients ------------------
    check = {"pipecore loss": None, "torch loss": None, "pipecore norm": None, "torch norm": None, "grad diff": None}
    plosses: list = []
    check["pipecore norm"] = float(pc_grads(batches[0], plosses))
    if last:
        check["pipecore loss"] = statistics.fmean(float(v.detach()) for v in plosses if v is not None)
    if torch_error is None:
        tlosses: list = []
        try:
            check["torch norm"] = float(t_grads(batches[0], tlosses))
            if last:
                check["torch loss"] = statistics.fmean(float(v.detach()) for v in tlosses)
            worst = 0.0
            for ps, s in zip(sorted(pstages, key=lambda s: s.stage_index), mine):
                tnamed = dict(tmods[s].named_parameters())
                for pname, p in ps.module.named_parameters():
                    want, got = p.grad.double(), tnamed[pname].grad.double()
                    worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
            check["grad diff"] = worst
        except Exception as exc:  # noqa: BLE001
            torch_error = f"{type(exc).__name__}: {exc}"
        torch_error = _first_error(dist, world, torch_error)
    pc_update()
    if torch_error is None:
        t_update()
    else:
        topt.zero_grad(set_to_none=True)
    _say(rank, f"  {name}: first step checked; warming up")

    counters = {"pipecore": 1, "torch": 1}

    def runner(label, grads, update):
        def run():
            grads(batches[counters[label] % len(batches)])
            update()
            counters[label] += 1
        return run

    runners = {"pipecore": runner("pipecore", pc_grads, pc_update)}
    if torch_error is None:
        runners["torch"] = runner("torch", t_grads, t_update)
    for _ in range(warmup):
        for label, run in list(runners.items()):
            failed = _run_steps(label, run, 1, dist, world)
            if failed is not None:
                torch_error = failed
                runners.pop("torch", None)

    import gc

    gc.collect()
    times = {k: [] for k in runners}
    cpu = {k: [] for k in runners}  # this process's CPU time (all its threads) per step
    peak = {k: 0.0 for k in runners}
    growth = {k: 0.0 for k in runners}
    for b in range(blocks):
        for label in list(runners):
            dist.barrier()
            base = _status_mib("VmRSS")
            _reset_peak()
            t0, c0 = time.perf_counter(), time.process_time()
            failed = _run_steps(label, runners[label], steps, dist, world)
            if failed is not None:
                torch_error = f"in block {b}: {failed}"
                for d in (runners, times, cpu, peak, growth):
                    d.pop("torch")
                continue
            dist.barrier()
            times[label].append((time.perf_counter() - t0) / steps)
            cpu[label].append((time.process_time() - c0) / steps)
            hwm = _status_mib("VmHWM")
            peak[label] = max(peak[label], hwm)
            growth[label] = max(growth[label], hwm - base)
        _say(rank, f"  {name}: block {b + 1}/{blocks} done")
    return {"times": times, "cpu": cpu, "peak": peak, "growth": growth, "check": check,
            "torch error": torch_error, "params": sum(p.numel() for p in model.parameters())}


def _run_steps(label: str, run, count: int, dist, world: int) -> str | None:
    """`count` steps of one side. pipecore's errors propagate; torch's are agreed on by every rank
    (the first rank's error, or None), so that all ranks drop the torch side together."""
    failed = None
    try:
        for _ in range(count):
            run()
    except Exception as exc:  # noqa: BLE001
        if label == "pipecore":
            raise
        failed = f"{type(exc).__name__}: {exc}"
    return _first_error(dist, world, failed) if label == "torch" else None


def _first_error(dist, world, error):
    """Every rank learns the first rank's error (or None): all ranks then go on alike."""
    errors = [None] * world
    dist.all_gather_object(errors, error)
    for r, e in enumerate(errors):
        if e is not None:
            return f"rank {r}: {e}"
    return None


def _spawn_checked(name, a, cfg_kw, blocks):
    res = spawn(_rank, a.ranks, name, cfg_kw, a.microbatches, a.rows, a.steps, a.warmup, blocks, a.torch_timeout)
    fatal = [f"rank {r}:\n{x['fatal']}" for r, x in enumerate(res) if "fatal" in x]
    if fatal:
        raise RuntimeError(f"bench/gpt.py {name} failed:\n" + "\n".join(fatal))
    return res


def _per_rank(values) -> str:
    return "/".join(f"{v:.0f}" for v in values)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="*", default=DEFAULT_SCHEDULES, choices=SCHEDULES)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6, help="transformer blocks (a stage needs at least one layer: "
                                                           "blocks + 2 >= the schedule's stages)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=32, help="sequences per step (split into the microbatches)")
    ap.add_argument("--steps", type=int, default=3, help="steps per timed block")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps of each side after the checked first step")
    ap.add_argument("--blocks", type=int, default=4, help="timed blocks of each side, alternating")
    ap.add_argument("--memory-blocks", type=int, default=2,
                    help="blocks of each side, alternating, that measure memory (in ranks spawned for it)")
    ap.add_argument("--torch-timeout", type=float, default=300.0,
                    help="seconds a torch communication may wait before the torch side is reported as failed")
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    if a.memory_blocks < 1:
        ap.error("--memory-blocks must be at least 1")
    if a.rows % a.microbatches:
        ap.error(f"--rows {a.rows} must be a multiple of --microbatches {a.microbatches}")
    cfg_kw = dict(width=a.width, layers=a.layers, heads=a.heads, seq_len=a.seq_len)
    tokens = a.rows * a.seq_len
    rows, checks, errors, plot = [], [], [], {"pipecore": [], "torch.distributed.pipelining": []}
    n_params = None
    t_start = time.perf_counter()
    for name in a.schedules:
        print(f"gpt: {name} on {a.ranks} ranks ...", file=sys.stderr, flush=True)
        res = _spawn_checked(name, a, cfg_kw, a.blocks)  # times and CPU, under glibc's defaults
        with resident_follows_tensors_in_spawned():
            mem = _spawn_checked(name, a, cfg_kw, a.memory_blocks)  # memory
        n_params = res[0]["params"]
        terr = res[0]["torch error"]
        mem_torch = "torch" in mem[0]["peak"]
        if mem[0]["torch error"] and not terr:
            errors.append(f"{name}: torch failed while memory was measured: {mem[0]['torch error']}")
        ms = {k: max(statistics.median(x["times"][k]) for x in res) * 1e3 if k in res[0]["times"] else None
              for k in SIDES}
        tps = {k: tokens / (v / 1e3) if v else None for k, v in ms.items()}
        # CPU time per step, summed over the ranks (each rank's median over blocks)
        cpu = {k: sum(statistics.median(x["cpu"][k]) for x in res) * 1e3 if k in res[0]["cpu"] else None
               for k in SIDES}
        row = [name, ms["pipecore"], tps["pipecore"]]
        if ms["torch"] is not None:
            row += [ms["torch"], tps["torch"], f"{tps['pipecore'] / tps['torch']:.2f}x", cpu["pipecore"], cpu["torch"],
                    f"{cpu['torch'] / cpu['pipecore']:.2f}x"]
        else:
            row += ["failed", "-", "-", cpu["pipecore"], "-", "-"]
        row += [_per_rank(x["peak"]["pipecore"] for x in mem),
                _per_rank(x["peak"]["torch"] for x in mem) if mem_torch else "-",
                _per_rank(x["growth"]["pipecore"] for x in mem),
                _per_rank(x["growth"]["torch"] for x in mem) if mem_torch else "-"]
        rows.append(row)
        plot["pipecore"].append(tps["pipecore"])
        plot["torch.distributed.pipelining"].append(tps["torch"] or 0.0)
        if terr:
            errors.append(f"{name}: torch failed: {terr}")
        c = next((x["check"] for x in res if x["check"]["pipecore loss"] is not None), res[-1]["check"])
        norms = [x["check"] for x in res]
        if c["torch loss"] is not None:
            diff = max((x["grad diff"] for x in norms if x["grad diff"] is not None), default=float("nan"))
            checks.append(f"{name}: first step, same weights and batch: mean loss pipecore {c['pipecore loss']:.6f}"
                          f" torch {c['torch loss']:.6f} (|diff| {abs(c['pipecore loss'] - c['torch loss']):.1e}), "
                          f"global grad norm {norms[0]['pipecore norm']:.6f} vs {norms[0]['torch norm']:.6f}, "
                          f"clipped gradients of every parameter within {diff:.1e} (relative to each tensor's max)")
        else:
            checks.append(f"{name}: first step: pipecore mean loss {c['pipecore loss']:.6f}; torch: no result")
    wall = time.perf_counter() - t_start
    title = (f"GPT {n_params / 1e6:.2f}M params ({a.layers} blocks, width {a.width}, {a.heads} heads, context "
             f"{a.seq_len}), {a.ranks} gloo ranks, {a.microbatches} microbatches, {tokens} tokens/step; step = "
             f"pipeline + tie + clip + AdamW; median of {a.blocks} alternating blocks of {a.steps} steps; "
             f"MiB per rank r0/r1/.. from {a.memory_blocks} more blocks each")
    print(table(["schedule", "pipecore ms", "pipecore tok/s", "torch ms", "torch tok/s", "pipecore/torch",
                 "pipecore CPU ms", "torch CPU ms", "torch/pipecore CPU", "pipecore peak MiB", "torch peak MiB", "pipecore step +MiB", "torch step +MiB"], rows, title))
    for line in checks + errors:
        print(line)
    print(f"wall time {wall:.0f} s")
    if a.plot:
        bar_plot(a.plot, a.schedules, plot, "tokens/s (median)", textwrap.fill(title, 80))


if __name__ == "__main__":
    main()
