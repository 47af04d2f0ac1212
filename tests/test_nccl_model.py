"""The device path against the CPU model of NCCL (csrc/testing/host_device_comm.cpp), for the
hazards a review of the NCCL path found (issue 51): each case failed on the code before its fix."""

from datetime import timedelta

import pytest

from dist_pool import pool
from pipecore.errors import InputError
from pipecore.runtime.message_path import check_device_path_settings
from nccl_model_cases import side_tensors_cross


@pytest.mark.parametrize("messages", ["large", "default"])
def test_tensors_of_dtypes_nccl_lacks_cross_as_bytes(messages):
    # M1: an int16 mask and complex64 frequencies beside the activations. "large": each tensor goes
    # from its own storage, not packed into one byte buffer; NCCL would refuse their dtypes inside the
    # batch's group, after some of it was posted (the model refused them: "a send of Short").
    pool(2).run(side_tensors_cross, messages, timeout=120)


class _NcclOptions:  # what c10d's ProcessGroupNCCL backend shows of its options
    def __init__(self, seconds):
        self._timeout = timedelta(seconds=seconds)


@pytest.mark.parametrize("timeout, group_s, environ, refused", [
    (300, 600, {}, None),
    (600, 600, {}, "not below its NCCL group's (600 s)"),
    (900, 600, {}, "timeout=, or the group a larger one"),
    (60, 600, {"TORCH_NCCL_BLOCKING_WAIT": "1"}, "unset TORCH_NCCL_BLOCKING_WAIT"),
    (60, 600, {"NCCL_BLOCKING_WAIT": "1"}, "unset NCCL_BLOCKING_WAIT"),
    (60, 600, {"TORCH_NCCL_BLOCKING_WAIT": "0"}, None),
])
def test_the_device_path_refuses_a_watchdog_or_blocking_wait_that_would_act_first(timeout, group_s, environ, refused):
    # M4: at or above the group's timeout, c10d's watchdog kills a rank whose transfer is stuck before
    # the Pipeline's timeout aborts the communicator with its message; with blocking wait the host
    # waits for every batch. Both were accepted silently.
    backend = type("NcclBackend", (), {"options": _NcclOptions(group_s)})()
    if refused is None:
        check_device_path_settings(3, timeout, backend, environ)
        return
    with pytest.raises(InputError, match="rank 3: ") as caught:
        check_device_path_settings(3, timeout, backend, environ)
    assert refused in str(caught.value), caught.value
