"""Checks a freshly built pipecore._C in a process of its own: `python -m pipecore.tools.build_check`
(`make install` runs it).

An extension compiled by a C++ compiler whose libstdc++ differs from the one loaded with torch can
import fine and crash later, in the middle of a training step, the first time it formats an error
message. That happened on a GPU image whose first g++ on PATH (/opt/gcc) has only a static libstdc++:
linked with it, the extension carried its own copy of libstdc++'s streams beside the shared one torch
loads, and crashed in std::ostringstream the first time it reported a failed send (seen again in
November 2026, while this self-check passed: it imported the extension before torch). This runs what
breaks first (a stream, an exception thrown across the module's boundary, with torch imported first
as users do), looks for a copy of libstdc++'s streams inside the extension, and, if either fails,
says which compiler built the extension, which libstdc++ the process loaded, and what to do."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

# what a healthy extension does, with torch loaded first as users have it: format, throw, translate
PROBE = """
import torch
import pipecore._C as C
try:
    C._self_check(7)
except C.CommError as e:
    assert str(e) == "pipecore self-check 7 3.5", str(e)
else:
    raise SystemExit("pipecore._C._self_check raised nothing")
"""


def loaded_libstdcxx() -> str:
    """The libstdc++ a process that imports torch loads (Linux; '' where it cannot be told)."""
    code = ("import torch\n"
            "for line in open('/proc/self/maps'):\n"
            "    if 'libstdc++' in line:\n"
            "        print(line.split()[-1]); break\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


# std::ostream::_M_insert<long>, which formats the numbers of an error message: defined by the shared
# libstdc++, and by an extension linked with the static one
STREAMS_SYMBOL = "_ZNSo9_M_insertIlEERSoT_"

# the file that `library`'s stream code comes from, after torch loaded its libstdc++ (sys.argv[1])
_WHERE_STREAMS = f"""
import ctypes, sys
import torch

class DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

library = ctypes.CDLL(sys.argv[1])
address = ctypes.cast(getattr(library, "{STREAMS_SYMBOL}"), ctypes.c_void_p).value
info = DlInfo()
ctypes.CDLL(None).dladdr(ctypes.c_void_p(address), ctypes.byref(info))
print(info.dli_fname.decode())
"""


def streams_come_from(library: str) -> str:
    """The file that `library`'s std::ostream code resolves to in a process that imported torch first
    (Linux; '' where it cannot be told, and then nothing is refused): `library` itself when it was linked
    with a static libstdc++ (unless that copy's symbols were hidden from the dynamic table)."""
    try:
        out = subprocess.run([sys.executable, "-c", _WHERE_STREAMS, library], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def extension_path() -> str:
    spec = importlib.util.find_spec("pipecore._C")
    if spec is None:
        raise SystemExit("pipecore._C is not built: make install (or pip install --no-build-isolation -e .)")
    return spec.origin


def check(probe: str = PROBE, library: str | None = None) -> str | None:
    """None if the extension passes `probe` in a fresh process and uses the libstdc++ torch loaded,
    else what went wrong and the fix. `library`: the extension's file (the installed one by default)."""
    library = library or extension_path()
    source = streams_come_from(library)
    if source and os.path.realpath(source) == os.path.realpath(library):
        return (f"{library} carries its own copy of libstdc++'s streams (linked from a static libstdc++: its "
                "compiler found no shared one), beside the libstdc++ torch loads "
                f"({loaded_libstdcxx() or 'unknown'}): it crashes the first time it formats a message.\n"
                "Rebuild with a compiler that links the shared libstdc++, for example:\n"
                "  CC=/usr/bin/gcc CXX=/usr/bin/g++ make install")
    try:
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        how, tail = "hung (over 300 s)", []
    else:
        if run.returncode == 0:
            return None
        tail = (run.stderr or run.stdout).strip().splitlines()[-5:]
        how = f"died of {_signal_name(-run.returncode)}" if run.returncode < 0 else \
            f"failed (exit status {run.returncode})"
    built = _built_with()
    cxx = os.environ.get("CXX", "c++ (the first on PATH)")
    return (f"pipecore._C {how} in its self-check (a formatted message thrown across the module's boundary).\n"
            f"  built by: {built}; CXX={cxx}\n"
            f"  this Python with torch loads: {loaded_libstdcxx() or 'an unknown libstdc++'}\n"
            "A compiler whose libstdc++ is not the one loaded with torch builds an extension that crashes like this. "
            "Rebuild with the system compiler torch's libstdc++ comes with, for example:\n"
            "  CC=/usr/bin/gcc CXX=/usr/bin/g++ make install\n"
            + ("  output: " + " | ".join(tail) if tail else ""))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal
        return f"signal {number}"


def _built_with() -> str:
    code = ("import pipecore._C as C; i = C.build_info(); "
            "print(f\"compiler {i['compiler']}, libstdc++ headers of {i['libstdcxx_headers']}\")")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return "an unknown compiler"
    return out.stdout.strip() or "an unknown compiler (build_info crashed too)"


def main() -> int:
    problem = check()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    print("pipecore._C: self-check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
