"""The agreement protocol: what every rank of a pipeline must agree on before a step runs.

One small all-reduce carries the batch signature (did a first stage's batch change shape?), whether
any rank's step failed, how many ranks train, and the first stages' batch rows (the last stages
weight each microbatch's loss by its share of them when no target tells). The first agreement
gathers instead: besides those it learns group rank 0's nonce (which names the Pipeline's keys in
the store) and every rank's program digest, so ranks built with different schedules, microbatch
counts or stage layouts all fail at once with the same message. Before it, the ranks meet through the store (`Comm.meet`): a rank
whose Pipeline could not be built leaves its error there from its constructor (`shares_build_failure`)
and never joins a collective, and every rank's first step raises with that error; the data-parallel
replicas, which agree right after their pipeline's first training agreement, learn it the same way.
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
from pipecore.executor.comm import Comm, cannot_meet, who
from pipecore.stage.boundary import signature
from pipecore.stage.pipeline_stage import PipelineStage, pipeline_group, stage_list
from pipecore.training.data_parallel import DataParallel, check_groups
from pipecore.training.wrapped_stages import WrappedStage

REACH_STEP = "waiting for every rank to reach step()"


class Agreement:
    def __init__(self, comm: Comm, summary: dict[str, object], ties: int, on_first: Callable[[bool], None], dp=None):
        """`summary`: what must be equal on every rank (schedule, microbatches, stages, placement,
        program), named for the message; `ties`: tied weights declared on this rank; `on_first(any_ties)`
        runs once, at the first agreement, on every rank (the tied weights are learnt there); `dp`: the
        data-parallel replicas (DataParallel)."""
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
                raise InputError(f"{comm.who}: {trainers} of the {comm.world} ranks called step() and the "
                                 f"others eval() (this rank: {'step' if training else 'eval'}()): every rank makes "
                                 "the same call")
            agreed = sig, bool(failed), rows // givers if givers else 0
        if training and self._dp is not None and not self._dp.agreed:
            # after the pipeline's own agreement, on every path: a pipeline that cannot run has told its
            # replicas by then (Agreement._refuse), so they learn it at this one's meeting point
            self._dp.agree()  # eval() exchanges nothing over dp: it may run on some replicas only
        return agreed

    def _first(self, local_sig: int, failed: bool, training: bool, batch_rows: int) -> tuple[int, bool, int]:
        comm = self.comm
        told = comm.meet("first", REACH_STEP)  # a rank that could not build its Pipeline says so there
        if told is not None:
            self._refuse(f"{comm.who}: {told}. Fix it there and build the Pipeline again on every rank: this "
                         "one cannot run")
        fields = [signature(v) for v in self.summary.values()]
        rows = comm.all_gather([local_sig, int(failed), self._nonce, int(training), self._ties, batch_rows, *fields],
                               REACH_STEP)
        any_ties = any(r[4] for r in rows)
        given = [r[5] for r in rows if r[5] > 0]
        rows = [r[:4] + r[6:] for r in rows]
        comm.uid = f"{dist.distributed_c10d._get_process_group_name(comm.group)}/{rows[0][2]:x}"
        if any(r[4:] != rows[0][4:] for r in rows):
            self._refuse(self._mismatch([r[4:] for r in rows]))
        try:  # every rank learns the ties (their copies are made equal once the communicators are connected)
            self._on_first(any_ties)
        except InputError as exc:
            self._refuse(str(exc))
        if len({r[3] for r in rows}) > 1:
            calls = ", ".join(f"rank {r} {'step' if row[3] else 'eval'}()" for r, row in enumerate(rows))
            raise InputError(f"{comm.who}: the ranks made different calls ({calls}): every rank makes the same "
                             "call, step() or eval()")
        sig = (sum(r[0] for r in rows) + (1 << 63)) % (1 << 64) - (1 << 63)  # int64 wrap-around, as all_reduce
        return sig, any(r[1] for r in rows), sum(given) // len(given) if given else 0

    def _refuse(self, why: str) -> NoReturn:
        """This Pipeline cannot run: InputError now and at every later step; its data-parallel replicas
        learn it at their agreement (DataParallel.agree), instead of waiting for this rank there."""
        self.misbuilt = why
        if self._dp is not None:
            self._dp.cannot_agree(why)
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
        return (f"{comm.who}: the ranks were built with different pipelines ({'; '.join(lines)}). Build the "
                "same Pipeline on every rank: the same schedule, num_microbatches, number of stages and "
                "variable_shapes, on a group with the same backend for the stages' device")


def shares_build_failure(where: Callable[..., tuple]):
    """Decorates Pipeline.__init__: where it raises, the rank leaves its error at the next first-agreement
    meeting point of the group the arguments name (and of its data-parallel group), so that the other
    ranks' first step() or eval() raises with it (and their replicas' first step) instead of waiting
    out the timeout; then the error is raised here, at once, as it was. `where(**arguments)` ->
    (group, dp group or None), raising where the arguments name no one group (the error then stays
    on this rank)."""
    def decorate(init):
        names = list(inspect.signature(init).parameters)[1:]

        @functools.wraps(init)
        def build(self, *args, **kwargs):
            try:
                init(self, *args, **kwargs)
            except Exception as exc:
                _tell_the_others({**dict(zip(names, args)), **kwargs}, exc, where)
                raise
        return build
    return decorate


def _tell_the_others(arguments: dict, error: Exception, where: Callable[..., tuple]) -> None:
    """shares_build_failure's part on the rank whose Pipeline could not be built."""
    if not dist.is_initialized():
        return
    try:
        group, dp_group = where(**arguments)
    except Exception:  # noqa: BLE001 - no one group: the error stays here
        return
    text = f"{who(group)} could not build its Pipeline: {type(error).__name__}: {error}"
    try:
        if dist.get_world_size(group) > 1:
            cannot_meet("first", group, text)
        if dp_group is not None:
            check_groups(group, dp_group)
            cannot_meet(DataParallel.MEETING, dp_group, f"a data-parallel replica of this pipeline cannot run: {text}")
    except Exception as exc:  # noqa: BLE001 - this rank's own error is the one to raise
        error.add_note(f"pipecore: telling the other ranks that this Pipeline could not be built failed: "
                       f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def groups_named(stages=(), group=None, dp_group=None, **_) -> tuple:
    """A Pipeline that could not be built: the group and the data-parallel group (given, or the DDP/FSDP2
    stages') its arguments say (raises where they name no one group), for its error to reach that
    group's other ranks and its replicas."""
    try:
        stages = stage_list(stages)
    except TypeError:  # those that are stages still name the group
        stages = [s for s in stages if isinstance(s, PipelineStage)] if isinstance(stages, (list, tuple)) else []
    if dp_group is None:
        try:
            dp_group = WrappedStage.common_group([s.module for s in stages])
        except InputError:  # the wrappers disagree: no one group of replicas to tell
            pass
    return pipeline_group(group, stages), dp_group
