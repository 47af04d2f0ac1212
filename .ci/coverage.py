"""Line coverage of the device path's code (`make coverage`): gcov over the counts that the tests just
run in a coverage build left (under --counts: GCOV_PREFIX's folder), per file, and for the device path's decisions as a whole: the code a GPU
runs and CPU tests run alike (csrc/device_comm.cpp over csrc/device_ops.h, the batches and follow-ups
of device_path.cpp, the stream contract). Exit status 1 when those are below --at-least percent."""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECISIONS = ["csrc/device_comm.cpp", "csrc/device_path.cpp", "csrc/stream_contract.cpp"]
CPU_MODEL = ["csrc/testing/host_device_comm.cpp", "csrc/testing/nccl_model.cpp", "csrc/testing/stream_ledger.cpp"]


def covered(source: str, counts: str) -> tuple[int, int]:
    """(lines run, lines) of `source` in the coverage build's counts."""
    stem = os.path.splitext(source)[0]
    objects = [o for o in glob.glob(os.path.join(ROOT, "build", "obj-*-coverage", "**", "*.o"), recursive=True)
               if o.endswith(stem + ".o")]
    if not objects:
        sys.exit(f"coverage: no object of {source} in build/obj-*-coverage (run `make coverage`)")
    notes = os.path.splitext(os.path.abspath(objects[0]))[0]
    with tempfile.TemporaryDirectory() as scratch:  # gcov wants the notes and the counts side by side
        shutil.copy(notes + ".gcno", scratch)
        if os.path.exists(counts + notes + ".gcda"):
            shutil.copy(counts + notes + ".gcda", scratch)
        out = subprocess.run(["gcov", "-n", "-o", scratch, os.path.join(ROOT, source)],
                             cwd=scratch, capture_output=True, text=True, check=True).stdout
    for name, percent, lines in re.findall(r"File '([^']+)'\nLines executed:([\d.]+)% of (\d+)", out):
        if os.path.realpath(os.path.join(ROOT, name)) == os.path.realpath(os.path.join(ROOT, source)):
            return round(float(percent) * int(lines) / 100), int(lines)
    sys.exit(f"coverage: gcov said nothing of {source} (no counts: were the tests run on the coverage build?)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--counts", required=True, help="the folder GCOV_PREFIX named while the tests ran")
    parser.add_argument("--at-least", type=float, default=90.0)
    args = parser.parse_args()
    rows = {source: covered(source, os.path.abspath(args.counts)) for source in DECISIONS + CPU_MODEL}
    print(f"{'file':42} {'lines run':>10} {'of':>6} {'%':>7}")
    for source, (run, lines) in rows.items():
        print(f"{source:42} {run:10d} {lines:6d} {100 * run / max(lines, 1):7.1f}")
    run = sum(rows[s][0] for s in DECISIONS)
    lines = sum(rows[s][1] for s in DECISIONS)
    share = 100 * run / max(lines, 1)
    print(f"{'the device path decisions (first three)':42} {run:10d} {lines:6d} {share:7.1f}")
    if share < args.at_least:
        sys.exit(f"coverage: the device path's decisions at {share:.1f}%, below {args.at_least}%")


if __name__ == "__main__":
    main()
