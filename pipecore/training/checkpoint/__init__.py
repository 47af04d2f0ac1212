"""Checkpoints of a `Pipeline` with torch.distributed.checkpoint (DCP).

Both calls are collectives over the pipeline's group: every rank calls them, with its own optimizer
(the one over its stages' parameters):

    pc.save_checkpoint("ckpt/step1000", pipe, optimizer,
                       extra={"step": 1000, "scheduler": scheduler.state_dict()})
    ...
    extra = pc.load_checkpoint("ckpt/step1000", pipe, optimizer)   # in place, on every rank
    scheduler.load_state_dict(extra["scheduler"])
    step = extra["step"]

What is saved, keyed by MODEL stage so that a checkpoint does not depend on the schedule (names.py):
  - every model stage's state dict as `stage{j}.{name in the stage module}` (dualpipe's mirrored
    copies hold the same keys on two ranks: DCP writes them once; when one rank holds several
    copies of one model stage, its lowest pipeline stage is saved and the others are loaded from it);
  - the optimizer's state in DCP's flattened form (`state.stage{j}.{name}.exp_avg`,
    `param_groups.stage{j}.{name}.lr`), so that each rank's optimizer is saved and loaded by name;
  - `extra` (rank 0's, pickled) and each rank's torch RNG states (CPU, and CUDA on a CUDA stage
    device), so a resumed run draws the same dropout masks as an uninterrupted one;
  - `pipecore.json` (layout.py): the stage layout (per model stage, its state names and shapes),
    schedule, world size, optimizer class and pipecore version. Load compares it with this pipeline
    before reading anything else, so a checkpoint of another stage layout fails on every rank with
    one message.

A save goes to `<path>.saving` and replaces `<path>` only once every rank's part and the layout are
written (files.py): a failed save leaves the previous checkpoint as it was. A load reads into new
tensors and copies them into the model and optimizer only after every rank read everything: a failed
load leaves them as they were (protocol.py: the collective steps of both). The path must be on a file
system every rank sees.
"""

from pipecore.training.checkpoint.files import LAYOUT_FILE
from pipecore.training.checkpoint.protocol import load_checkpoint, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "LAYOUT_FILE"]
