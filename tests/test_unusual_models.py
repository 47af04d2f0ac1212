"""Stage modules unlike the usual Linear stacks train exactly like one process under every schedule."""

import pytest

from dist_pool import pool
from unusual_models import KINDS, train_unusual

SCHEDULES = [("gpipe", 4), ("1f1b", 4), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("interleaved_zb", 2),
             ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.exactness
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("name, world", SCHEDULES)
def test_unusual_stage_modules_match_single_process(name, world, kind):
    pool(world).run(train_unusual, name, kind, 13)  # 13 rows: an uneven last microbatch
