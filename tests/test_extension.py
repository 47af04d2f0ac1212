"""Smoke tests for the native extension pipecore._C."""

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

import pipecore._C as _C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


STREAMS = '#include <sstream>\nextern "C" int format(long v) { std::ostringstream os; os << v; return (int)os.str().size(); }\n'


@pytest.mark.skipif(shutil.which("g++") is None or not sys.platform.startswith("linux"), reason="needs g++ on Linux")
def test_build_check_finds_a_copy_of_libstdcxx_inside_the_extension(tmp_path):
    """A library linked with the static libstdc++ (what a compiler without a shared one does silently)
    carries its own streams beside torch's: refused, naming the fix; one linked with the shared
    libstdc++ uses torch's."""
    from pipecore.tools import build_check
    (tmp_path / "streams.cpp").write_text(STREAMS)
    libraries = {}
    for how, flags in [("static", ["-static-libstdc++"]), ("shared", [])]:
        libraries[how] = str(tmp_path / f"lib{how}.so")
        subprocess.run(["g++", "-shared", "-fPIC", "-O1", str(tmp_path / "streams.cpp"), "-o", libraries[how], *flags],
                       check=True, timeout=120)
    assert os.path.realpath(build_check.streams_come_from(libraries["static"])) == os.path.realpath(libraries["static"])
    assert "libstdc++" in build_check.streams_come_from(libraries["shared"])
    problem = build_check.check(library=libraries["static"])
    assert problem and "carries its own copy of libstdc++'s streams" in problem and "CXX=/usr/bin/g++" in problem
    assert build_check.check(library=build_check.extension_path()) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_setup_links_torchs_libstdcxx_where_the_compiler_has_only_a_static_one(tmp_path):
    """setup.py names the libstdc++ torch loaded to the linker when the C++ compiler finds no shared one
    (a compiler like that asked for libstdc++.so answers with the bare name), and adds nothing otherwise."""
    source = open(os.path.join(ROOT, "setup.py")).read()
    helper = next(node for node in ast.parse(source).body
                  if isinstance(node, ast.FunctionDef) and node.name == "_libstdcxx_link_args")
    scope = {"os": os, "sys": sys, "subprocess": subprocess, "shlex": shlex}
    exec(compile(ast.Module([helper], type_ignores=[]), "setup.py", "exec"), scope)
    static_only = tmp_path / "c++"
    static_only.write_text("#!/bin/sh\necho libstdc++.so\n")
    static_only.chmod(0o755)
    named = scope["_libstdcxx_link_args"](str(static_only))
    loaded = [line.split()[-1] for line in open("/proc/self/maps") if "/libstdc++.so" in line]
    assert len(named) == 1 and named[0] in loaded, (named, loaded)
    shared = tmp_path / "c++-shared"
    shared.write_text(f"#!/bin/sh\necho {loaded[0]}\n")
    shared.chmod(0o755)
    assert scope["_libstdcxx_link_args"](str(shared)) == []
