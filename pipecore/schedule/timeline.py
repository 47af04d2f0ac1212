"""Text timelines: a step x rank table, as torch.distributed.pipelining prints schedules."""

from __future__ import annotations

from pipecore.schedule.action import decode
from pipecore.schedule.errors import ScheduleError
from pipecore.schedule.simulate import simulate


def aligned_rows(schedule) -> list[list[str]]:
    """Each rank's actions placed at their unit-time step (every compute action takes one step,
    communication none), so idle steps show as blanks."""
    result = simulate(schedule, {"F": 1, "B": 1, "I": 1, "W": 1})
    rows: list[list[str]] = []
    for r, row in enumerate(result.timeline):
        cells: list[str] = []
        for action, start, _end in row:
            step = int(round(start))
            while len(cells) < step:
                cells.append("")
            cells.append(str(action))
        rows.append(cells)
    return rows


def format_table(schedule, *, aligned: bool = True, steps: range | None = None,
                 highlight: tuple[int, int] | None = None) -> str:
    rows = None
    if aligned and not schedule.is_lowered:  # a lowered program prints in its order, communication included
        try:
            rows = aligned_rows(schedule.compute_only())
        except ScheduleError:
            rows = None  # an invalid schedule still prints, in list order
    if rows is None:
        rows = [[str(decode(c)) for c in row] for row in schedule.codes]
    num_steps = max(map(len, rows), default=0)
    if steps is None:
        steps = range(num_steps)
    width = len(str(max(num_steps - 1, 0)))
    labels = [f"Step {i:0{width}d}" for i in steps]
    headers = [f"Rank {r}" for r in range(len(rows))]
    widths = [max([len(h)] + [len(rows[r][i]) for i in steps if i < len(rows[r])])
              for r, h in enumerate(headers)]
    label_width = max(map(len, labels), default=4)
    out = [" " * (label_width + 2) + " ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for label, i in zip(labels, steps):
        cells = [(rows[r][i] if i < len(rows[r]) else "").ljust(widths[r]) for r in range(len(rows))]
        line = f"{label}: " + " ".join(cells)
        line = line.rstrip()
        if highlight is not None and highlight[1] == i:
            line += f"  <-- rank {highlight[0]}"
        out.append(line)
    return "\n".join(out) + "\n"
