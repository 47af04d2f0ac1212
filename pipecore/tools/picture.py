"""Picture timelines: one lane per rank, one box per action, colours per kind, bubbles left blank.

Draws a simulated schedule (`SimResult.timeline`), a measured trace (`Pipeline.trace()` of every
rank), or both, one above the other, to PNG or SVG (by the file's extension). Needs matplotlib.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pipecore.schedule.output import writable

COLOURS = {
    "F": "#4C72B0", "B": "#55A868", "I": "#8FD19E", "W": "#DD8452", "OVERLAP_F_B": "#8172B3",
    "SEND_F": "#999999", "RECV_F": "#BBBBBB", "SEND_B": "#999999", "RECV_B": "#BBBBBB",
    "REDUCE_GRAD": "#C44E52", "UNSHARD": "#937860", "RESHARD": "#DA8BC3",
}
_KIND_RE = re.compile(r"(?:PP:)?(?:\(.*\))?\d*([A-Z_]+?)(\d*)$")


def kind_of(name: str) -> str:
    if name.endswith("OVERLAP_F_B"):
        return "OVERLAP_F_B"
    m = _KIND_RE.match(name)
    return m.group(1) if m else "?"


# lanes: per rank, list of (label, start, end)
Lanes = Sequence[Sequence[tuple[str, float, float]]]


def lanes_from_simulation(result) -> list[list[tuple[str, float, float]]]:
    return [[(str(a), s, e) for a, s, e in row] for row in result.timeline]


def lanes_from_trace(events: Sequence[dict], num_ranks: int | None = None) -> list[list[tuple[str, float, float]]]:
    """Measured events of all ranks (dicts with rank, name, start_us, end_us) -> lanes in ms from
    the earliest start. Containers keep their sub-actions out of the lane (they overlap it)."""
    if not events:
        return [[] for _ in range(num_ranks or 0)]
    t0 = min(e["start_us"] for e in events)
    n = num_ranks or (max(e["rank"] for e in events) + 1)
    lanes: list[list[tuple[str, float, float]]] = [[] for _ in range(n)]
    for e in events:
        name = e["name"].removeprefix("PP:")
        lanes[e["rank"]].append((name, (e["start_us"] - t0) / 1e3, (e["end_us"] - t0) / 1e3))
    for lane in lanes:
        lane.sort(key=lambda x: x[1])
    return lanes


def draw(panels: Sequence[tuple[str, Lanes]], path: str, *, unit: str = "time", title: str | None = None,
         show_comm: bool = True) -> str:
    """One panel per (title, lanes), stacked; writes `path` (.png or .svg) and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    num_ranks = max(len(lanes) for _, lanes in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 0.45 * num_ranks * len(panels) + 1.2 * len(panels) + 0.6),
                             squeeze=False)
    used = set()
    for ax, (panel_title, lanes) in zip(axes[:, 0], panels):
        span = max((e for lane in lanes for _, _, e in lane), default=1.0) or 1.0
        for r, lane in enumerate(lanes):
            for label, start, end in lane:
                kind = kind_of(label)
                comm = kind.startswith(("SEND", "RECV"))
                if comm and not show_comm:
                    continue
                width = max(end - start, span * 0.0015)
                height, y = (0.25, r + 0.3) if comm else (0.8, r - 0.4)
                ax.broken_barh([(start, width)], (y, height), facecolors=COLOURS.get(kind, "#CCCCCC"),
                               edgecolor="white", linewidth=0.3)
                used.add(kind)
                if not comm and width > span * 0.012:
                    ax.text(start + width / 2, r, label, ha="center", va="center", fontsize=6, color="white",
                            clip_on=True)
        ax.set_yticks(range(len(lanes)), [f"rank {r}" for r in range(len(lanes))])
        ax.set_ylim(len(lanes) - 0.5, -0.6)
        ax.set_xlim(0, span * 1.01)
        ax.set_xlabel(unit)
        ax.set_title(panel_title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=COLOURS[k], label=k) for k in COLOURS if k in used]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(writable(path), dpi=130)
    plt.close(fig)
    return path


def draw_schedule(schedule, path: str, costs=None, measured: Sequence[dict] | None = None) -> str:
    """The schedule as simulated with `costs` (and, when given, a measured trace beside it)."""
    result = schedule.simulate(costs)
    name = schedule.name or "schedule"
    panels = [(f"{name}: simulated, makespan {result.makespan:.3g}, bubble {100 * result.bubble_ratio:.1f}%",
               lanes_from_simulation(result))]
    if measured is not None:
        lanes = lanes_from_trace(measured, schedule.num_ranks)
        span = max((e for lane in lanes for _, _, e in lane), default=0.0)
        panels.append((f"{name}: measured, {span:.2f} ms", lanes))
    return draw(panels, path, unit="time (cost units)" if measured is None else "time")
