"""Which path a Pipeline's messages take, and what each path implies for a step.

- gloo (the host path): sends and receives posted from a communication thread (a small send after
  which the compute thread waits for a message anyway is posted by that thread), receives posted
  up to a window ahead, sends within a budget per peer, and messages that carry their shapes
  (csrc/comm.h, shaped messages), so that a batch that changes shapes needs no new plan.
- NCCL on CUDA (the device path, csrc/device_comm.h): batches on a communication stream, events,
  message statuses on the device: no host wait for a message's data inside a step (the host waits it
  does make are listed in docs/cuda.md, "Host waits on the device path"). There messages carry their shapes
  only when asked (`variable_shapes=True`): the host then reads each received message's header
  (one small device-to-host copy, waited for), and a message that outgrows its receiver's buffers
  follows on a communicator of its own (csrc/executor.h, set_follow_up_channels).
"""

from __future__ import annotations

import os

import torch

from pipecore.errors import InputError


def configure_messages(executor, gloo: bool, device: torch.device, who: str, recv_window: int, send_budget: int,
                       variable_shapes: bool | None, timeout: float, backend) -> None:
    """Sets up `executor`'s messages for a group that is gloo (or not) on `device`, whose backend
    there is `backend`; `timeout` is the Pipeline's."""
    if variable_shapes not in (None, True, False):
        raise TypeError(f"variable_shapes must be True, False or None, got {variable_shapes!r}")
    # receives may pass sends to their peer on gloo only ([Note: NCCL pair order], csrc/device_comm.h)
    executor.set_recv_window(recv_window, gloo)
    executor.set_send_budget(send_budget)
    # posting a gloo operation can block on gloo's locks (and a send copy the message): not on the
    # compute thread
    executor.set_comm_thread(gloo)
    # NCCL: batches on a communication stream, no host wait for a message's data (csrc/device_comm.h)
    use_device_path(executor, gloo, device, who)
    if executor.device_comm:
        check_device_path_settings(who, timeout, backend, os.environ)
    executor.set_shapes_travel(gloo and not executor.device_comm if variable_shapes is None else variable_shapes)


def use_device_path(executor, gloo: bool, device: torch.device, who: str) -> None:
    """NCCL on CUDA: messages go the device path (csrc/device_comm.h). A build without the
    extension's CUDA part has none, and its host path is not safe there: its receives posted ahead can
    deadlock on NCCL ([Note: NCCL pair order], csrc/device_comm.h). Refused, on every rank (they share the build), saying what to do."""
    if gloo or device.type != "cuda" or executor.set_device_comm(str(device)):
        return
    raise InputError(f"{who}: this pipecore was built without its CUDA part (csrc/cuda: no nvcc was found "
                     "when it was built; pipecore._C.build_info()['cuda'] is False), so it cannot run this Pipeline's "
                     "messages over NCCL. Rebuild it with the CUDA toolkit installed (`make install` with nvcc on PATH "
                     "or CUDA_HOME set; docs/install.md), or give the Pipeline a gloo group")


def describe_messages(executor) -> str:
    """How this rank's messages go, which every rank of the group must share (the first agreement
    compares it): on NCCL a message of another path or layout than its receiver's is a size mismatch,
    which hangs."""
    path = "the device path (NCCL)" if executor.device_comm else "gloo"
    return f"{path}, {'shapes in every message' if executor.shapes_travel else 'a plan per batch shape'}"


BLOCKING_WAIT_VARIABLES = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


def check_device_path_settings(who: str, timeout: float, backend, environ) -> None:
    """What the device path needs of its NCCL group, refused with the fix: a host that never blocks on a
    transfer (with blocking wait, c10d makes the host wait for each batch's Work), and a group timeout
    above the Pipeline's (at or below it, c10d's watchdog ends a stuck transfer by killing the process
    before pipecore's own timeout can abort the communicator and say which message was missing)."""
    for name in BLOCKING_WAIT_VARIABLES:
        if environ.get(name, "0").strip() not in ("", "0"):
            raise InputError(f"{who}: {name}={environ[name]} makes the host wait for every NCCL transfer, and "
                             "pipecore's device path never waits for one inside a step (its own timeout bounds each "
                             f"wait and aborts the communicator): unset {name}")
    group_timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    if group_timeout is not None and timeout >= group_timeout.total_seconds():
        raise InputError(f"{who}: the Pipeline's timeout ({timeout:g} s) is not below its NCCL group's "
                         f"({group_timeout.total_seconds():g} s): c10d's watchdog would end a stuck transfer by "
                         "killing the process first. Give the Pipeline a smaller timeout=, or the group a larger one "
                         "(init_process_group(timeout=...) or new_group(timeout=...))")


def computes_on_stand_ins(executor) -> bool:
    """The device path reads message statuses at the step's end, computing on what came before
    (csrc/device_comm.h); shaped messages' statuses are read as they arrive, as on the host path."""
    return executor.device_comm and not executor.shapes_travel
