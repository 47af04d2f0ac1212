import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest
from hypothesis import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the suite writes only into temporary folders: no example database in the checkout (pytest's own cache is
# off in pyproject.toml for the same reason)
settings.register_profile("pipecore", database=None)
settings.load_profile("pipecore")


def _tree_state() -> set[str] | None:
    """What `git status` shows in the checkout (untracked and ignored files included, bytecode caches
    aside), or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--ignored", "--untracked-files=all"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {line for line in out.stdout.splitlines() if "__pycache__" not in line}


def pytest_sessionstart(session):
    session.config._tree_before = _tree_state()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_tree_before", None)
    after = _tree_state() if before is not None else None
    if after is None:
        return
    written = sorted(after - before)
    if written:
        print("\nthe test suite changed the source tree (tests and benches must write only to temporary folders):\n  "
              + "\n  ".join(written), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    from dist_pool import close_all

    close_all()
