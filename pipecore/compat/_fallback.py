"""Names of torch.distributed.pipelining that pipecore does not run (helpers, data types, tracing),
served by torch's own module, so that a module aliased by `patch_torch_pipelining` imports whatever
it imported from torch's. A schedule class pipecore does not have is refused instead: served by
torch's, it would run on torch's runtime while the user believes it runs on pipecore."""

from __future__ import annotations

import importlib
import warnings


def torch_fallback(torch_module: str, ours: str):
    """A module-level `__getattr__` for module `ours` that serves names from `torch_module`, torch's
    own module, held from now on (once patched, its name in sys.modules is pipecore's)."""
    torch_own = importlib.import_module(torch_module)

    def __getattr__(name: str):
        if "Schedule" in name:
            said = (f"{ours} has no {name}: it is a torch schedule pipecore does not run (its schedules: "
                    "pipecore.compat.schedules.__all__)")
            # `from ... import name` replaces an AttributeError's text with Python's own: said once more here
            warnings.warn(said, stacklevel=2)
            raise AttributeError(said)
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(torch_own, name)
        except AttributeError:
            raise AttributeError(f"neither {ours} nor {torch_module} has {name!r}") from None

    return __getattr__
