"""The program one rank's executor runs: a lowered schedule's row as instructions.

An instruction is `FIELDS` integers (`_C.INSTRUCTION_FIELDS`, csrc/program.h): the opcode (from
`pipecore._C.OPCODES`), the stage's index among this rank's stages, the microbatch, the peer rank of
a send or receive (-1 otherwise) and the index of its label ("PP:1F0", the NVTX range and profiler
event name). An OVERLAP_F_B pair becomes its two
halves between OVERLAP_BEGIN and OVERLAP_END brackets.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipecore.executor.native import INSTRUCTION_FIELDS as FIELDS, OPCODES
from pipecore.schedule import Kind, Schedule


@dataclass(frozen=True)
class Program:
    instructions: list[int]  # FIELDS integers per instruction
    labels: list[str]

    def local_stages_in_order_of(self, kind: str, num_local: int) -> list[int]:
        """This rank's stages in the order of their first `kind` instruction, then the others."""
        flat, op = self.instructions, OPCODES[kind]
        order: list[int] = []
        for i in range(0, len(flat), FIELDS):
            if flat[i] == op and flat[i + 1] not in order:
                order.append(flat[i + 1])
        return order + [k for k in range(num_local) if k not in order]

    def peers(self) -> list[int]:
        """The ranks this program sends to or receives from, ascending."""
        return sorted({self.instructions[i + 3] for i in range(0, len(self.instructions), FIELDS)} - {-1})


def encode(lowered: Schedule, rank: int, local_index: dict[int, int]) -> Program:
    """`rank`'s row of `lowered` as the executor's instructions; `local_index`: stage -> its index
    among this rank's stages."""
    topo = lowered.topology
    flat: list[int] = []
    labels: list[str] = []

    def emit(op: str, stage: int, mb: int, peer: int, label: str) -> None:
        flat.extend((OPCODES[op], stage, mb, peer, len(labels)))
        labels.append(label)

    for a in lowered.actions[rank]:
        if a.kind is Kind.OVERLAP_F_B:
            emit("OVERLAP_BEGIN", 0, 0, -1, f"PP:{a}")
            for sub in a.sub_actions:
                emit(sub.kind.name, local_index[sub.stage], sub.microbatch, -1, f"PP:{sub}")
            emit("OVERLAP_END", 0, 0, -1, f"PP:{a}")
            continue
        peer = topo.peer_rank(a.stage, a.kind) if a.kind.is_comm else -1
        emit(a.kind.name, local_index[a.stage], a.microbatch if a.microbatch is not None else 0, peer, f"PP:{a}")
    return Program(flat, labels)


def labels_of(lowered: Schedule, rank: int) -> list[str]:
    """The labels of `rank`'s program (`encode`'s; any rank's, as its stages' local indices do not name them)."""
    stages = lowered.topology.rank_stages(rank)
    return encode(lowered, rank, {s: i for i, s in enumerate(stages)}).labels


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards, in its order (same placement): what eval() runs."""
    rows = [[leaf for a in row for leaf in a.leaves() if leaf.kind is Kind.F] for row in schedule.compute_only().actions]
    topo = schedule.topology
    return Schedule.from_codes([[a.code for a in row] for row in rows], topo, (schedule.name or "") + ":forward")
