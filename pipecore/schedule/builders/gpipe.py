"""GPipe (all forwards, then all backwards) and forward-only inference."""

from pipecore.schedule.action import stage_of
from pipecore.schedule.schedule import Schedule
from pipecore.schedule.topology import Topology
from pipecore.schedule.builders._codes import B, F, code


def build_gpipe(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    m = num_microbatches
    codes = [[code(r, F, mb) for mb in range(m)] + [code(r, B, mb) for mb in range(m)]
             for r in range(num_ranks)]
    return Schedule.from_codes(codes, Topology.loop(num_ranks, num_ranks, m), "gpipe")


def build_forward_only(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    """Forwards only; with several stages per rank, each microbatch goes through a rank's stages
    in order as soon as it arrives (depth first), so later stages start early."""
    m, R, V = num_microbatches, num_ranks, stages_per_rank
    codes = []
    for r in range(R):
        row = []
        for v in range(V):
            row.extend(code(v * R + r, F, mb) for mb in range(m))
        codes.append(row)
    if V > 1:
        codes = [_depth_first(row, R, m) for row in codes]
    return Schedule.from_codes(codes, Topology.loop(R, R * V, m), "forward_only")


def _depth_first(row, R, m):
    # order by when the input is available in unit time: stage s, microbatch mb is ready at s + mb
    from pipecore.schedule.builders._codes import mb_of

    def stage(c):
        return stage_of(c)

    return sorted(row, key=lambda c: (stage(c) + mb_of(c), stage(c)))
