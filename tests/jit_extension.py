"""Test-only C++ extensions, compiled once per machine and torch (torch's JIT build cache) with only the
headers each needs. torch's load_inline puts torch/extension.h, the whole C++ API, above every source:
32 s and 41 s to compile the two tests' extensions on 2 cores, against 8 s and 22 s with their own
headers (compiled in the suite's first use on a fresh machine, and again for each torch)."""

from __future__ import annotations

import os
import tempfile


def load_extension(name: str, source: str, functions: list[str]):
    """`source` (which includes what it uses, pybind11 or torch/csrc/utils/pybind.h among it) compiled as
    module `name` with `functions` bound under their own names."""
    from torch.utils.cpp_extension import _get_build_directory, load

    folder = _get_build_directory(name, verbose=False)  # where load_inline builds, per Python and torch variant
    binding = "".join(f'  m.def("{f}", &{f});\n' for f in functions)
    text = f"{source}\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{binding}}}\n"
    path = os.path.join(folder, f"{name}.cpp")
    try:
        with open(path) as f:
            same = f.read() == text
    except OSError:
        same = False
    if not same:  # rewritten only when it changed (the build is redone when it did); whole, for ranks loading it at once
        fd, temporary = tempfile.mkstemp(dir=folder, suffix=".cpp.tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(temporary, path)
    return load(name, sources=[path], build_directory=folder, verbose=False)
