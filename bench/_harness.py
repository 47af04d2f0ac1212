"""Shared benchmark plumbing: spawn gloo ranks on this machine, time alternating blocks."""

from __future__ import annotations

import os
import queue
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch.multiprocessing as mp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from pipecore.schedule.output import writable  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, results, backend):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results.put((rank, fn(rank, world, *args)))
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args, backend: str = "gloo"):
    """Run fn(rank, world, *args) on `world` ranks (gloo, or nccl with one GPU per rank); returns the
    per-rank results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results, backend)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    while len(out) < world:
        try:
            rank, value = results.get(timeout=0.5)
        except queue.Empty:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:  # its peers may wait for it forever (a collective, a pipeline message)
                for p in procs:
                    p.terminate()
                raise RuntimeError(f"benchmark ranks {failed} failed (exit codes "
                                   f"{[p.exitcode for p in procs]}); their traceback is above") from None
            continue
        out[rank] = value
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a benchmark rank failed: exit codes {[p.exitcode for p in procs]}")
    return [out[r] for r in range(world)]


def timed_blocks(runners: dict[str, Callable[[], None]], blocks: int, steps: int, barrier: Callable[[], None]):
    """Alternate `steps`-step timed blocks of each runner; per runner, the per-step times."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(blocks):
        for name, run in runners.items():
            barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            barrier()
            times[name].append((time.perf_counter() - t0) / steps)
    return times


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else f"{c:.3g}" if isinstance(c, float) else str(c)
                                             for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(h.rjust(w) for h, w in zip(cells[0], widths)))
    lines.append("  ".join("-" * w for w in widths))
    for r in cells[1:]:
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


def bar_plot(path: str, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    """Grouped bars, one group per label, one bar per series (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels) + 2), 3.8))
    n = len(series)
    width = 0.8 / max(n, 1)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - (n - 1) / 2) * width for x in range(len(labels))], values, width=width, label=name)
    ax.set_xticks(list(range(len(labels))), labels, rotation=15, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(writable(path), dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
