"""torch.distributed.pipelining's own schedules, for side-by-side checks (tests/test_builders.py) and benchmarks.

Builds torch's compute-only action orders without stages or a process group (its builders need
only a few attributes), and runs torch's own lowering passes. Imports torch only when called.
"""

from __future__ import annotations

TORCH_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def torch_build(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> dict:
    """torch's compute-only pipeline order ({rank: [_Action | None]}) for schedule `name`."""
    from torch.distributed.pipelining import schedules as ts

    cls = getattr(ts, TORCH_CLASSES[name])
    obj = object.__new__(cls)
    obj._n_microbatches = num_microbatches
    obj.pp_group_size = num_ranks
    obj.n_local_stages = stages_per_rank
    obj._num_stages = num_ranks * stages_per_rank
    obj.num_stages = num_ranks * stages_per_rank
    obj._stages = [None] * stages_per_rank
    obj.number_of_rounds = max(1, num_microbatches // num_ranks)
    obj.microbatches_per_round = num_microbatches // obj.number_of_rounds
    if name in ("gpipe", "1f1b"):
        return obj._get_pipeline_order()
    order = {r: obj._calculate_single_rank_operations(r) for r in range(num_ranks)}
    if name == "interleaved_zb":
        obj.pipeline_order = order
        order = obj._add_bubbles_to_actions(num_ranks * stages_per_rank)
    return order


def torch_lower(order: dict, name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> dict:
    """torch's lowering of a compute-only order (the passes of its `_prepare_schedule_with_comms`)."""
    from torch.distributed.pipelining import schedules as ts
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    num_stages = num_ranks * stages_per_rank
    style = "v" if name in ("zbv", "dualpipev") else "loop"
    mapping = generate_stage_to_rank_mapping(num_ranks, num_stages, style=style)
    lowered = {}
    for rank, actions in order.items():
        lowered[rank] = ts._add_unshard_reshard(actions)
        lowered[rank] = ts._add_reduce_grad(lowered[rank], num_microbatches)
    return ts._add_send_recv(lowered, stage_to_rank=lambda s: mapping[s], num_stages=num_stages)


def torch_order(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> list[list[str]]:
    """Per-rank compute actions, as strings, of the order torch *runs* for schedule `name`."""
    if name == "1f1b":
        # torch's _get_pipeline_order for 1F1B numbers microbatches wrongly (it is only used for
        # display); its runtime runs min(m, R - r) forwards, then one backward, one forward, ...
        return [_torch_1f1b_runtime(r, num_ranks, num_microbatches) for r in range(num_ranks)]
    order = torch_build(name, num_ranks, num_microbatches, stages_per_rank)
    # torch's orders hold each stage's REDUCE_GRAD, and since 2.15 its WAIT_REDUCE_GRAD
    return [[str(a) for a in order[r] if a is not None and a.computation_type.value not in _REDUCTIONS]
            for r in range(num_ranks)]


_REDUCTIONS = ("REDUCE_GRAD", "WAIT_REDUCE_GRAD")


def _torch_1f1b_runtime(rank: int, num_ranks: int, m: int) -> list[str]:
    warmup = min(m, num_ranks - rank)
    out = [f"{rank}F{i}" for i in range(warmup)]
    f, b = warmup, 0
    while b < m:
        out.append(f"{rank}B{b}")
        b += 1
        if f < m:
            out.append(f"{rank}F{f}")
            f += 1
    return out
