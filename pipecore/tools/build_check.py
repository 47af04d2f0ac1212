"""Checks a freshly built pipecore._C in a process of its own: `python -m pipecore.tools.build_check`
(`make install` runs it).

An extension compiled by a C++ compiler whose libstdc++ differs from the one loaded with torch can
import fine and crash later, in the middle of a training step, the first time it formats an error
message. That happened on a GPU image whose first g++ on PATH (/opt/gcc) was newer than the
system's: the extension crashed in std::ostringstream; built with /usr/bin/g++ it ran. This runs
what breaks first (a stream, an exception thrown across the module's boundary) and, if the process
dies, says which compiler built the extension, which libstdc++ the process loaded, and what to do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

# what a healthy extension does: format, throw, translate; and where libstdc++ came from
PROBE = """
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


def check(probe: str = PROBE) -> str | None:
    """None if the extension passes `probe` in a fresh process, else what went wrong and the fix."""
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
