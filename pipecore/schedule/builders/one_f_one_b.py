"""1F1B (PipeDream-flush): warm up with forwards, then alternate one forward and one backward."""

from pipecore.schedule.schedule import Schedule
from pipecore.schedule.topology import Topology
from pipecore.schedule.builders._codes import B, F, code


def build_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    R, m = num_ranks, num_microbatches
    codes = []
    for r in range(R):
        warmup = min(R - 1 - r, m)
        row = [code(r, F, mb) for mb in range(warmup)]
        for mb in range(warmup, m):
            row.append(code(r, F, mb))
            row.append(code(r, B, mb - warmup))
        row.extend(code(r, B, mb) for mb in range(m - warmup, m))
        codes.append(row)
    return Schedule.from_codes(codes, Topology.loop(R, R, m), "1f1b")
