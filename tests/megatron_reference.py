"""Megatron-core's interleaved 1F1B order, written from megatron/core/pipeline_parallel/schedules.py
(get_schedule_table, get_pp_rank_microbatches, forward_backward_pipelining_with_interleaving) to
check pipecore's builder against: the k-th forward runs table[k], the k-th backward table[k] with
its chunk reversed; warmup, then one forward and one backward per step, then the rest of the
backwards."""


def accepts(R, m, N):
    """Megatron's checks on microbatch_group_size_per_vp_stage."""
    return R <= N <= m and not (0 < m % N < R)


def schedule_table(m, V, N):
    table = []
    for first in range(0, m, N):
        last = m if first + N >= m else first + N
        table += [(mb, chunk) for chunk in range(V) for mb in range(first, last)]
    return table


def rank_order(rank, R, m, V, N):
    """Action strings of `rank` (stage of chunk c on rank r: c * R + r)."""
    total = m * V
    warmup = min((R - rank - 1) * 2 + (V - 1) * N, total)
    table = schedule_table(m, V, N)

    def forward(k):
        mb, chunk = table[k]
        return f"{chunk * R + rank}F{mb}"

    def backward(k):
        mb, chunk = table[k]
        return f"{(V - 1 - chunk) * R + rank}B{mb}"

    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(k + warmup), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order
