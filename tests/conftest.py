import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
# torch's own schedule builders for side-by-side checks live with the benchmarks (bench/torch_schedules.py), the
# example GPT and the example scripts' arguments with the examples (examples/gpt.py)
for folder in ("bench", "examples"):
    sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), folder))

import pytest
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the suite writes only into temporary folders: hypothesis keeps no example database and its caches in a
# temporary folder, not in the checkout (pytest's own cache is off in pyproject.toml for the same reason)
settings.register_profile("pipecore", database=None)
settings.load_profile("pipecore")
HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="pipecore-hypothesis-")
set_hypothesis_home_dir(HYPOTHESIS_HOME)

# exactness is tested in float64 (tests/exactness.py); every difference from one process measured in this
# session, in any process, lands in this folder for the summary at the end
import exactness  # noqa: E402

# pytest-xdist's workers (`make test` runs the suite in two) inherit the controller's environment: they record
# into its folder, and the controller alone reports, removes it and checks the tree
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
DIFFERENCES = os.environ[exactness.RECORD_DIR] if WORKER else tempfile.mkdtemp(prefix="pipecore-differences-")
os.environ[exactness.RECORD_DIR] = DIFFERENCES


def _tree_state() -> set[str] | None:
    """The checkout's untracked and ignored files, as `git status` lists them (bytecode caches aside; a
    tracked file edited while the suite runs is the developer's), or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--ignored", "--untracked-files=all"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {line for line in out.stdout.splitlines() if line[:2] in ("??", "!!") and "__pycache__" not in line}


# Where torch versions differ: torch.distributed.pipelining's surface (action kinds, schedule arguments,
# its CSVs), FSDP2's internals, TorchTitan, the build and its metadata. `-m versions` selects them
# (.ci/run runs them, with every exactness test, on the newest torch too).
VERSION_SENSITIVE = {"test_action.py", "test_builders.py", "test_compat.py", "test_csv_and_format.py",
                     "test_lowering.py", "test_packaging.py", "test_torchtitan.py", "test_wrapped_stages.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in VERSION_SENSITIVE:
            item.add_marker(pytest.mark.versions)


def pytest_sessionstart(session):
    session.config._tree_before = None if WORKER else _tree_state()
    try:
        import torch  # before the extension: it links torch's libraries, which torch itself loads first

        exactness.use_exact_dtype()
        import pipecore._C as C
    except ImportError as exc:
        pytest.exit(f"pipecore._C does not load ({exc}): run `make test`, which builds it", returncode=4)
    if not C.build_info().get("testing"):
        pytest.exit("pipecore._C is a production build: the suite drives the executor's test hooks (delays, the "
                    "device protocol on the host), which only the test variant has. Run `make test` (or "
                    "`make install-test` and then pytest)", returncode=4)


def pytest_terminal_summary(terminalreporter):
    """The largest difference from a reference (one process, or torch's runtime) that this session
    measured, by dtype (and, for float64 held to a bound of its own, by that bound)."""
    for label, (n, worst) in sorted(exactness.summary(DIFFERENCES).items()):
        terminalreporter.write_line(f"exactness: {label}: {n} comparisons with a reference, largest difference "
                                    f"{worst:.2e} of the largest entry")
    for line in exactness.notes(DIFFERENCES):
        terminalreporter.write_line(line)


def pytest_unconfigure(config):
    if not WORKER:
        shutil.rmtree(DIFFERENCES, ignore_errors=True)  # after the terminal summary read it


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(HYPOTHESIS_HOME, ignore_errors=True)
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
