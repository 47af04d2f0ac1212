"""Smoke tests for the native extension pipecore._C."""

import re

import torch

import pipecore._C as _C


def test_build_info_keys_and_types():
    info = _C.build_info()
    assert isinstance(info, dict)
    assert set(info) == {"cuda", "nvtx", "torch_version"}
    assert isinstance(info["cuda"], bool)
    assert isinstance(info["nvtx"], bool)
    assert isinstance(info["torch_version"], str)


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
