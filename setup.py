"""Build script for pipecore and its native extension ``pipecore._C``.

The extension is compiled against the torch that is already installed, so install with
``pip install --no-build-isolation .`` (``-e .`` for a checkout you edit; ``make install`` does
that). pip's default build isolation builds in a new environment without your torch: that fails at
once below with a sentence saying so.

``PIPECORE_TESTING=1`` builds the test variant (``make test`` does): the executor's test hooks and
``csrc/testing/`` compiled in; production builds leave them out.

Objects are kept in ``build/obj-*`` (keyed by Python, torch, CUDA and variant), so a second install
recompiles only what changed, editable installs included (setuptools would otherwise compile in a
new temporary folder each time); ccache is used where it is installed.
"""

import glob
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup

# the torch versions the extension is built and tested against (CPU 2.13, CUDA 13 with 2.11)
TORCH_REQUIREMENT = "torch>=2.11,<2.14"

try:
    import torch
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except (ImportError, OSError) as e:  # OSError: a torch whose libraries do not load
    sys.exit(
        f"pipecore: this build cannot import torch ({e}).\n"
        "pipecore's C++ extension is compiled against the torch that is already installed "
        f"({TORCH_REQUIREMENT}). pip's default build isolation builds in a new environment without the torch "
        "you installed. With torch installed, build without isolation:\n"
        '    pip install "setuptools>=70.1" wheel ninja\n'
        "    pip install --no-build-isolation .        (or: make install, in a checkout)")

ROOT = os.path.dirname(os.path.abspath(__file__))

# torch 2.13 compiles itself (and, by default, extensions) as C++20 and its
# TorchConfig.cmake sets CXX_STANDARD 20; c++17 still compiles the headers
# but with -Wc++20-extensions warnings. Keep in sync with CMakeLists.txt.
CXX_STD = "-std=c++20"


def _rel_sorted(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _cuda_home():
    # Explicit environment first; torch's own detection (nvcc on PATH,
    # /usr/local/cuda) is only populated for CUDA builds of torch. A CPU build still
    # uses the toolkit's header-only NVTX when a toolkit is installed.
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME,
                 "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)):
        if home and os.path.isdir(home):
            return home
    return None


def _use_cuda(cuda_home):
    if os.environ.get("PIPECORE_NO_CUDA", "0") not in ("", "0"):
        return False
    if torch.version.cuda is None or not cuda_home:
        return False
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    return os.path.isfile(nvcc) and os.access(nvcc, os.X_OK)


def _libstdcxx_link_args(cxx=None):
    """The libstdc++ this process loaded with torch, named to the linker where the C++ compiler finds no
    shared libstdc++ of its own: it would link its static one without a word, and an extension with a
    copy of libstdc++'s streams beside torch's crashes the first time it formats a message (seen with
    a GPU image's /opt/gcc; `python -m pipecore.tools.build_check` looks for such a copy)."""
    if not sys.platform.startswith("linux"):
        return []
    command = shlex.split(cxx or os.environ.get("CXX") or "c++")  # "ccache g++" too
    try:
        found = subprocess.run([*command, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return []
    if os.path.isabs(found):  # the compiler links a shared libstdc++ itself
        return []
    with open("/proc/self/maps") as maps:
        loaded = [line.split()[-1] for line in maps if "/libstdc++.so" in line]
    if not loaded:
        print(f"pipecore: {command[0]} finds no shared libstdc++ and torch loaded none here: the extension may "
              "carry a copy of its own (python -m pipecore.tools.build_check will say)", file=sys.stderr)
    return loaded[:1]  # its first mapped segment (a process loads one libstdc++)


def _testing():
    """A test build (`make test`): the executor's test hooks and csrc/testing/ compiled in."""
    return os.environ.get("PIPECORE_TESTING", "0") not in ("", "0")


def _coverage():
    """A coverage build (`make coverage`): gcov counts the lines each test runs (-O0, csrc/ only)."""
    return os.environ.get("PIPECORE_COVERAGE", "0") not in ("", "0")


def _extensions(cuda_home, use_cuda):
    sources = _rel_sorted("csrc/*.cpp")
    define_macros = []
    if _testing():
        sources += _rel_sorted("csrc/testing/*.cpp")
        define_macros.append(("PIPECORE_TESTING", "1"))
    include_dirs = []
    # rpath to torch's lib dir so `import pipecore._C` works even before
    # `import torch` (otherwise the loader cannot find libc10.so/libtorch*.so).
    extra_link_args = [f"-Wl,-rpath,{d}" for d in cpp_extension.library_paths()] + _libstdcxx_link_args()
    cxx_flags = ["-O2", CXX_STD]
    nvcc_flags = ["-O2", CXX_STD]
    if _coverage():
        cxx_flags = ["-O0", "--coverage", CXX_STD]
        extra_link_args.append("--coverage")
        define_macros.append(("PIPECORE_COVERAGE", "1"))

    if use_cuda:
        sources += _rel_sorted("csrc/cuda/*.cpp") + _rel_sorted("csrc/cuda/*.cu")
        define_macros.append(("PIPECORE_CUDA", "1"))

    # NVTX3 is header-only (it dlopen()s the profiler's injection library at
    # runtime, hence -ldl), so it is usable in CPU builds as well.
    if cuda_home and os.path.isfile(os.path.join(cuda_home, "include", "nvtx3", "nvToolsExt.h")):
        include_dirs.append(os.path.join(cuda_home, "include"))
        define_macros.append(("PIPECORE_NVTX", "1"))
        extra_link_args.append("-ldl")

    kwargs = dict(
        name="pipecore._C",
        sources=sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_link_args=extra_link_args,
    )
    if use_cuda:
        from torch.utils.cpp_extension import CUDAExtension

        ext = CUDAExtension(extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, **kwargs)
    else:
        ext = CppExtension(extra_compile_args={"cxx": cxx_flags}, **kwargs)
    return [ext]


def _ccache_dir():
    """The folder of ccache's compiler links (c++, g++, gcc) where ccache is installed, else None."""
    if shutil.which("ccache") is None:
        return None
    for d in ("/usr/lib/ccache", "/usr/lib64/ccache", "/usr/local/lib/ccache", "/opt/homebrew/opt/ccache/libexec",
              "/usr/local/opt/ccache/libexec"):
        if os.path.isfile(os.path.join(d, "c++")):
            return d
    return None


class BuildPipecore(BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension with objects that outlive the build and no debug information."""

    def finalize_options(self):
        super().finalize_options()
        # pip install -e sets build_temp to a new temporary folder: every install would compile everything
        key = f"{sysconfig.get_config_var('SOABI') or sys.implementation.cache_tag}-torch{torch.__version__}-" \
              f"{'cuda' if USE_CUDA else 'cpu'}{'-testing' if _testing() else ''}{'-coverage' if _coverage() else ''}"
        self.build_temp = os.path.join(ROOT, "build", f"obj-{key}")

    def build_extensions(self):
        # Python's own CFLAGS carry -g: debug information for torch's headers makes each unit ~1.6x
        # slower to compile and the library 30x larger. PIPECORE_DEBUG_INFO=1 keeps it.
        if os.environ.get("PIPECORE_DEBUG_INFO", "0") in ("", "0"):
            for name in ("compiler_so", "compiler_so_cxx", "linker_so", "linker_so_cxx"):
                command = getattr(self.compiler, name, None)
                if command:
                    self.compiler.set_executable(name, [f for f in command if f != "-g"])
        ccache = _ccache_dir()
        if ccache and "CXX" not in os.environ:
            # torch's ninja file runs `c++` (and nvcc's host compiler) from PATH: ccache's links come first
            os.environ["PATH"] = ccache + os.pathsep + os.environ.get("PATH", "")
            os.environ.setdefault("CCACHE_BASEDIR", ROOT)  # paths relative to the checkout: clones share the cache
            print(f"pipecore setup.py: compiling through ccache ({ccache})")
        super().build_extensions()


def _version():
    """pipecore/version.py's __version__ (read as text: importing pipecore here would import torch's parts)."""
    import re

    with open(os.path.join(ROOT, "pipecore", "version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read())[1]


CUDA_HOME = _cuda_home()
USE_CUDA = _use_cuda(CUDA_HOME)

# ninja installed into a virtual environment that is not activated (make ... PYTHON=venv/bin/python) is
# not on PATH, and torch looks for it there: without it the build is serial and never incremental
_venv_ninja = os.path.join(sysconfig.get_path("scripts"), "ninja")
if os.path.isfile(_venv_ninja) and shutil.which("ninja") != _venv_ninja:
    os.environ["PATH"] = os.path.dirname(_venv_ninja) + os.pathsep + os.environ.get("PATH", "")

if shutil.which("ninja") is None:
    # BuildExtension falls back to distutils with a warning; say why it is slow.
    print("pipecore setup.py: ninja not found on PATH; extension build will not be parallel")

setup(
    name="pipecore",
    version=_version(),
    description="Pipeline-parallel training executor for PyTorch",
    packages=find_packages(include=["pipecore", "pipecore.*"]),
    python_requires=">=3.11",
    install_requires=[TORCH_REQUIREMENT],
    extras_require={"hf": ["transformers>=5.0,<6"]},  # pipecore.hf: the versions its tests train
    ext_modules=_extensions(CUDA_HOME, USE_CUDA),
    cmdclass={"build_ext": BuildPipecore},
    zip_safe=False,
)
