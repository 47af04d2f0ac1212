"""The device path's protocol (csrc/device_comm.h) on machines without a GPU: the executor's side
of it runs here with the host doing what CUDA does with streams, events and kernels
(csrc/testing/host_device_comm.cpp; `set_messages(pipe, "device")`). Training against one process, failures,
timeouts and out-of-step channels run in test_pipeline, test_reliability, test_memory and
test_overlap under messages="device"; tests/test_cuda.py runs the CUDA code itself on a GPU."""

import pytest

from device_path_cases import (ROWS, device_path_without_cuda_part, module_state_after_steps_that_do_not_count,
                               path_chosen_before_the_first_step)
from dist_pool import pool


@pytest.mark.parametrize("messages", ["default", "device"])
@pytest.mark.parametrize("name, world", [("1f1b", 3), ("gpipe", 2)])
def test_steps_that_do_not_count_leave_rng_and_buffers_as_they_were(name, world, messages):
    outcomes = pool(world).run(module_state_after_steps_that_do_not_count, name, messages)
    failed = ROWS.index(None)
    for rank, seen in enumerate(outcomes):
        want = ["ok"] * len(ROWS)
        want[failed] = "RuntimeError" if rank == 0 else "PeerFailedError"
        assert seen == want, (rank, seen)


def test_the_message_path_is_chosen_before_the_first_step():
    from pipecore import _C

    if _C.build_info()["cuda"]:
        pytest.skip("this build has its CUDA part")
    refused, error, device_comm = pool(1).run(path_chosen_before_the_first_step)[0]
    assert refused == (False, False, True), refused  # no device path here: the host path and its settings stay
    assert error is not None and "_emulate_device_comm after the executor's first step" in error, error
    assert not device_comm


def test_a_build_without_its_cuda_part_refuses_nccl_messages():
    from pipecore import _C

    if _C.build_info()["cuda"]:
        pytest.skip("this build has its CUDA part")
    error, device_comm = pool(1).run(device_path_without_cuda_part)[0]
    assert error is not None and "built without its CUDA part" in error and "gloo group" in error, error
    assert not device_comm
