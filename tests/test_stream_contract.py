"""The device path's stream contract (csrc/stream_contract.h), checked on CPU: the host emulation
of the device path keeps a ledger of what each stream did to every message buffer and refuses a
use before the producer's event or a free before another stream's last use. Under every schedule,
with a new batch shape, a failure midway (receives dropped unconsumed) and steps after it.
The rule that a receive-only batch's communication stream waits on compute too (issue 35, hazard
1) is what the first of those refusals caught before it was fixed."""

import pytest

import pipecore as pc
from dist_pool import pool
from stream_contract_cases import ROWS, steps_under_the_checker

# every training schedule at its own stages per rank (zb_auto at one and two)
CASES = [(name, world, pc.build_schedule(name, world, 2 * world, V).num_stages // world)
         for name in pc.SCHEDULES if name != "forward_only" for world in (2, 4)
         for V in ((1, 2) if name == "zb_auto" else (None,))]


@pytest.mark.parametrize("name, world, V", CASES)
def test_every_buffer_is_used_and_freed_as_the_streams_order_it(name, world, V):
    results = pool(world).run(steps_under_the_checker, name, V)
    failed = ROWS.index(None)
    for rank, (outcomes, refused) in enumerate(results):
        assert refused[-1] == [], (rank, refused[-1][:3])
        want = ["ok"] * len(ROWS)
        want[failed] = "RuntimeError" if rank == 0 else "PeerFailedError"
        assert [kind for kind, _ in outcomes] == want, (rank, outcomes)
