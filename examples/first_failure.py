"""One rank's error, named in every rank's output (used by examples/train_gpt.py under torchrun).

When one rank fails, torchrun stops every other rank, and a rank blocked in a collective with it dies of
gloo's "Connection closed by peer" (NCCL: a timeout): a wall of tracebacks that hides the error that came
first. Here the first rank to fail posts its error in torchrun's store. A thread on every rank watches
that store, so the other ranks print that error within a fraction of a second, wherever they are blocked.
Every rank leaves once all have printed: torchrun stops the rest as soon as one exits, so no rank may leave
before the others said they stopped (each under a key of its own), or 10 s passed (a rank that cannot
print at all, say one stuck in a call that holds the GIL).

    watch = FirstFailure()            # after torchrun started this process
    try:
        train()
        dist.barrier()                # a rank that fails after the last collective stops the others here
    except Exception as error:
        watch.failed(error)           # does not return
    watch.close()
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

import pipecore as pc

# errors that follow from another rank's failure: they wait for that rank's error before posting their own
DERIVED = (pc.PeerFailedError, pc.CommunicationError)


def say(line: str) -> None:
    """One line on stderr, in one write. The ranks print at once into one pipe, and print() writes a line
    and its newline apart where Python runs unbuffered (PYTHONUNBUFFERED=1, common in containers and
    CI): another rank's line then lands between them, in the middle of this one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class FirstFailure:
    def __init__(self, poll_seconds: float = 0.2, wait_seconds: float = 10.0, derived_seconds: float = 5.0):
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.error_key, self.stopped_prefix = f"first_failure/{run}/error", f"first_failure/{run}/stopped/"
        # wait: for every rank to say it stopped; derived: for the error a derived one follows from
        self.poll, self.wait, self.derived_wait = poll_seconds, wait_seconds, derived_seconds
        # clients of their own on torchrun's store (MASTER_ADDR:MASTER_PORT): the process group's client is
        # shared with the Pipeline, and the watching thread must not hold it
        self.store, watch_store = (dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                 is_master=False, timeout=timedelta(seconds=30)) for _ in range(2))
        self.done = threading.Event()
        self.watcher = threading.Thread(target=self._watch, args=(watch_store,), daemon=True, name="first-failure")
        self.watcher.start()

    def close(self) -> None:
        """Training ended well on this rank: stop watching (and nobody waits for this rank to say it
        stopped)."""
        self._stop_watching()
        try:
            self.store.set(f"{self.stopped_prefix}{self.rank}", "ended")
        except Exception:  # noqa: BLE001 - torchrun's store is gone
            pass

    def failed(self, error: Exception) -> None:
        """This rank's error: name the first error of the run on this rank's output, then exit(1)."""
        self._stop_watching()
        mine = f"rank {self.rank} failed: {type(error).__name__}: {error}"
        derived = isinstance(error, DERIVED) or "Connection closed by peer" in str(error)
        first = self._first(mine, wait=self.derived_wait if derived else 0.0)
        if first == mine:
            traceback.print_exception(error)
            say(f"[rank {self.rank}] {mine}")
            missing = self._wait_for_the_others(self.store)
            if missing:
                say(f"[rank {self.rank}] not every rank said it stopped within {self.wait:.0f} s: not {missing}")
        else:
            if not derived:  # an error of its own beside the first one: show it too
                traceback.print_exception(error)
            own = f"{type(error).__name__}: {error}".splitlines()[0][:100]
            say(f"[rank {self.rank}] stopped: {first} (here: {own})")
            self._stopped(self.store, first)
        sys.exit(1)

    def _stop_watching(self) -> None:
        """The watching thread ended before this rank leaves. A daemon thread still inside a store call when
        the interpreter exits aborts the process ("terminate called without an active exception", exit
        code -6: Python 3.11 ends such a thread by unwinding it through pybind11's GIL release, which must
        not throw), which failed 1 in about 10 demos here. The join lasts one poll and one store call (if
        the thread found another rank's error meanwhile, it ends this process itself)."""
        self.done.set()
        self.watcher.join()

    def _first(self, mine: str, wait: float) -> str:
        """The run's first error: another rank's if posted (within `wait` seconds), else this one's."""
        try:
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and not self.store.check([self.error_key]):
                time.sleep(self.poll / 4)
            return self.store.compare_set(self.error_key, "", mine).decode()
        except Exception:  # noqa: BLE001 - torchrun's store is gone: say what this rank knows
            return mine

    def _wait_for_the_others(self, store, first: str | None = None) -> list[int]:
        """Waits (`wait` seconds at most) until every rank but the first (this one, when `first` is None)
        said it stopped; returns those that did not."""
        found = re.match(r"rank (\d+) failed", first or "")
        first_rank = int(found.group(1)) if found else self.rank
        keys = {r: f"{self.stopped_prefix}{r}" for r in range(self.world) if r != first_rank}
        deadline = time.monotonic() + self.wait
        try:
            while not store.check(list(keys.values())):  # one request for all of them
                if time.monotonic() > deadline:
                    return [r for r, key in keys.items() if not store.check([key])]
                time.sleep(self.poll / 4)
        except Exception:  # noqa: BLE001 - torchrun's store is gone: nobody left to wait for
            pass
        return []

    def _stopped(self, store, first: str) -> None:
        """This rank said it stopped (a key of its own: saying it twice counts once); it leaves once
        every other rank has too."""
        try:
            store.set(f"{self.stopped_prefix}{self.rank}", "1")
        except Exception:  # noqa: BLE001 - torchrun's store is gone
            return
        self._wait_for_the_others(store, first)

    def _watch(self, store) -> None:
        """Another rank's error ends this rank at once, wherever its main thread is blocked."""
        while not self.done.wait(self.poll):
            try:
                if not store.check([self.error_key]):
                    continue
                first = store.get(self.error_key).decode()
            except Exception:  # noqa: BLE001 - a store call that failed once: watch on (torchrun ends this
                continue  # process if its store is gone for good)
            if self.done.is_set() or first.startswith(f"rank {self.rank} "):
                return  # this rank's main thread is reporting
            say(f"[rank {self.rank}] stopped: {first}")
            try:
                self._stopped(store, first)
            finally:
                os._exit(1)
