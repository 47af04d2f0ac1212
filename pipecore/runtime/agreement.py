"""The agreement protocol: what every rank of a pipeline must agree on before a step runs.

One small all-reduce carries the batch signature (did a first stage's batch change shape?), whether
any rank's step failed, how many ranks train, and the first stages' batch rows (the last stages
weight each microbatch's loss by its share of them when no target tells). The first agreement gathers instead: besides those
it learns group rank 0's nonce (which names the Pipeline's keys in the store) and every rank's
program digest, so ranks built with different schedules, microbatch counts or stage layouts all fail
at once with the same message. A rank whose Pipeline could not be built joins that first agreement
from its constructor with a row that says so (`shares_build_failure`): every rank learns its error
there, and so do the data-parallel replicas, which agree right after their pipeline's first
training agreement.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from pipecore.errors import InputError
from pipecore.executor.comm import Comm
from pipecore.stage.boundary import signature
from pipecore.training.data_parallel import check_groups, tell_replicas

REACH_STEP = "waiting for every rank to reach step()"
# what every rank must agree on before the first step: the first agreement's row holds one digest each
SUMMARY_FIELDS = ("schedule", "microbatches", "stages", "placement", "program")
BUILD_FAILED = 2  # the first agreement's "failed" field of a rank whose Pipeline could not be built


class Agreement:
    def __init__(self, comm: Comm, summary: dict[str, object], ties: int, on_first: Callable[[bool], None], dp=None):
        """`summary`: what must be equal on every rank (SUMMARY_FIELDS), named for the message; `ties`:
        tied weights declared on this rank; `on_first(any_ties)` runs once, at the first agreement, on
        every rank (the tied weights are learnt there); `dp`: the data-parallel replicas (DataParallel)."""
        assert tuple(summary) == SUMMARY_FIELDS, summary
        self.comm = comm
        self.summary = summary
        self._dp = dp
        self._ties = ties
        self._on_first = on_first
        # group rank 0's names the store keys, the same on every rank (a per-process count would differ
        # between ranks that build different numbers of pipelines)
        self._nonce = int.from_bytes(os.urandom(7), "little") if comm.rank == 0 else 0
        self.misbuilt: str | None = None  # why this Pipeline cannot run: every later step says it again

    def __call__(self, local_sig: int, failed: bool, training: bool, what: str = REACH_STEP,
                 batch_rows: int = 0) -> tuple[int, bool, int]:
        """(the batch signature summed over the ranks, whether any rank failed, the rows of the
        batch given to the ranks holding a first stage: `batch_rows` there, 0 elsewhere; 0 if none
        said)."""
        comm = self.comm
        if comm.world == 1:
            agreed = local_sig, failed, batch_rows
        elif comm.uid is None:
            agreed = self._first(local_sig, failed, training, batch_rows)
        else:
            sig, failed, trainers, rows, givers = comm.all_reduce_sum(
                [local_sig, int(failed), int(training), batch_rows, int(batch_rows > 0)], what)
            if 0 < trainers < comm.world:
                raise InputError(f"rank {comm.rank}: {trainers} of the {comm.world} ranks called step() and the "
                                 f"others eval() (this rank: {'step' if training else 'eval'}()): every rank makes "
                                 "the same call")
            agreed = sig, bool(failed), rows // givers if givers else 0
        if training and self._dp is not None and not self._dp.agreed:
            # after the pipeline's own agreement, on every path: the first one of a pipeline is the one
            # collective that a rank whose Pipeline could not be built knows to join
            self._dp.agree()  # eval() exchanges nothing over dp: it may run on some replicas only
        return agreed

    def _first(self, local_sig: int, failed: bool, training: bool, batch_rows: int) -> tuple[int, bool, int]:
        comm = self.comm
        fields = [signature(v) for v in self.summary.values()]
        rows = comm.all_gather(_first_row(local_sig, int(failed), self._nonce, int(training), self._ties, batch_rows,
                                          fields), REACH_STEP)
        if any(r[1] == BUILD_FAILED for r in rows):
            failures = _build_failures(comm, rows, None)
            self._refuse(f"rank {comm.rank}: {failures}", rows, failures)
        any_ties = any(r[4] for r in rows)
        given = [r[5] for r in rows if r[5] > 0]
        rows = [r[:4] + r[6:] for r in rows]
        comm.uid = f"{dist.distributed_c10d._get_process_group_name(comm.group)}/{rows[0][2]:x}"
        if any(r[4:] != rows[0][4:] for r in rows):
            self._refuse(self._mismatch([r[4:] for r in rows]), rows)
        try:  # every rank learns the ties and the copies are made equal, before any forward
            self._on_first(any_ties)
        except InputError as exc:
            self._refuse(str(exc), rows)
        if len({r[3] for r in rows}) > 1:
            calls = ", ".join(f"rank {r} {'step' if row[3] else 'eval'}()" for r, row in enumerate(rows))
            raise InputError(f"rank {comm.rank}: the ranks made different calls ({calls}): every rank makes the same "
                             "call, step() or eval()")
        sig = (sum(r[0] for r in rows) + (1 << 63)) % (1 << 64) - (1 << 63)  # int64 wrap-around, as all_reduce
        return sig, any(r[1] for r in rows), sum(given) // len(given) if given else 0

    def _refuse(self, why: str, rows: list[list[int]], told: str | None = None) -> NoReturn:
        """This Pipeline cannot run: InputError now and at every later step, and the data-parallel
        replicas of a pipeline that trains learn it, or `told` (they wait for it at their agreement)."""
        self.misbuilt = why
        if self._dp is not None and _trains(rows):
            self._dp.agree(failure=told or why)
        raise InputError(why)

    def _mismatch(self, digests: list[list[int]]) -> str:
        """Names the ranks and what differs between their programs (their summaries via the store)."""
        comm = self.comm
        key = f"pipecore/{comm.uid}/program/rank"
        comm.store.set(f"{key}{comm.rank}", json.dumps(self.summary))
        try:
            comm.store.wait([f"{key}{r}" for r in range(comm.world)], timedelta(seconds=min(comm.timeout, 10)))
            theirs = [json.loads(comm.store.get(f"{key}{r}")) for r in range(comm.world)]
        except Exception:  # noqa: BLE001 - the digests still say which ranks differ
            theirs = None
        lines = []
        differ = [len({d[k] for d in digests}) > 1 for k in range(len(self.summary))]
        if any(differ[:-1]):
            differ[-1] = False  # the lowered program differs because of what is named
        for k, name in enumerate(self.summary):
            if name == "program" and differ[k]:
                lines.append("the lowered programs differ (the same schedule built differently: a custom Schedule or "
                             "other builder options)")
            elif differ[k]:
                if theirs is None:
                    groups: dict[int, list[int]] = {}
                    for r, d in enumerate(digests):
                        groups.setdefault(d[k], []).append(r)
                    lines.append(f"{name} differs between ranks {' / '.join(str(g) for g in groups.values())}")
                else:
                    lines.append(f"{name}: " + ", ".join(f"rank {r} {t[name]!r}" for r, t in enumerate(theirs)))
        return (f"rank {comm.rank}: the ranks were built with different pipelines ({'; '.join(lines)}). Build the "
                "same Pipeline on every rank: the same schedule, num_microbatches and number of stages")


def _first_row(local_sig: int, failed: int, nonce: int, training: int, ties: int, batch_rows: int,
               fields: list[int]) -> list[int]:
    """A rank's row of the first agreement (its all-gather): the same length on every rank."""
    assert len(fields) == len(SUMMARY_FIELDS), fields
    return [local_sig, failed, nonce, training, ties, batch_rows, *fields]


def _trains(rows: list[list[int]]) -> bool:
    """Did a rank that built its Pipeline call step() (or did none build one)? Alike on every rank."""
    built = [r for r in rows if r[1] != BUILD_FAILED]
    return any(r[3] for r in built) or not built


def _build_failures(comm: Comm, rows: list[list[int]], mine: str | None) -> str:
    """Every rank of the first agreement learns the errors of the ranks whose rows say that their
    Pipeline could not be built (`mine`: this rank's, if it is one)."""
    texts = comm.gather_objects(mine, "learning why a rank could not build its Pipeline")
    said = "; ".join(t for t, r in zip(texts, rows) if r[1] == BUILD_FAILED and t)
    return (f"{said or 'a rank could not build its Pipeline'}. Fix it there and build the Pipeline again on every "
            "rank: this one cannot run")


def shares_build_failure(where: Callable[..., tuple]):
    """Decorates Pipeline.__init__: where it raises, the rank joins the first agreement of the group the
    arguments name, as a rank whose Pipeline could not be built, so that every rank's first step()
    or eval() raises with its error (and, when they train, the data-parallel replicas' too) instead
    of waiting out the timeout; then the error is raised here as it was. Blocks until the group's
    other ranks reach that agreement (the timeout at most). `where(**arguments)` -> (group, device,
    timeout, dp group or None), raising where the arguments name no one group (the error then stays
    on this rank)."""
    def decorate(init):
        names = list(inspect.signature(init).parameters)[1:]

        @functools.wraps(init)
        def build(self, *args, **kwargs):
            try:
                init(self, *args, **kwargs)
            except Exception as exc:
                _join_as_failed({**dict(zip(names, args)), **kwargs}, exc, where)
                raise
        return build
    return decorate


def _join_as_failed(arguments: dict, error: Exception, where: Callable[..., tuple]) -> None:
    """shares_build_failure's part on the rank that failed: a failed row, its error, its replicas."""
    if not dist.is_initialized():
        return
    try:
        group, device, timeout, dp_group = where(**arguments)
        comm = Comm(group, timeout, device)
    except Exception:  # noqa: BLE001 - no one group: the error stays here
        return
    if comm.world == 1:
        return
    text = f"{comm.who()} could not build its Pipeline: {type(error).__name__}: {error}"
    try:
        rows = comm.all_gather(_first_row(0, BUILD_FAILED, 0, 0, 0, 0, [0] * len(SUMMARY_FIELDS)), REACH_STEP)
        why = _build_failures(comm, rows, text)
        if dp_group is not None and _trains(rows):
            try:
                check_groups(group, dp_group)
            except Exception:  # noqa: BLE001 - not this rank's replicas: none wait for it
                return
            tell_replicas(comm, dp_group, why)
    except Exception as exc:  # noqa: BLE001 - this rank's own error is the one to raise
        error.add_note(f"pipecore: telling the other ranks that this Pipeline could not be built failed: "
                       f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
