"""Train a small GPT on Python's own source code with pipecore: real pipeline-parallel training.

    torchrun --nproc-per-node 4 examples/train_gpt.py --schedule interleaved_1f1b --stages-per-rank 2
    python examples/train_gpt.py --ranks 4          # the same: starts torchrun itself
    python examples/train_gpt.py --ranks 4 --dp 2   # 2 data-parallel replicas of a 2-rank pipeline

One process per rank: gloo on CPUs, or NCCL with one GPU per rank when CUDA is there (device from
LOCAL_RANK; `--cpu` forces gloo). Each rank builds the model (examples/gpt.py), keeps its stages
(`pc.partition`, the LM head tied to the embedding across stages) and trains them with AdamW and
global-norm clipping (`pc.clip_grad_norm_`). It prints a progress line per step, checks its first
steps against single-process training of the same model, compares the measured bubble of a traced
step with the simulator's prediction, draws that step's timeline, can save and resume checkpoints
(`pc.save_checkpoint`), and ends with text sampled from the trained model.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pipecore as pc  # noqa: E402
from pipecore.tools.profiling import draw_trace, gather_trace  # noqa: E402
from first_failure import FirstFailure  # noqa: E402
from gpt import (GPTConfig, build_gpt, get_batch, lm_loss, pipeline_stages, relative_difference,  # noqa: E402
                 stdlib_bytes)

COMPUTE = ("F", "B", "I", "W")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default="interleaved_1f1b", choices=[s for s in pc.SCHEDULES if s != "forward_only"])
    ap.add_argument("--ranks", type=int, default=4, help="processes to start when not launched by torchrun")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (ranks = dp x pp)")
    ap.add_argument("--stages-per-rank", type=int, default=None)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=32, help="sequences per step (the batch)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6, help="transformer blocks")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    ap.add_argument("--partition", default="parameters", choices=["uniform", "parameters"])
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast in every stage")
    ap.add_argument("--checkpoint-activations", action="store_true", help="recompute each stage's forward in backward")
    ap.add_argument("--checkpoint-dir", default=None, help="save model and optimizer state here (torch DCP)")
    ap.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: at the end only)")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    ap.add_argument("--check-steps", type=int, default=3, help="steps compared with single-process training (0: none)")
    ap.add_argument("--timeline", default="gpt_timeline.png", help="picture of the last step's trace ('' to skip)")
    ap.add_argument("--losses-file", default=None,
                    help="write each step's mean loss there, exactly (float.hex, one per line; rank 0)")
    ap.add_argument("--sample-tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPUs even when CUDA is available")
    ap.add_argument("--lazy-group", action="store_true",
                    help='on GPUs: init_process_group("cpu:gloo,cuda:nccl") without device_id, whose NCCL '
                         "communicator connects at its first use (pipecore connects it before the first step)")
    args = ap.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        ap.error("--resume needs --checkpoint-dir")
    if args.rows % args.microbatches:
        ap.error(f"--rows {args.rows} must be a multiple of --microbatches {args.microbatches}")
    return args


def launch(args: argparse.Namespace) -> int:
    """Not started by torchrun: start it, one process per rank on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
           os.path.abspath(__file__), *sys.argv[1:]]
    print("launching:", " ".join(cmd[2:]), flush=True)
    return subprocess.call(cmd)


def setup(args) -> torch.device:
    local, ranks_here = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not args.cpu else 0
    if 0 < gpus < ranks_here and local == 0:
        print(f"{ranks_here} ranks on this machine but {gpus} GPUs: gloo on the CPUs", flush=True)
    if gpus >= ranks_here:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        if args.lazy_group:
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        # the machine's cores shared between the ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
        dist.init_process_group("gloo")
    return device


def say(*a) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)


def all_max(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        sys.exit(launch(args))
    watch = FirstFailure()  # one rank's error named on every rank (examples/first_failure.py)
    try:
        device = setup(args)
        train(args, device)
        dist.barrier()  # a rank that fails after the last collective stops the others here
    except Exception as error:  # noqa: BLE001 - every rank names the first error, then exits
        watch.failed(error)
    watch.close()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    world = dist.get_world_size()
    if world % args.dp or args.rows % (args.dp * args.microbatches):
        raise SystemExit(f"--dp {args.dp} must divide the {world} ranks, and dp x microbatches the {args.rows} rows")
    mesh = pc.init_mesh(dp=args.dp, pp=world // args.dp)
    rank, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")  # position in the pipeline, replica
    sched = pc.build_schedule(args.schedule, world // args.dp, args.microbatches, args.stages_per_rank)
    cfg = GPTConfig(seq_len=args.seq_len, width=args.width, heads=args.heads, layers=args.layers, dropout=args.dropout)
    model = build_gpt(cfg, seed=args.seed)
    options = dict(activation_checkpointing=args.checkpoint_activations,
                   autocast=torch.bfloat16 if args.bf16 else None)
    stages = pipeline_stages(model, sched, rank, method=args.partition, device=device, verbose=rank == 0, **options)
    pipe = pc.Pipeline(stages, sched, args.microbatches, loss_fn=lm_loss, trace=True, group=mesh.get_group("pp"),
                       dp_group=mesh.get_group("dp") if args.dp > 1 else None)
    params = pipe.parameters()
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = stdlib_bytes()
    n_params = sum(p.numel() for p in model.parameters())
    say(f"pipecore: GPT of {n_params:,} parameters ({cfg.layers} blocks, width {cfg.width}, {cfg.heads} heads, "
        f"context {cfg.seq_len}) on {world} ranks ({device.type}"
        f"{f', {args.dp} data-parallel replicas of {world // args.dp}' if args.dp > 1 else ''}), schedule {args.schedule}, "
        f"{sched.num_stages} stages, {args.microbatches} microbatches of {args.rows // args.dp // args.microbatches} "
        f"sequences{' per replica' if args.dp > 1 else ''}; "
        f"text: {data.numel():,} bytes of Python's standard library")

    start = 0
    if args.resume:
        extra = pc.load_checkpoint(args.checkpoint_dir, pipe, opt)
        start = int(extra["step"])
        say(f"resumed from {args.checkpoint_dir} at step {start}")
    check = args.check_steps if start == 0 else 0
    reference = copy.deepcopy(model).to(device) if check else None
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1) \
        if check else None
    del model

    times: list[float] = []
    for step in range(start, args.steps):
        x, y = (t.to(device) for t in get_batch(data, step, args.rows, cfg.seq_len, seed=args.seed))
        mine_x, mine_y = x.chunk(args.dp)[replica], y.chunk(args.dp)[replica]  # this replica's share
        losses: list = []
        t0 = time.perf_counter()
        pipe.step(*((mine_x,) if pipe.has_first else ()), target=mine_y if pipe.has_last else None, losses=losses)
        norm = pc.clip_grad_norm_(pipe, args.clip)
        if step - start < check:
            grad_diff = compare_step(reference, ref_opt, stages, x, y, args, options)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        mine = [float(v) for v in losses if v is not None]
        total = torch.tensor([sum(mine), len(mine)], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        progress(step, args, float(total[0] / total[1]), float(norm), times[-1])
        if args.losses_file and dist.get_rank() == 0:
            with open(args.losses_file, "a") as f:
                f.write(float(total[0] / total[1]).hex() + "\n")
        if step - start < check:
            worst = all_max(grad_diff, device)
            say(f"      vs one process: gradients of step {step} within {worst:.1e} (relative to each tensor's largest)")
        if step - start == check - 1:
            weights = all_max(max(relative_difference(p, reference.get_parameter(n)) for s in stages
                                  for n, p in s.module.named_parameters()), device)
            say(f"      vs one process: weights after {check} AdamW steps within {weights:.1e}")
        if args.checkpoint_dir and args.save_every and (step + 1) % args.save_every == 0:
            pc.save_checkpoint(args.checkpoint_dir, pipe, opt, extra={"step": step + 1})
            say(f"      saved {args.checkpoint_dir} (step {step + 1})")
    if times:
        median = statistics.median(times[1:] or times)
        say(f"median step {median * 1e3:.1f} ms, {args.rows * cfg.seq_len / median:,.0f} tokens/s "
            "(the first step also learns what crosses each stage boundary)")
        bubble(pipe, sched, args)
    if args.checkpoint_dir:
        pc.save_checkpoint(args.checkpoint_dir, pipe, opt, extra={"step": args.steps})
        say(f"checkpoint: {args.checkpoint_dir} (step {args.steps}); continue with --resume --steps N")
    if args.sample_tokens:
        sample(pipe, stages, sched, data, cfg, args, device)


def progress(step: int, args, loss: float, norm: float, seconds: float) -> None:
    done = (step + 1) / args.steps
    bar = "#" * round(20 * done) + "." * (20 - round(20 * done))
    say(f"[{bar}] step {step + 1:3d}/{args.steps}  loss {loss:.4f}  grad norm {norm:6.3f}  "
        f"{args.rows * args.seq_len / seconds:8,.0f} tokens/s  {seconds * 1e3:7.1f} ms")


def compare_step(reference, ref_opt, stages, x, y, args, options) -> float:
    """The same step in one process on the whole batch; the largest relative difference between its
    gradients (clipped alike) and those of this rank's stages. Steps the reference's optimizer."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=options["autocast"] is not None):
        loss = lm_loss(reference(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), args.clip)
    worst = max(relative_difference(p.grad, reference.get_parameter(n).grad) for s in stages
                for n, p in s.module.named_parameters())
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    return worst


def bubble(pipe, sched, args) -> None:
    """The last step's measured idle share next to the simulator's, priced with that step's median
    action times, and its timeline picture."""
    events = gather_trace(pipe)
    if dist.get_rank() != 0:
        return
    events = [e for e in events if e["name"].startswith("PP:")]  # the actions (not the dp buckets)
    durations: dict[str, list[float]] = {}
    for e in events:
        kind = pc.Action.parse(e["name"].removeprefix("PP:")).kind.name
        durations.setdefault(kind, []).append((e["end_us"] - e["start_us"]) / 1e3)
    costs = {k: statistics.median(v) for k, v in durations.items() if k in COMPUTE}
    start = min(e["start_us"] for e in events)
    span = (max(e["end_us"] for e in events) - start) / 1e3
    busy = sum(sum(v) for k, v in durations.items() if k in COMPUTE)
    measured = 1 - busy / (sched.num_ranks * span)
    predicted = sched.simulate({**costs, "comm": 0}).bubble_ratio
    say(f"bubble of the last step: measured {measured:.1%} of {sched.num_ranks} ranks x {span:.1f} ms, simulated "
        f"{predicted:.1%} (the schedule priced with this step's median action times {fmt(costs)}, no transfer "
        "time: the difference is communication and host time between actions)")
    cores = os.cpu_count() or 1
    if int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > cores:
        say(f"      ({os.environ['LOCAL_WORLD_SIZE']} ranks share {cores} cores here: an action's measured time includes "
            "waiting for a core, which makes the ranks look busier than they are)")
    if args.timeline:
        path = draw_trace(events, args.timeline, schedule=sched, costs={**costs, "comm": 0})
        say(f"timeline of that step (simulated above, measured below): {os.path.abspath(path)}")


def fmt(costs: dict) -> str:
    return ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(costs.items()))


def sample(pipe, stages, sched, data, cfg, args, device) -> None:
    """Text from the trained model: the pipeline's forward (eval) over a sliding window, one byte at a
    time, sampled on the rank whose output holds microbatch 0 and shared with every rank."""
    topo = sched.topology
    last = next(s for s in range(sched.num_stages) if topo.next_stage[s] < 0 and 0 in topo.microbatches[s])
    source = topo.stage_rank[last]
    prompt_at = bytes(data[:200_000].tolist()).find(b"\ndef ")
    window = data[prompt_at:prompt_at + cfg.seq_len].to(device).repeat(args.microbatches, 1)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for s in stages:
        s.module.eval()
    made = []
    token = torch.zeros(1, dtype=torch.long, device=device)
    for _ in range(args.sample_tokens):
        out = pipe.eval(*((window,) if pipe.has_first else ()))
        if dist.get_rank() == source:
            probs = torch.softmax(out[0, -1].float() / 0.8, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
        dist.broadcast(token, src=source)
        made.append(int(token))
        window = torch.cat([window[:, 1:], token.view(1, 1).expand(window.shape[0], 1)], dim=1)
    for s in stages:
        s.module.train()
    prompt = bytes(data[prompt_at:prompt_at + cfg.seq_len].tolist()).decode("utf-8", errors="replace")
    say("sample (the prompt, then what the model wrote):\n" + prompt + "\u2502" + bytes(made).decode("utf-8", "replace"))


if __name__ == "__main__":
    main()
