"""Test-only: run a one-process Pipeline on one GPU with every stage boundary going through NCCL
(a send to and receive from its own rank, in one group), so that the device communication path
(communication stream, events, batches, statuses on the device, freeing) runs where only one GPU
exists. NCCL refuses two ranks on one GPU; it accepts a rank's send to itself when the matching
receive is in the same group, which the batching rule (a run of consecutive SEND/RECV actions is
one group) gives here."""

from __future__ import annotations

import pipecore as pc
from pipecore.executor.program import encode
from pipecore.schedule import Action, Kind, Schedule


def loopback_schedule(sched: Schedule) -> Schedule:
    """`sched` (one rank) lowered, with a SEND and its RECV after every action whose result crosses
    a stage boundary, as if each stage were on a rank of its own."""
    assert sched.num_ranks == 1
    topo = sched.topology
    rows = []
    for a in sched.lower().actions[0]:
        rows.append(a)
        for leaf in a.leaves():
            if leaf.kind is Kind.F and topo.next_stage[leaf.stage] >= 0:
                rows += [Action(leaf.stage, Kind.SEND_F, leaf.microbatch),
                         Action(topo.next_stage[leaf.stage], Kind.RECV_F, leaf.microbatch)]
            elif leaf.kind in (Kind.B, Kind.I) and topo.prev_stage[leaf.stage] >= 0:
                rows += [Action(leaf.stage, Kind.SEND_B, leaf.microbatch),
                         Action(topo.prev_stage[leaf.stage], Kind.RECV_B, leaf.microbatch)]
    return Schedule.from_codes([[a.code for a in rows]], topo, name=f"{sched.name}-loopback")


def make_loopback(pipe: pc.Pipeline) -> None:
    """Before the first step: `pipe` (all stages on this rank) sends across its stage boundaries."""
    pipe.programs[True] = encode(loopback_schedule(pipe.schedule), pipe.rank, {s.stage_index: i for i, s in enumerate(pipe.stages)})
    for i in range(len(pipe.stages)):
        pipe.executor.set_links(i, -1, -1)
