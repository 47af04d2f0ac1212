"""OVERLAP_F_B: the forward of one microbatch and the backward of another, at once.

DualPipe's schedules pair a forward with a backward ("(0F3;3B1)OVERLAP_F_B") so that the
communication of one (pipeline P2P, an MoE all-to-all) hides behind the compute of the other.
pipecore runs a pair's backward half on a second thread (on an accelerator, on a stream of its own,
joined to the compute stream by events) while the step's thread runs the forward half. How pairs
run is `Pipeline(overlap_f_b=...)`:

- "concurrent" (default): both halves compute at once. On CPUs each half gets a core (torch's
  kernels release the GIL); on one GPU the halves' kernels and communication interleave.
- "lockstep": one half computes at a time; inside the model, a half hands its turn to the other
  around its communication (TorchTitan's overlap_callback):

      work = dist.all_to_all_single(out, inp, group=ep_group, async_op=True)
      with pipecore.overlap_handoff():   # the other half computes meanwhile
          work.wait()

- "sequential": the halves one after the other, as torch.distributed.pipelining runs them.
- a callable `hook(pair)`, or a stage module's `overlapped_forward_backward(pair)` method
  (DualPipe's name; here it gets the pair, not the modules and tensors): it decides how the pair
  runs with `pair.run(mode)` or `pair.run_forward()` / `pair.run_backward()` (each once, on any
  thread; pipecore waits for both).

Results equal the sequential run to the last bit: the halves belong to different microbatches and
share no autograd state. One piece of global state they could share is the RNG: a checkpointed
region that is recomputed in the backward sets the global RNG state while it runs (torch's
`preserve_rng_state`), and a forward drawing random numbers meanwhile (dropout) would draw from that
state. So a pair whose backward half recomputes (a node with saved-tensor hooks: activation
checkpointing, offloading) runs in sequence, as do pairs of DDP/FSDP2 stages, whose hooks expect
one backward at a time. `Pipeline.overlap_fallbacks` counts those pairs, and pipecore warns once
per reason. A user's module must not share other mutable state between two microbatches' forward
and backward (a counter updated in forward and read in backward) for the pair to overlap.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

from .schedule import Action, Kind

MODES = {"sequential": 0, "concurrent": 1, "lockstep": 2}

_WHY = {  # the executor's reasons (csrc/executor.h, overlap_fallbacks) and what each means
    "saved_tensor_hooks": "the backward half recomputes a checkpointed region (a node with saved-tensor hooks), "
                          "which sets the global RNG state while it runs: a forward beside it could draw its "
                          "random numbers from that state",
    "stage_events": "a DDP or FSDP2 stage, whose hooks expect one backward at a time",
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
    from . import _C

    half = _C.overlap_hand_over()
    try:
        yield
    finally:
        _C.overlap_take_back(half)


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
        """Runs the backward half (once; on an accelerator on a stream of its own); raises its error."""
        self._executor.run_pair_half(self._bracket, 1)

    def run(self, mode: str = "concurrent") -> None:
        """Runs both halves as `mode` says ("concurrent", "lockstep", "sequential")."""
        self._executor.run_pair(self._bracket, _mode_code(mode))

    def __repr__(self) -> str:
        return f"OverlappedPair({self.action})"


class PairRunner:
    """A Pipeline's OVERLAP_F_B configuration: the mode, the hook, the warnings."""

    def __init__(self, pipe, overlap_f_b: str | Callable):
        self._pipe = pipe
        self._warned: set[str] = set()
        self._pairs: dict[int, Action] = {}  # bracket index -> container, of the training program
        if callable(overlap_f_b):
            self.mode, self._user_hook = "concurrent", overlap_f_b
        elif isinstance(overlap_f_b, str):
            _mode_code(overlap_f_b)
            self.mode, self._user_hook = overlap_f_b, None
        else:
            raise TypeError("overlap_f_b must be 'concurrent', 'lockstep', 'sequential' or a callable(pair), got "
                            f"{type(overlap_f_b).__name__}")
        self._module_hooks = {s.stage_index: s.module.overlapped_forward_backward for s in pipe.stages
                              if callable(getattr(s.module, "overlapped_forward_backward", None))}
        hooked = self._user_hook is not None or self._module_hooks
        pipe._executor.set_overlap(MODES[self.mode], self._hook if hooked else None, str(pipe.stages[0].device))

    def _hook(self, bracket: int) -> None:
        action = self._pairs.get(bracket)
        if action is None:
            label = self._pipe._programs[True][1][bracket]
            action = self._pairs[bracket] = Action.parse(label.removeprefix("PP:"))
        modules = {a.stage: self._pipe.stage_by_index[a.stage].module for a in action.sub_actions}
        pair = OverlappedPair(self._pipe._executor, bracket, action, modules)
        if self._user_hook is not None:
            self._user_hook(pair)
            return
        first = (pair.forward or pair.backward)[0].stage
        hook = self._module_hooks.get(first)
        if hook is not None:
            hook(pair)
        else:
            pair.run(self.mode)

    @property
    def fallbacks(self) -> dict[str, int]:
        return dict(self._pipe._executor.overlap_fallbacks())

    def warn_fallbacks(self) -> None:
        for why in self._pipe._executor.overlap_fallbacks():
            if why not in self._warned:
                self._warned.add(why)
                warnings.warn(f"pipecore: OVERLAP_F_B pairs run in sequence, not overlapped: {_WHY.get(why, why)} "
                              "(Pipeline.overlap_fallbacks counts them)", stacklevel=5)


__all__ = ["MODES", "OverlappedPair", "PairRunner", "overlap_handoff"]
