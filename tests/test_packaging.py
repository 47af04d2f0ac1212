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
