"""Bubble and peak activation memory of every schedule, simulated, for two cost sets.

Prints one row per schedule and stage count per rank: the bubble (idle share of all ranks' time,
1 - work / (ranks x makespan)) and the busiest rank's activation memory as a fraction of 1F1B's,
under each cost set; zb_auto rows are built for each cost set within the memory named in the row.
Costs are those of one rank's share of the model (a stage of 1F1B; a V's stages cost half).
Usage:

    python bench/schedules.py                     # p = 8 and 16, m = 4p
    python bench/schedules.py --ranks 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pipecore.tools.recommend import compare  # noqa: E402

COST_SETS = {
    "F=I=W": {"F": 1, "I": 1, "W": 1},
    "I=1.5F, W=0.5F, comm 0.1F": {"F": 1, "I": 1.5, "W": 0.5, "comm": 0.1},
}
AUTO_MEMORY = (0.5, 1.0, 2.0)  # zb_auto rows: memory allowed, x 1F1B's


def rows_for(R, m, cost_sets):
    """{(label, V): {cost set: (bubble, memory)}} in the order of the first cost set's table."""
    table: dict[tuple[str, int], dict[str, tuple[float, float]]] = {}
    for set_name, costs in cost_sets.items():
        for c in compare(R, m, costs, memory=float("inf"), names=[n for n in _fixed_names()]):
            table.setdefault((c.name, c.stages_per_rank), {})[set_name] = (c.bubble_ratio, c.memory)
        for memory in AUTO_MEMORY:
            for c in compare(R, m, costs, memory=memory, names=["zb_auto"]):
                table.setdefault((f"zb_auto (memory {memory:g})", c.stages_per_rank), {})[set_name] = (
                    c.bubble_ratio, c.memory)
    return table


def _fixed_names():
    from pipecore import SCHEDULES

    return [n for n in SCHEDULES if n not in ("forward_only", "zb_auto")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", nargs="*", type=int, default=[8, 16])
    ap.add_argument("--microbatches", type=int, default=None, help="default 4 x ranks")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    sets = list(COST_SETS)
    print(f"# simulated bubble and memory (x 1F1B's activations); cost sets: {'; '.join(sets)}")
    head = f"{'p':>3}{'m':>5}  {'schedule':<26}{'V':>3}" + "".join(f"{'bubble':>9}{'memory':>8}" for _ in sets)
    print(head)
    print("-" * len(head))
    plot_labels, plot_series = [], {s: [] for s in sets}
    for R in args.ranks:
        m = args.microbatches or 4 * R
        table = rows_for(R, m, COST_SETS)
        order = sorted(table, key=lambda k: (k[0].startswith("zb_auto"), table[k][sets[0]][0]))
        for label, V in order:
            cells = "".join(f"{table[(label, V)][s][0]:>9.4f}{table[(label, V)][s][1]:>8.3f}" if s in table[(label, V)]
                            else f"{'-':>9}{'-':>8}" for s in sets)
            print(f"{R:>3}{m:>5}  {label:<26}{V:>3}{cells}")
            plot_labels.append(f"{label} V{V} p{R}")
            for s in sets:
                plot_series[s].append(table[(label, V)].get(s, (0.0, 0.0))[0])
    if args.plot:
        from _harness import bar_plot

        bar_plot(args.plot, plot_labels, plot_series, "bubble", "simulated bubble per schedule")


if __name__ == "__main__":
    main()
