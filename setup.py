"""Build script for pipecore and its native extension ``pipecore._C``.

Install with ``python3 -m pip install --no-build-isolation -e .`` so the
extension is compiled against the torch that is already installed (torch is
deliberately not listed in install_requires: pip would otherwise resolve and
download a different torch).
"""

import glob
import os
import shutil

from setuptools import find_packages, setup
from torch.utils import cpp_extension
from torch.utils.cpp_extension import BuildExtension, CppExtension

import torch

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


def _extensions():
    cuda_home = _cuda_home()
    use_cuda = _use_cuda(cuda_home)

    sources = _rel_sorted("csrc/*.cpp")
    define_macros = []
    include_dirs = []
    # rpath to torch's lib dir so `import pipecore._C` works even before
    # `import torch` (otherwise the loader cannot find libc10.so/libtorch*.so).
    extra_link_args = [f"-Wl,-rpath,{d}" for d in cpp_extension.library_paths()]
    cxx_flags = ["-O2", CXX_STD]
    nvcc_flags = ["-O2", CXX_STD]

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


if shutil.which("ninja") is None:
    # BuildExtension falls back to distutils with a warning; say why it is slow.
    print("pipecore setup.py: ninja not found on PATH; extension build will not be parallel")

setup(
    name="pipecore",
    version="0.1.0",
    description="Pipeline-parallel training executor for PyTorch",
    packages=find_packages(include=["pipecore", "pipecore.*"]),
    python_requires=">=3.11",
    install_requires=[],
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
