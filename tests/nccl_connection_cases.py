"""Cases run on every rank of a gloo pool: the device path on the CPU model of NCCL, whose communicators
connect at their first operation unless connected ahead (csrc/testing/nccl_connections.h)."""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

import pipecore as pc
from shaped_message_cases import LENGTHS, MaskedStage, _difference, batch, steps_for, sum_loss
from said import said


def connections_over_steps(rank: int, world: int, name: str, all_ranks_connected: bool, connect_ahead: bool = True,
                           timeout: float = 60, steps: int = len(LENGTHS), tie: bool = False,
                           exchanges_ahead: bool = True) -> dict:
    """`name` on `world` ranks on the emulated device path, shapes in the messages, the steps of
    shaped_message_cases.LENGTHS (step 2 outgrows every capacity: follow-ups). `all_ranks_connected`: the
    group's communicator connected when the group was made (as with init_process_group(device_id=...));
    `connect_ahead` False: the Pipeline's connecting at its first agreement left out, as before it existed;
    `tie`: the first and last model stages' weights tied; `exchanges_ahead` False: the partners of the ties'
    and dualpipe mirrors' exchanges left out of that connecting, as before they were in it.
    Returns the first failure, the largest gradient difference from one process, the connection counts
    (ahead, inside steps, store operations) after every step, the follow-ups sent, each step's seconds,
    and the c10d timeouts of the channels and of the group."""
    pipe, stages, reference = _emulated_pipeline(rank, world, name, all_ranks_connected, timeout, tie)
    if not connect_ahead:
        pipe.comm.connect = lambda *args: None
    out: dict = {"counts": []}
    exchange_peers = pipe.gradients.exchange_peers  # (the ties' are learnt at the first agreement)
    if not exchanges_ahead:
        pipe.gradients.exchange_peers = lambda: set()
    run_steps(pipe, stages, reference, steps_for(LENGTHS, world)[:steps], out, 8000,
              lambda: out["counts"].append(pipe.executor._connection_counts()))
    out["exchange_peers"] = sorted(exchange_peers())
    out["channel_timeouts"] = [c.options._timeout.total_seconds() for c in pipe.comm.channels]
    out["group_timeout"] = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    return out


def _emulated_pipeline(rank: int, world: int, name: str, all_ranks_connected: bool, timeout: float,
                       tie: bool = False, device: bool = True):
    """MaskedStage's stages of `name` (2 microbatches per rank) on the emulated device path (`device` False: the
    host path), shapes in the messages; with the whole model, for the reference (dualpipe: its mirrors copies of
    the model's stages;
    `tie`: the first and last model stages' weights one tied weight, whose copies of the last model stage start
    off its value: the Pipeline's first agreement makes them equal)."""
    sched = pc.build_schedule(name, world, 2 * world)
    model_stage = sched.topology.model_stage
    torch.manual_seed(0)
    reference = [MaskedStage(m == 0) for m in range(max(model_stage) + 1)]
    if tie:
        reference[-1].lin.weight = reference[0].lin.weight
    model = copy.deepcopy(reference)  # (copied together: a tie stays one Parameter in the model)

    def stage(s):
        module = copy.deepcopy(model[model_stage[s]])
        tied = {"w": module.lin.weight} if tie and model_stage[s] in (0, len(model) - 1) else None
        if tied and model_stage[s] > 0:
            with torch.no_grad():
                module.lin.weight.add_(1.0)
        return pc.PipelineStage(module, s, sched.num_stages, tied=tied)
    stages = [stage(s) for s in sched.rank_stages(rank)]
    pipe = pc.Pipeline(stages, sched, sched.num_microbatches, loss_fn=sum_loss, timeout=timeout)
    if device:
        pipe.executor._emulate_device_comm(all_ranks_connected)
    pipe.executor.set_shapes_travel(True)
    return pipe, stages, reference


def run_steps(pipe, stages, reference, lengths: list[list[int]], out: dict, text_chars: int,
              after_step=lambda: None) -> dict:
    """One step of `pipe` per entry of `lengths` (each microbatch's length) until one fails, into `out`: the
    failure (its first `text_chars` characters), the largest gradient difference from one process
    (`reference`), the follow-ups sent, each step's seconds, then the stream contract's violations.
    `after_step` runs after each step that passed."""
    out.update({"failed": [], "grad": 0.0, "grown": 0, "seconds": []})
    for step, lens in enumerate(lengths):
        data = [batch(step, mb, n) for mb, n in enumerate(lens)]
        started = time.monotonic()
        try:
            pipe.step_microbatches([(x,) for x, _ in data] if pipe.has_first else None,
                                   target_mbs=[y for _, y in data] if pipe.has_last else None,
                                   loss_divisor=float(sum(y.numel() for _, y in data)))
        except (RuntimeError, pc.PeerFailedError) as exc:
            out["failed"].append(f"{step}: {type(exc).__name__}: {said(exc)[:text_chars]}")
            out["seconds"].append(time.monotonic() - started)
            break
        out["seconds"].append(time.monotonic() - started)
        after_step()
        out["grown"] += pipe.executor.message_counts[2]
        out["grad"] = max(out["grad"], _difference(stages, reference, data, pipe.schedule.topology.model_stage))
    out["violations"] = pipe.executor._stream_violations()
    return out


def channels_end_with_the_world(rank: int, world: int, port: int) -> dict:
    """A Pipeline on the emulated device path (its follow-up channels open), one step, then
    `destroy_process_group()`: which channels were shut down, and whether the Comm still lists any. The
    default group is made again on `port` afterwards, for the pool."""
    pipe, stages, reference = _emulated_pipeline(rank, world, "1f1b", False, 60)
    out: dict = {}
    run_steps(pipe, stages, reference, steps_for(LENGTHS, world)[:1], out, 900, lambda: None)
    assert not out["failed"], out

    class Recorder:  # (gloo's shutdown changes nothing one can see: the call itself is recorded)
        def __init__(self, channel):
            self.channel, self.ended = channel, False

        def shutdown(self):
            self.ended = True
            self.channel.shutdown()

    recorders = [Recorder(c) for c in pipe.comm.channels]
    pipe.comm.channels = list(recorders)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return {"opened": len(recorders), "ended": sum(r.ended for r in recorders), "listed": len(pipe.comm.channels),
            "c10d_finalises": isinstance(getattr(dist.distributed_c10d._world, "comms", None), list)}


def exchange_times_out(rank: int, world: int, device: bool) -> dict:
    """dualpipe on 2 ranks (its mirrors' gradients exchanged after each step), `timeout` 3 s, rank 1 entering
    that exchange 6 s late; `device`: on the emulated device path. What each rank's step raised, after how
    long, and whether its group is broken."""
    pipe, _, _ = _emulated_pipeline(rank, world, "dualpipe", True, 3, device=device)
    if rank == 1:
        sum_mirrors = pipe.gradients._sum_mirrors

        def late():
            time.sleep(6)
            sum_mirrors()
        pipe.gradients._sum_mirrors = late
    data = [batch(0, mb, 3) for mb in range(pipe.num_microbatches)]
    started = time.monotonic()
    try:
        pipe.step_microbatches([(x,) for x, _ in data] if pipe.has_first else None,
                               target_mbs=[y for _, y in data] if pipe.has_last else None)
        raised = ""
    except Exception as exc:  # noqa: BLE001 - the case reports it
        raised = f"{type(exc).__name__}: {exc}"
    return {"raised": raised, "seconds": time.monotonic() - started, "broken": pipe.comm.broken is not None}
