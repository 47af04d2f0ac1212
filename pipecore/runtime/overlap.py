"""OVERLAP_F_B: the forward of one microbatch and the backward of another, at once.

DualPipe's schedules pair a forward with a backward ("(0F3;3B1)OVERLAP_F_B") so that the
communication of one (pipeline P2P, an MoE all-to-all) hides behind the compute of the other.
pipecore runs a pair's backward half on a second thread while the step's thread runs the forward
half (both with the step's thread-local state and, on an accelerator, its device and compute
stream). How the halves share the time is `Pipeline(overlap_f_b=...)`:

- "lockstep" (default): one half computes at a time; inside the model, a half hands its turn to
  the other around its communication (TorchTitan's overlap_callback):

      work = dist.all_to_all_single(out, inp, group=ep_group, async_op=True)
      with pipecore.overlap_handoff():   # the other half computes meanwhile
          work.wait()

  Without handoff points a pair runs as in sequence. Collectives inside the halves are issued in
  one order on every rank (each half runs up to its next handoff), as the peers of an expert- or
  tensor-parallel group need.
- "concurrent": both halves compute at once (torch's kernels release the GIL). Only for halves
  that share no process group: a rank issues the two halves' collectives in the order its threads
  happen to run, so a group used by both (tensor or expert parallel) would match one rank's forward
  all-reduce with another's backward one -- wrong sums, or a hang.
- "sequential": the halves one after the other, as torch.distributed.pipelining runs them.
- a callable `hook(pair)`: it decides how the pair runs with `pair.run(mode)` or `pair.run_forward()` /
  `pair.run_backward()`, each once, on any thread, before the hook returns (pipecore waits for
  halves still running when it returns). `pair.run(mode)` keeps pipecore's rules below; a hook
  that runs the halves at once itself should ask `pair.sequential_reason` first.

Results equal the sequential run to the last bit: the halves belong to different microbatches and
share no autograd state. What they could share pipecore checks before each pair and then runs it in
sequence: the global RNG, which a backward recomputing a checkpointed region sets while it runs
(torch's `preserve_rng_state`; a forward drawing random numbers meanwhile, dropout, would draw from
that state), so every backward action's graph is walked for checkpoints (a concurrent pair before
it starts, a lock-step pair when its forward first hands over); DDP/FSDP2 stages, whose
hooks expect one backward at a time; and active Python modes (FlopCounterMode, DebugMode), one
object that two threads would drive. `Pipeline.overlap_fallbacks` counts those pairs, and pipecore
warns once per reason. A module must not share other mutable state between one microbatch's
forward and another's backward for a pair to overlap.

The first step of each batch signature (it learns what crosses each stage boundary) runs its pairs in
program order on one thread, without hooks, and counts them in neither `overlapped_pairs` nor
`overlap_fallbacks`.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable

from pipecore.executor.native import OVERLAP_MODES as MODES
from pipecore.executor.native import C
from pipecore.schedule import Action, Kind

_WHY = {  # the executor's reasons (csrc/executor.h, overlap_fallbacks) and what each means
    "checkpoint": "the backward half recomputes a checkpointed region, which sets the global RNG state while it "
                  "runs: a forward beside it could draw its random numbers from that state",
    "stage_events": "a DDP or FSDP2 stage, whose hooks expect one backward at a time",
    "python_modes": "a Python dispatch or function mode is active (FlopCounterMode, DebugMode): one object that two "
                    "threads would drive at once",
    "one_kind": "the pair holds only forwards or only backwards",
}


def _mode_code(mode: str) -> int:
    if mode not in MODES:
        raise ValueError(f"overlap mode must be one of {sorted(MODES)}, got {mode!r}")
    return MODES[mode]


@contextlib.contextmanager
def overlap_handoff():
    """Inside a lock-step OVERLAP_F_B pair: let the other half compute while this block runs (a
    wait for communication), then wait for the turn to come back. Anywhere else: nothing."""
    half = C.overlap_hand_over()
    try:
        yield
    finally:
        C.overlap_take_back(half)


class OverlappedPair:
    """One OVERLAP_F_B pair of this rank's program, as an overlap hook gets it.

    `action` is the container ("(0F3;3B1)OVERLAP_F_B"); `forward` and `backward` its sub-actions of
    each half (global stage indices, microbatch indices); `modules[stage]` the stage modules."""

    def __init__(self, executor, bracket: int, action: Action, modules: dict):
        self._executor = executor
        self._bracket = bracket
        self.action = action
        self.forward = [a for a in action.sub_actions if a.kind is Kind.F]
        self.backward = [a for a in action.sub_actions if a.kind is not Kind.F]
        self.modules = modules

    def run_forward(self) -> None:
        """Runs the forward half (once); raises its error."""
        self._executor.run_pair_half(self._bracket, 0)

    def run_backward(self) -> None:
        """Runs the backward half (once); raises its error."""
        self._executor.run_pair_half(self._bracket, 1)

    def run(self, mode: str = "lockstep") -> None:
        """Runs both halves as `mode` says ("lockstep", "concurrent", "sequential"), in sequence
        where pipecore's rules say so (see `sequential_reason`)."""
        self._executor.run_pair(self._bracket, _mode_code(mode))

    @property
    def sequential_reason(self) -> str | None:
        """Why the halves must not overlap ("checkpoint", "stage_events", "python_modes",
        "one_kind"; see pipecore.runtime.overlap), or None."""
        return self._executor.pair_sequential_reason(self._bracket) or None

    def __repr__(self) -> str:
        return f"OverlappedPair({self.action})"


class PairRunner:
    """A Pipeline's OVERLAP_F_B configuration: the mode, the hook, the warnings."""

    def __init__(self, executor, stages: list, labels: list[str], overlap_f_b: str | Callable):
        """`labels`: the training program's (an OVERLAP_F_B bracket's names its pair)."""
        self._executor = executor
        self._labels = labels
        self._modules = {s.stage_index: s.module for s in stages}
        self._warned: set[str] = set()
        self._pairs: dict[int, Action] = {}  # bracket index -> container, of the training program
        if callable(overlap_f_b):
            self.mode, self._user_hook = "lockstep", overlap_f_b
        elif isinstance(overlap_f_b, str):
            _mode_code(overlap_f_b)
            self.mode, self._user_hook = overlap_f_b, None
        else:
            raise TypeError("overlap_f_b must be 'lockstep', 'concurrent', 'sequential' or a callable(pair), got "
                            f"{type(overlap_f_b).__name__}")
        # `overlap_f_b` is the one way to decide: a module's own method (DualPipe's
        # `overlapped_forward_backward`, with its own signature) is not looked for
        hook = None
        if self._user_hook is not None:
            # the executor holds the hook: a weak reference back, or the Pipeline would never be freed
            me = weakref.ref(self)

            def hook(bracket: int) -> None:
                runner = me()
                if runner is not None:
                    runner._hook(bracket)
        executor.set_overlap(MODES[self.mode], hook, str(stages[0].device))

    def _hook(self, bracket: int) -> None:
        action = self._pairs.get(bracket)
        if action is None:
            label = self._labels[bracket]
            action = self._pairs[bracket] = Action.parse(label.removeprefix("PP:"))
        modules = {a.stage: self._modules[a.stage] for a in action.sub_actions}
        self._user_hook(OverlappedPair(self._executor, bracket, action, modules))

    @property
    def fallbacks(self) -> dict[str, int]:
        return dict(self._executor.overlap_fallbacks())

    def warn_fallbacks(self, *, stacklevel: int) -> None:
        """One warning per reason not warned about yet; `stacklevel` names the caller of step() from here."""
        for why in self._executor.overlap_fallbacks():
            if why not in self._warned:
                self._warned.add(why)
                warnings.warn(f"pipecore: OVERLAP_F_B pairs run in sequence, not overlapped: {_WHY.get(why, why)} "
                              "(Pipeline.overlap_fallbacks counts them)", stacklevel=stacklevel)


__all__ = ["MODES", "OverlappedPair", "PairRunner", "overlap_handoff"]
