"""What crosses each stage boundary, per batch signature: learnt once, then loaded into the executor.

The batch signature is a digest of the first stages' inputs: where messages carry their shapes and
the batch's rows (csrc/comm.h, shaped messages: gloo, or NCCL with variable_shapes=True), their
structure (tensors' dtypes and ranks, other values); elsewhere, their shapes. The ranks agree on it
with one small all-reduce whenever a first stage's batch changed signature. The first step of each
signature learns every boundary's message (pipecore/runtime/discovery.py) while it runs; once every
rank ran it, the plan is kept, and later steps load it: the executor then knows every message's
shapes (shaped messages: its structure and the sizes to post receives at, which it widens to what
crossed since) before it arrives and posts receives early.
"""

from __future__ import annotations

import torch

from pipecore.runtime.agreement import Agreement
from pipecore.runtime.discovery import Discovery
from pipecore.stage.boundary import StagePlan


class Plans:
    def __init__(self, agreement: Agreement, executor, stages: list, topology, programs: dict):
        """`programs`: the executor's program per mode (True: training, False: eval)."""
        self._agree = agreement
        self._executor = executor
        self._stages = stages
        self._topology = topology
        self._programs = programs
        self._kept: dict[tuple[int, bool], dict[int, StagePlan]] = {}  # per (batch signature, training)
        self._loaded: tuple[int, bool] | None = None
        self.agreed: dict[bool, int] = {}  # per mode: the signature all ranks agreed on
        self.last_desc: dict[bool, int] = {}  # first-stage ranks: the batch description it came from
        self.batch_rows: dict[bool, int] = {}  # per mode: the rows of the first stages' batch (0: unknown)
        self.discovery: Discovery | None = None  # during a step that learns its batch signature's plan
        self.in_use: dict[int, StagePlan] = {}  # stage -> its plan, for the step that runs
        self.loaded_mode: bool | None = None  # the mode of the program in the executor (True: training)

    def __len__(self) -> int:
        return len(self._kept)

    def agree(self, desc: int, training: bool, has_first: bool, batch_rows: int) -> tuple[int, bool]:
        """All ranks agree on the batch signature: (signature, whether another rank's input checks
        failed); every rank learns the first stages' batch rows."""
        sig, failed, rows = self._agree(desc, False, training, batch_rows=batch_rows)
        if not failed:
            self.agreed[training] = sig
            self.batch_rows[training] = rows
            if has_first:
                self.last_desc[training] = desc
        return sig, failed

    def plan(self, sig: int, training: bool) -> None:
        """The plan of `sig` is loaded, or this step learns it."""
        if (sig, training) in self._kept:
            self.ensure_loaded(sig, training)
            return
        self._set_program(training)
        self._executor.forget_specs()
        self._loaded = None
        self.discovery = Discovery(self._agree.comm, self._executor, self._stages, self._topology, training)
        self.in_use = self.discovery.plans

    def end_discovery(self, failed: bool) -> None:
        """After a step that learnt its batch signature's plan: the plan is kept once every rank ran the
        step (one small all-reduce); otherwise the next step learns it again."""
        discovery, self.discovery = self.discovery, None
        if discovery is None:
            return
        _, failed_somewhere, _ = self._agree(0, failed, discovery.training, "agreeing whether every rank ran the step "
                                          "that learnt this batch signature's messages")
        if failed_somewhere:
            self.agreed.pop(discovery.training, None)
            return
        discovery.settle()
        key = (self.agreed[discovery.training], discovery.training)
        self._kept[key] = discovery.plans
        self._load(discovery.plans, discovery.training)
        self._loaded = key

    def forget_discovery(self) -> None:
        """The group broke: no agreement can end the discovery."""
        self.discovery = None

    def ensure_loaded(self, sig: int, training: bool) -> None:
        key = (sig, training)
        if self._loaded != key:
            self._load(self._kept[key], training)
            self._loaded = key

    def kept(self) -> list[dict[int, StagePlan]]:
        return list(self._kept.values())

    def _set_program(self, training: bool) -> None:
        program = self._programs[training]
        self._executor.set_program(program.instructions, program.labels)
        self.loaded_mode = training

    def _load(self, plans: dict[int, StagePlan], training: bool) -> None:
        self._set_program(training)
        self.in_use = plans
        for local, s in enumerate(self._stages):
            p = plans[s.stage_index]
            like = torch.empty(0, device=s.device)
            for mb in self._topology.microbatches[s.stage_index]:
                given, sent = p.inputs.get(mb), p.outputs.get(mb)
                self._executor.set_specs(local, mb, given.meta_tensors() if given is not None else [],
                                         sent.meta_tensors() if sent is not None else [], like)
