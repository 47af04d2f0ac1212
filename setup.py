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
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup

# the torch versions the extension is built and tested against: 2.13, 2.14 and 2.15 (CPU and CUDA wheels),
# and 2.11 with CUDA 13 as a build target (docs/install.md)
TORCH_REQUIREMENT = "torch>=2.11,<2.16"

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
    """The CUDA toolkit to build with: the first of $CUDA_HOME, $CUDA_PATH, torch's guess, /usr/local/cuda
    and /usr/local/cuda-* that holds both nvcc and the runtime's headers. torch guesses from the nvcc on
    PATH (its folder's parent), which is wrong for a wrapper script such as /usr/local/bin/nvcc: the
    headers would not be found. A CPU build still uses the toolkit's header-only NVTX when one is there."""
    candidates = (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME,
                  "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True))
    homes = [h for h in candidates if h and os.path.isdir(h)]
    for home in homes:
        if os.path.isfile(os.path.join(home, "bin", "nvcc")) and \
                os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return homes[0] if homes else None


def _use_cuda(cuda_home):
    if os.environ.get("PIPECORE_NO_CUDA", "0") not in ("", "0"):
        return False
    if torch.version.cuda is None or not cuda_home:
        return False
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    return os.path.isfile(nvcc) and os.access(nvcc, os.X_OK)


def _nvcc_arches(cuda_home):
    """The compute capabilities this nvcc compiles for ("7.5", "12.0", ...), or [] if it cannot say."""
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [f"{int(n) // 10}.{int(n) % 10}" for n in re.findall(r"compute_(\d+)\b", out)]


def _default_cuda_arches(cuda_home):
    """TORCH_CUDA_ARCH_LIST for a CUDA build that sees no GPU (a build or CI machine): torch would pick the
    visible GPUs' architectures, and with none it fails inside cpp_extension (torch 2.15: an IndexError).
    The extension runs wherever the torch it links runs, so it is built for the architectures that torch
    was built for (torch._C._cuda_getArchFlags(): sm_75 to sm_120 for the 2.15 wheel), those this nvcc
    can compile, with PTX of the newest for later GPUs. None: none of them (the CPU variant is built)."""
    built_for = [f"{int(n) // 10}.{int(n) % 10}" for n in re.findall(r"sm_(\d+)\b", torch._C._cuda_getArchFlags())]
    usable = [a for a in built_for if a in set(_nvcc_arches(cuda_home))]
    usable = sorted(set(usable), key=lambda a: tuple(map(int, a.split("."))))
    return ";".join(usable[:-1] + [usable[-1] + "+PTX"]) if usable else None


def _choose_cuda(cuda_home):
    """Whether to build the CUDA variant, setting TORCH_CUDA_ARCH_LIST where no GPU is visible and the
    user set none; a line says what was chosen when it is not the obvious."""
    if not _use_cuda(cuda_home):
        return False
    if not os.path.isfile(os.path.join(cuda_home, "include", "cuda_runtime.h")):
        print(f"pipecore setup.py: the CUDA toolkit at {cuda_home} has no include/cuda_runtime.h: building the CPU "
              "variant. For the CUDA one, set CUDA_HOME to a complete toolkit.")
        return False
    cpp_extension.CUDA_HOME = cuda_home  # torch's include and library paths follow it
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count() > 0:
        return True  # the user's list, or the visible GPUs' (torch's own rule)
    arches = _default_cuda_arches(cuda_home)
    if arches is None:
        print(f"pipecore setup.py: no GPU is visible and nvcc ({cuda_home}) compiles none of the architectures "
              f"torch {torch.__version__} was built for ({torch._C._cuda_getArchFlags()}): building the CPU "
              "variant. For the CUDA one, set TORCH_CUDA_ARCH_LIST (e.g. 9.0) or use a matching CUDA toolkit.")
        return False
    os.environ["TORCH_CUDA_ARCH_LIST"] = arches
    print(f"pipecore setup.py: no GPU is visible: building the CUDA variant for torch's architectures "
          f"TORCH_CUDA_ARCH_LIST={arches} (set TORCH_CUDA_ARCH_LIST to choose others)")
    return True


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
USE_CUDA = _choose_cuda(CUDA_HOME)

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
