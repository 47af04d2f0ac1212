"""ZB-V (zero bubble, V placement: rank r holds stages r and 2R-1-r).
Zero bubble in steady state when F = I = W."""

from pipecore.schedule.action import MB_SHIFT, STAGE_SHIFT
from pipecore.schedule.schedule import Schedule
from pipecore.schedule.topology import Topology
from pipecore.schedule.builders._codes import F, I, W


def build_zbv(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    R, m = num_ranks, num_microbatches
    one = 1 << MB_SHIFT  # microbatch k of an action is (k + 1) * one above its base code
    codes = []
    for r in range(R):
        # plan for at least 2R-1 microbatches (a full pipe), then drop the ones that do not exist
        n = max(2 * R - 1, m)
        s0, s1 = r, 2 * R - 1 - r
        f0, i0, w0_ = (k | (s0 << STAGE_SHIFT) for k in (F, I, W))
        f1, i1, w1_ = (k | (s1 << STAGE_SHIFT) for k in (F, I, W))
        nf0 = nf1 = nb0 = nb1 = 0  # forwards / input-gradient backwards issued per stage
        row = []
        add = row.append
        for _ in range(2 * (R - r) - 1):
            nf0 += 1
            add(f0 + nf0 * one)
        for _ in range(r):
            nf1 += 1
            add(f1 + nf1 * one)
            nf0 += 1
            add(f0 + nf0 * one)
        for _ in range(R - r):
            nf1 += 1
            nb1 += 1
            add(f1 + nf1 * one)
            add(i1 + nb1 * one)
            add(w1_ + nb1 * one)
        while nf1 < nf0 or nf0 < n:
            if nf0 < n:
                nf0 += 1
                add(f0 + nf0 * one)
            nb0 += 1
            add(i0 + nb0 * one)
            add(w0_ + nb0 * one)
            nf1 += 1
            nb1 += 1
            add(f1 + nf1 * one)
            add(i1 + nb1 * one)
            add(w1_ + nb1 * one)
        w0, w1 = nb0, nb1  # weight gradients issued per stage
        for _ in range(r):
            nb0 += 1
            add(i0 + nb0 * one)
            nb1 += 1
            add(i1 + nb1 * one)
        for _ in range(R - r):
            nb0 += 1
            add(i0 + nb0 * one)
            w0 += 1
            add(w0_ + w0 * one)
        while w1 < nb1:
            w1 += 1
            add(w1_ + w1 * one)
        while w0 < nb0:
            w0 += 1
            add(w0_ + w0 * one)
        limit = (m + 1) * one  # microbatch index < m
        codes.append([c for c in row if c < limit])
    return Schedule.from_codes(codes, Topology.v(R, 2 * R, m), "zbv")
