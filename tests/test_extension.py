"""Smoke tests for the native extension pipecore._C."""

import re

import pytest
import torch

import pipecore._C as _C


def test_build_info_keys_and_types():
    info = _C.build_info()
    assert isinstance(info, dict)
    assert set(info) == {"cuda", "nvtx", "testing", "torch_version", "compiler", "libstdcxx_headers"}
    assert info["testing"] is True  # the suite runs on the test variant (make test)
    assert isinstance(info["cuda"], bool)
    assert isinstance(info["nvtx"], bool)
    assert isinstance(info["torch_version"], str)
    assert info["compiler"] and info["libstdcxx_headers"] > 20000000  # e.g. "13.3.0", 20240904


def test_self_check_throws_its_formatted_message_across_the_boundary():
    with pytest.raises(_C.CommError, match=r"^pipecore self-check 3 1\.5$"):
        _C._self_check(3)


def test_build_check_passes_for_this_build():
    from pipecore.tools import build_check
    assert build_check.check() is None


def test_build_check_names_the_compiler_and_the_fix_when_the_extension_crashes():
    from pipecore.tools import build_check
    crash = "import os, signal; import pipecore._C; os.kill(os.getpid(), signal.SIGSEGV)"
    problem = build_check.check(crash)
    assert problem is not None and "died of SIGSEGV" in problem, problem
    info = _C.build_info()
    assert f"compiler {info['compiler']}" in problem and "CC=/usr/bin/gcc CXX=/usr/bin/g++ make install" in problem
    loaded = build_check.loaded_libstdcxx()
    assert "libstdc++" in loaded and loaded in problem.split("loads:")[1], (loaded, problem)  # found, and named


def test_build_info_torch_version_matches_runtime():
    built = _C.build_info()["torch_version"]
    runtime = torch.__version__.split("+")[0]
    # TORCH_VERSION is "MAJOR.MINOR.PATCH" (no local suffix); runtime may be
    # e.g. "2.13.0+cpu" or "2.13.0a0+git...". Empty means the header was absent.
    assert built, "extension was built without TORCH_VERSION"
    m = re.match(r"\d+\.\d+\.\d+", runtime)
    assert m is not None, torch.__version__
    assert m.group(0) == built, (built, torch.__version__)


def test_cuda_flag_consistent_with_torch():
    # A CUDA-enabled extension can only have been built against a CUDA torch.
    if _C.build_info()["cuda"]:
        assert torch.version.cuda is not None
