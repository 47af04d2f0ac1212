"""ZB-V (zero bubble, V placement: rank r holds stages r and 2R-1-r).
Zero bubble in steady state when F = I = W."""

from ..schedule import Schedule
from ..topology import Topology
from ._codes import F, I, W, code, mb_of


def build_zbv(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    R, m = num_ranks, num_microbatches
    codes = []
    for r in range(R):
        # plan for at least 2R-1 microbatches (a full pipe), then drop the ones that do not exist
        n = max(2 * R - 1, m)
        s0, s1 = r, 2 * R - 1 - r
        cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
        row = []

        def add(key, stage, kind, mb=None):
            if mb is None:
                mb = cnt[key]
                cnt[key] += 1
            row.append(code(stage, kind, mb))

        for _ in range(2 * (R - r) - 1):
            add("f0", s0, F)
        for _ in range(r):
            add("f1", s1, F)
            add("f0", s0, F)
        for _ in range(R - r):
            add("f1", s1, F)
            b = cnt["b1"]
            add("b1", s1, I)
            add(None, s1, W, b)
        while cnt["f1"] < cnt["f0"] or cnt["f0"] < n:
            if cnt["f0"] < n:
                add("f0", s0, F)
            b = cnt["b0"]
            add("b0", s0, I)
            add(None, s0, W, b)
            add("f1", s1, F)
            b = cnt["b1"]
            add("b1", s1, I)
            add(None, s1, W, b)
        w0, w1 = cnt["b0"], cnt["b1"]
        for _ in range(r):
            add("b0", s0, I)
            add("b1", s1, I)
        for _ in range(R - r):
            add("b0", s0, I)
            add(None, s0, W, w0)
            w0 += 1
        while w1 < cnt["b1"]:
            add(None, s1, W, w1)
            w1 += 1
        while w0 < cnt["b0"]:
            add(None, s0, W, w0)
            w0 += 1
        codes.append([c for c in row if mb_of(c) < m])
    return Schedule._from_codes(codes, Topology.v(R, 2 * R, m), "zbv")
