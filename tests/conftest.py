import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    from dist_pool import close_all

    close_all()
