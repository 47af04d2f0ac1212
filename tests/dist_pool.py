"""A pool of gloo ranks (spawned once per world size) that runs test cases on every rank, and
`run_fresh` for a case that needs processes of its own.

Each case is a module-level function `fn(rank, world, *args)` run on all ranks at once; the pool
returns the per-rank results or raises with every failing rank's traceback. A case that does not
finish within its timeout tears the pool down (the next case gets a fresh one).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context(spawn: bool = False):
    """Ranks forked from multiprocessing's fork server, which imported torch and pipecore once: a rank starts in
    a fraction of a second, not the 2.3 s a spawned one spends importing them again, and is still a process of
    its own (nothing it does reaches the server or other ranks). Only those two are imported there: a module
    imported before a case's patch (TorchTitan's, after patch_torch_pipelining) would keep torch's names.
    The server's environment is this process's when it started: `spawn` for ranks that must see the
    environment as it is now."""
    if spawn:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "pipecore"])
    return ctx


def write_coverage():
    """A coverage build (`make coverage`): this process's line counts go to their files now."""
    from pipecore.executor.native import C

    if hasattr(C, "_write_coverage"):
        C._write_coverage()


def _worker(rank, world, port, tasks, results):
    import faulthandler
    import signal

    import torch
    import torch.distributed as dist

    from exactness import use_exact_dtype

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a case that hangs: where each thread is

    use_exact_dtype()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    while True:
        item = tasks.get()
        if item is None:
            break
        case_id, fn, args = item
        try:
            result = (case_id, rank, True, fn(rank, world, *args))
        except BaseException:  # report everything, keep serving
            result = (case_id, rank, False, traceback.format_exc())
        write_coverage()  # (a pool that outlives its case's timeout is killed)
        results.put(result)
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int, spawn: bool = False):
        """`spawn`: new interpreters, which see this process's environment as it is now (`_context`)."""
        self.world = world
        ctx = _context(spawn)
        port = free_port()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.case = 0
        self.broken = False

    def run(self, fn, *args, timeout: float = 120.0, allow_dead: bool = False):
        """fn(rank, world, *args) on every rank. With allow_dead, a rank whose process dies counts
        as a result of None (and the pool is rebuilt for the next case)."""
        import time

        self.case += 1
        for q in self.tasks:
            q.put((self.case, fn, args))
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world:
            try:
                case_id, rank, ok, value = self.results.get(timeout=0.25)
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if not p.is_alive() and r not in out and r not in errors:
                        self.broken = True
                        if allow_dead:
                            out[r] = None
                        else:
                            errors[r] = f"process died with exit code {p.exitcode}"
                if time.monotonic() > deadline:
                    self.broken = True
                    missing = sorted(set(range(self.world)) - set(out) - set(errors))
                    for r in missing:  # their stacks, on the test's captured stderr
                        os.kill(self.procs[r].pid, signal.SIGUSR1)
                    time.sleep(1.0)
                    raise AssertionError(f"ranks {missing} did not finish within {timeout}s; errors so far: {errors}")
                continue
            if case_id != self.case:
                continue  # a late answer of an earlier, failed case
            (out if ok else errors)[rank] = value
        if errors:
            raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return [out[r] for r in range(self.world)]

    def ask_to_leave(self):
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:
                pass

    def end(self, deadline: float):
        """The ranks that have not left by `deadline` (time.monotonic()) are killed."""
        import time

        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()

    def close(self):
        """Ends the ranks: asked to leave, given 5 s; at once where the pool is broken (a rank stuck in a
        broken group never reads the request; each case wrote its coverage counts)."""
        _close([self])


def _fresh_worker(rank, world, port, timeout, fn, args, out_path):
    import datetime
    import os

    import torch
    import torch.distributed as dist

    from exactness import use_exact_dtype

    use_exact_dtype()
    torch.set_num_threads(1)
    try:
        # collectives time out before the parent's deadline, so that a rank hung in one reports where
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=0.8 * timeout))
        result = (True, fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the test
        result = (False, traceback.format_exc())
    torch.save(result, out_path)
    write_coverage()
    os._exit(0)  # no teardown: a failed peer could block it; the peers see this process end


def run_fresh(world: int, fn, *args, timeout: float = 180.0):
    """fn(rank, world, *args) on `world` new processes (gloo, a free port), for a case that changes its
    process for good (pipecore.compat.patch_torch_pipelining, TorchTitan's module state). Returns the
    per-rank results, or raises with every failing rank's traceback."""
    import tempfile
    import time

    import torch

    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        outs = [os.path.join(folder, f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=_fresh_worker, args=(r, world, port, timeout, fn, args, outs[r]))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        late = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        got = [torch.load(o, weights_only=False) if os.path.exists(o) else None for o in outs]
    errors = {r: (f"did not finish within {timeout} s" if r in late else "died without a result") if g is None
              else g[1] for r, g in enumerate(got) if g is None or not g[0]}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [g[1] for g in got]


_POOLS: dict[int, RankPool] = {}


def pool(world: int) -> RankPool:
    p = _POOLS.get(world)
    if p is None or p.broken or not all(proc.is_alive() for proc in p.procs):
        if p is not None:
            p.close()
        p = _POOLS[world] = RankPool(world)
    return p


def _close(pools: list[RankPool]):
    """`pools` asked to leave at once and given 5 s in all (RankPool.close says why a broken one gets none)."""
    import time

    for p in pools:
        if not p.broken:
            p.ask_to_leave()
    now = time.monotonic()
    for p in pools:
        p.end(now + (0 if p.broken else 5))


def close_all():
    """Every pool asked to leave at once, given 5 s in all."""
    _close(list(_POOLS.values()))
    _POOLS.clear()


def fresh_pool(world: int) -> RankPool:
    """A pool of new processes for one test (close it after): cases that must not inherit a
    process's earlier state, like a Pipeline's first step on a fresh group."""
    return RankPool(world)
