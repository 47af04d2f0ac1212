"""The first step of each batch signature (plans.py) learns what crosses every stage boundary from its
own forwards.

Nothing runs the user's model to find shapes: no meta tensors (which CPU autocast, DTensor
parameters, FSDP2's hooks and torch.compile do not follow), no forward run twice (no extra RNG
draws, no module state moved). Instead that step runs as any other, and:

- when a stage's forward returns, its rank describes the output (a `Boundary`), sends that
  description to the rank of the next stage, point to point (pipecore/executor/descriptions.py:
  never through the store), and sets the shapes of its own send and of the gradients it will get
  back;
- a rank whose program reaches a receive of activations reads that description first (waiting up
  to the Pipeline's timeout), then posts the receive with those shapes;
- a rank whose step failed before a forward sends "no output" for it: the receiver then knows no
  message comes and that the sender's step was aborted.

In that step the executor posts no receive ahead and the host waits for and reads each message; on
the device path its batches still go as groups, each receive of activations opening a new one
(csrc/executor.h, SpecFn; pipecore/schedule/p2p_order.py, rule 5). The descriptions become the
plan of that batch signature once every rank ran the step: later steps post receives ahead and check
each output against its boundary.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch

from pipecore.executor.comm import Comm
from pipecore.executor.descriptions import DescriptionTimeout
from pipecore.executor.native import OPCODES, SPEC_ANSWERS
from pipecore.schedule import Kind
from pipecore.stage.boundary import Boundary, StagePlan, describe, tensor_leaves


class Discovery:
    """One step learning the boundaries of its batch signature (train or eval)."""

    def __init__(self, comm: Comm, executor, stages: list, topology, training: bool):
        self._comm = comm
        self._executor = executor
        self._stages = stages
        self._topology = topology
        self.training = training
        self._step = comm.step  # names this step's descriptions (a peer's earlier ones are dropped)
        self._descriptions = comm.descriptions
        self.plans: dict[int, StagePlan] = {s.stage_index: StagePlan() for s in stages}

    def learnt_output(self, local: int, mb: int, boundary: Boundary) -> None:
        """Stage `local`'s forward of `mb` returned an output of this boundary: its rank records it,
        hands it to the next stage (sent to its rank, or directly when that stage is on this rank), and
        sets the shapes of the send and of the gradients that come back."""
        stage = self._stages[local]
        s = stage.stage_index
        nxt = self._topology.next_stage[s]
        self.plans[s].outputs[mb] = boundary
        self._executor.set_output_specs(local, mb, boundary.meta_tensors(), torch.empty(0, device=stage.device))
        if nxt in self.plans:
            self.plans[nxt].inputs[mb] = boundary
        else:
            self._publish(s, mb, boundary)

    def answer(self, local: int, mb: int, op: int, may_wait: bool) -> int:
        """The executor asks for the shapes of a message it never had (csrc/executor.h SpecFn)."""
        stage = self._stages[local]
        s = stage.stage_index
        if op != OPCODES["RECV_F"]:
            # an aborted step's send of activations whose forward never returned (learnt_output sets the
            # shapes before it sends them): no message goes, the receiver learns why
            if self._topology.next_stage[s] not in self.plans:
                self._publish(s, mb, None)
            return SPEC_ANSWERS["ABSENT"]
        prev = self._topology.peer_stage(s, Kind.RECV_F)
        peer = self._topology.peer_rank(s, Kind.RECV_F)
        if prev in self.plans:  # from a stage of this rank (a test's loopback): learnt_output kept it
            kept = self.plans[s].inputs.get(mb)
            if kept is None:  # its forward never returned
                return SPEC_ANSWERS["ABSENT"]
            self._set_input(local, mb, kept)
            return SPEC_ANSWERS["SET"]
        if not may_wait and not self._descriptions.waiting(peer, self._step, prev, mb):
            return SPEC_ANSWERS["ABSENT"]  # the group broke: only what already arrived
        try:
            data = self._descriptions.receive(peer, self._step, prev, mb, self._comm.timeout)
        except DescriptionTimeout:  # a peer hung or died
            return SPEC_ANSWERS["TIMED_OUT"]
        if data is None:
            return SPEC_ANSWERS["ABSENT"]
        with warnings.catch_warnings():  # torch 2.13 warns when a pickled leaf TreeSpec is loaded
            warnings.simplefilter("ignore", FutureWarning)
            boundary: Boundary = pickle.loads(data)
        self.plans[s].inputs[mb] = boundary
        self._set_input(local, mb, boundary)
        return SPEC_ANSWERS["SET"]

    def _set_input(self, local: int, mb: int, boundary: Boundary) -> None:
        device = self._stages[local].device
        self._executor.set_input_specs(local, mb, boundary.meta_tensors(), torch.empty(0, device=device))

    def settle(self) -> None:
        """Every rank ran this step to its end: the descriptions this rank sent were read."""
        if self._descriptions is not None:
            self._descriptions.settle(self._comm.timeout)

    def _publish(self, stage: int, mb: int, boundary: Boundary | None) -> None:
        self._descriptions.send(self._topology.peer_rank(stage, Kind.SEND_F), self._step, stage, mb,
                                None if boundary is None else pickle.dumps(boundary, protocol=4))


def declared_mismatch(stage, args: Any, kwargs: Any, out: Any) -> str | None:
    """Where the stage was built with input_args/output_args and these inputs are shaped like
    input_args: how the output differs from output_args (None: it does not, or nothing was given)."""
    given = stage.declared_output(describe(args), describe(kwargs))
    if given is None:
        return None
    got = [(m.shape, m.dtype) for m in tensor_leaves(describe(out))]
    want = [(m.shape, m.dtype) for m in tensor_leaves(given)]
    if got == want:
        return None
    return (f"tensors {[(s, str(d)) for s, d in got]}, but its output_args say {[(s, str(d)) for s, d in want]} "
            "for inputs shaped like its input_args")
