"""CSV in/out in torch.distributed.pipelining's format: one row per rank, one action per cell."""

from __future__ import annotations

import csv
import os

from pipecore.schedule.action import Action, decode
from pipecore.schedule.errors import ScheduleError
from pipecore.schedule.output import writable


def write_csv(schedule, path) -> None:
    with open(writable(path), "w", newline="") as f:
        writer = csv.writer(f)
        for row in schedule.codes:
            writer.writerow([str(decode(c)) for c in row])


def read_csv(path) -> list[list[Action]]:
    """One row of actions per rank, as torch writes them."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"schedule CSV {path!s} does not exist")
    rows: list[list[Action]] = []
    with open(path, newline="") as f:
        for r, cells in enumerate(csv.reader(f)):
            row = []
            for col, cell in enumerate(cells):
                if not cell.strip():
                    continue  # torch writes None as an empty cell
                try:
                    row.append(Action.parse(cell))
                except ScheduleError as exc:
                    raise ScheduleError(f"{path}: row {r + 1} (rank {r}), column {col + 1}: {exc}") from None
            rows.append(row)
    if not rows:
        raise ScheduleError(f"{path}: empty schedule CSV (expected one row per rank)")
    return rows
