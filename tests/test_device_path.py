"""The device path's protocol (csrc/device_comm.h) on machines without a GPU: the executor's side
of it runs here with the host doing what CUDA does with streams, events and kernels
(csrc/host_device_comm.cpp; `set_messages(pipe, "device")`). Training against one process, failures,
timeouts and out-of-step channels run in test_pipeline, test_reliability, test_memory and
test_overlap under messages="device"; tests/test_cuda.py runs the CUDA code itself on a GPU."""

import pytest

from device_path_cases import ROWS, module_state_after_steps_that_do_not_count
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
