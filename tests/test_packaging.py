"""Packaging: pip's default build isolation fails at once saying what to type; the installed package
declares the torch versions it supports."""

import importlib.metadata
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESSAGE = ("pipecore's C++ extension is compiled against the torch that is already installed",
           "pip install --no-build-isolation .")


def test_setup_without_torch_says_why_and_what_to_type(tmp_path):
    """setup.py where torch cannot be imported (what an isolated build environment is)."""
    code = f"import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; " \
           f"exec(compile(open({os.path.join(ROOT, 'setup.py')!r}).read(), 'setup.py', 'exec'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 1
    for part in MESSAGE:
        assert part in out.stderr, out.stderr


def test_pip_install_with_build_isolation_fails_at_once(tmp_path):
    """`pip wheel .` as most users type it (build isolation on): it stops while asking for the build's
    requirements, with the sentence above, before compiling anything."""
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), tmp_path)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "wheels"), "."],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    text = out.stdout + out.stderr
    if "Getting requirements to build wheel" not in text:
        pytest.skip(f"pip could not set up an isolated build environment here: {text[-500:]}")
    assert out.returncode != 0
    for part in MESSAGE:
        assert part in text, text
    assert not (tmp_path / "wheels").exists() or not os.listdir(tmp_path / "wheels")


def test_installed_package_declares_the_torch_it_supports():
    """setup.py's TORCH_REQUIREMENT is in the installed metadata and admits the torch this runs with."""
    import re

    import torch
    from packaging.requirements import Requirement

    declared = Requirement(re.search(r'TORCH_REQUIREMENT = "([^"]+)"', open(os.path.join(ROOT, "setup.py")).read())[1])
    requires = [Requirement(r) for r in importlib.metadata.requires("pipecore") or []]
    assert any(r.name == "torch" and r.specifier == declared.specifier for r in requires), (declared, requires)
    assert declared.specifier.contains(torch.__version__.split("+")[0]), (declared, torch.__version__)


def test_pip_keeps_the_installed_torch(tmp_path):
    """`pip install --no-build-isolation .` resolves nothing for torch: the one installed satisfies
    the requirement (a newer torch than the pin allowed once made pip plan to replace it)."""
    import json

    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), tmp_path)
    shutil.copytree(os.path.join(ROOT, "pipecore"), tmp_path / "pipecore",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                          "--report", str(report), "."], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PIPECORE_NO_CUDA": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    planned = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert planned == ["pipecore"], planned


def _setup_says(tmp_path, **env) -> subprocess.CompletedProcess:
    """setup.py --version run as pip runs it, in a copy (nothing is built)."""
    setup_py = os.path.join(ROOT, "setup.py")
    code = f"import sys; sys.argv = ['setup.py', '--version']; __file__ = {setup_py!r}; " \
           f"exec(compile(open(__file__).read(), 'setup.py', 'exec'))"
    environment = {k: v for k, v in os.environ.items() if k not in ("TORCH_CUDA_ARCH_LIST", "PIPECORE_NO_CUDA")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**environment, **env})


def test_a_cuda_torch_without_a_gpu_builds_for_torchs_own_architectures(tmp_path):
    """The default (CUDA) wheel with nvcc on a machine without a GPU: torch's cpp_extension would look
    for the visible GPUs' architectures and fail (torch 2.15: IndexError); setup.py picks the
    architectures that torch was built for, those nvcc compiles, and says so in one line."""
    import torch

    if torch.version.cuda is None or shutil.which("nvcc") is None:
        pytest.skip("needs a CUDA build of torch and nvcc (the default wheel on a machine with a toolkit)")
    if torch.cuda.device_count() > 0:
        pytest.skip("a GPU is visible: torch picks its architectures")
    import re

    out = _setup_says(tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = re.search(r"no GPU is visible: building the CUDA variant for torch's architectures "
                     r"TORCH_CUDA_ARCH_LIST=(\S+)", out.stdout)
    assert line, out.stdout
    wanted = {f"{int(n) // 10}.{int(n) % 10}" for n in re.findall(r"sm_(\d+)", torch._C._cuda_getArchFlags())}
    chosen = line[1].split(";")
    assert chosen[-1].endswith("+PTX") and {a.removesuffix("+PTX") for a in chosen} <= wanted, (chosen, wanted)
    assert _setup_says(tmp_path, TORCH_CUDA_ARCH_LIST="9.0").stdout.count("no GPU is visible") == 0
    assert "no GPU is visible" not in _setup_says(tmp_path, PIPECORE_NO_CUDA="1").stdout
