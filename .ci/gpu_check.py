"""`make gpu-check`: first contact with a GPU machine, in at most 15 minutes (the build before it at
most 5). Prints a table: each check, ok / FAIL / skipped (with the reason, e.g. a part that needs 2 GPUs
on a machine with one), its seconds and what it saw. Exit status 1 if a check failed. Every command
runs with NCCL_DEBUG=WARN (unless set) and a timeout of its own.

  test_cuda.py::<case>                   tests/test_cuda.py, each case in a process of its own: the CUDA
                                         code on one GPU (NCCL loopback; a steady step's host
                                         synchronisations under set_sync_debug_mode("error"))
  probe <name>                           world-of-one probes of NCCL and c10d (.ci/gpu_probes.py): a
                                         coalesced send/receive to self behind a long kernel, a failed
                                         posting's group ended before or after the abort, a channel's
                                         connection (seconds, device memory, store operations)
  train_gpt <schedule> (2 GPUs)          examples/train_gpt.py --check-steps on 1f1b, interleaved_1f1b,
                                         zbv and dualpipev, against one process
  ... no caching allocator (2 GPUs)      the same with PYTORCH_NO_CUDA_MEMORY_CACHING=1: losses bit for bit
  host syncs per steady step (nsys)      cudaStreamSynchronize/cudaDeviceSynchronize/cudaEventSynchronize
                                         calls of a 1f1b run, per step (where nsys is on PATH)
  stopped rank (2 GPUs)                  kill -STOP of a rank: CommunicationError with the abort
  growth past 8 MiB, complex64 boundary, variable_shapes on one rank (2 GPUs): .ci/gpu_cases.py
  train_gpt <schedule>, 3 ranks[, lazy group] (3 GPUs)
                                         two stages per rank on 3 ranks, on a group made with device_id
                                         and on "cpu:gloo,cuda:nccl" without it (communicators connected
                                         before the first step: docs/cuda.md)

`--cpu` runs the multi-rank parts on CPU processes over gloo, and the probes that can (the script's own
dry run). The table also goes to table.txt and every command's output to output.log in $GPU_CHECK_OUT
(default build/gpu-check; `--out` overrides).
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2)]
OUTPUTS: list[str] = []  # every command run and what it printed, for output.log
DEADLINE = time.monotonic() + 15 * 60  # the whole check's


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.split("/")[2]))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_tree(pid: int) -> None:
    for p in [*descendants(pid), pid]:  # SIGKILL ends a stopped process too
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(cmd, timeout, env=None):
    """(exit status or None on timeout, output); whatever it started is killed at the end. No command runs
    past the check's deadline."""
    timeout = max(1.0, min(timeout, DEADLINE - time.monotonic()))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"), **(env or {})})
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # a stopped rank holds the output open
        out, _ = proc.communicate()
        code = None
    finally:
        kill_tree(proc.pid)
    OUTPUTS.append(f"$ {' '.join(map(str, cmd))}\n(exit {code})\n{out}\n")
    return code, out


def torchrun(args, timeout, env=None, ranks=2):
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args],
               timeout, env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the multi-rank parts on CPU processes over gloo")
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT") or os.path.join(ROOT, "build", "gpu-check"),
                    help="folder for table.txt and output.log (default: $GPU_CHECK_OUT, else build/gpu-check)")
    args = ap.parse_args()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    two, three = args.cpu or gpus >= 2, args.cpu or gpus >= 3
    why_not_two = f"needs 2 GPUs (this machine has {gpus})"
    cpu = ["--cpu"] if args.cpu else []
    rows: list[tuple[str, str, float, str]] = []

    def check(name, fn, needs_two=False, skip=None, needs_three=False):
        if needs_two and not two:  # the first reason
            skip = why_not_two
        if needs_three and not three:
            skip = f"needs 3 GPUs (this machine has {gpus})"
        if not skip and time.monotonic() > DEADLINE - 30:
            skip = "no time left (the whole check takes at most 15 minutes)"
        if skip:
            rows.append((name, "skipped", 0.0, skip))
            return
        start = time.monotonic()
        try:
            problem = fn()
        except Exception as exc:  # noqa: BLE001 - a row of the table
            problem = f"{type(exc).__name__}: {exc}"
        passed = not problem or problem.startswith("ok: ")
        rows.append((name, "ok" if passed else "FAIL", time.monotonic() - start,
                     (problem or "").removeprefix("ok: ")))

    def cuda_case(case):
        code, out = run([sys.executable, "-m", "pytest", "-q", "-rfEs", case], 150)
        tail = out.strip().splitlines()[-1] if out.strip() else ""
        return f"ok: {tail}" if code == 0 else ("timed out after 150 s" if code is None else f"exit {code}: {tail}")

    if gpus:
        _, listed = run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_cuda.py"], 120)
        for case in [line for line in listed.splitlines() if line.startswith("tests/test_cuda.py::")]:
            check(case.removeprefix("tests/"), lambda case=case: cuda_case(case))
    else:
        check("tests/test_cuda.py", None, skip="no CUDA GPU")

    def probe(name):
        code, out = run([sys.executable, ".ci/gpu_probes.py", name, *cpu], 60)
        found = re.findall(r"RESULT (ok|FAIL) (.*)", out)
        if not found:
            return f"reported nothing ({'timed out after 60 s' if code is None else f'exit {code}'}): " \
                   f"{out.strip().splitlines()[-1:]}"
        result, detail = found[-1]
        return f"ok: {detail}" if result == "ok" else detail

    for name in ("self_wait", "group_end_first", "abort_first", "channel"):
        check(f"probe {name}", lambda name=name: probe(name),
              skip=None if gpus or (args.cpu and name == "channel") else "needs a CUDA GPU (NCCL)")

    def train(schedule, stages, env=None):
        """(exact losses per step, the "vs one process" differences it printed, a problem or "")."""
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "losses")
            code, out = torchrun(["examples/train_gpt.py", "--schedule", schedule, "--stages-per-rank", str(stages),
                                  "--steps", "4", "--check-steps", "2", "--timeline", "", "--sample-tokens", "0",
                                  "--losses-file", path, *cpu], 120, env)
            if code != 0:
                return None, "", f"exit {code}: {out.strip().splitlines()[-1] if out.strip() else ''}"
            with open(path) as f:
                exact = f.read().split()
        found = re.findall(r"vs one process: (\w+) (?:of step \d+|after \d+ AdamW steps) within (\S+)", out)
        within = ", ".join(f"{what} within {value}" for what, value in found)
        return exact, within, ""

    first = {}
    for schedule, stages in SCHEDULES:
        def one(schedule=schedule, stages=stages):
            got, within, problem = train(schedule, stages)
            first[schedule] = got
            return problem or f"ok: vs one process, {within}"
        check(f"train_gpt {schedule}", one, needs_two=True)
    for schedule, stages in SCHEDULES:
        def uncached(schedule=schedule, stages=stages):
            got, _, problem = train(schedule, stages, {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
            if problem:
                return problem
            if got != first.get(schedule):
                return f"losses {got} where the caching allocator gave {first.get(schedule)}"
            return f"ok: {len(got)} losses bit for bit"
        check(f"train_gpt {schedule}, no caching allocator", uncached, needs_two=True,
              skip=None if first.get(schedule) else "its run with the caching allocator did not finish")

    def host_syncs():
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "run")
            code, out = run(["nsys", "profile", "-t", "cuda", "-o", report, sys.executable, "-m",
                             "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "examples/train_gpt.py",
                             "--schedule", "1f1b", "--steps", "6", "--check-steps", "0", "--timeline", ""], 240)
            if code != 0:
                return f"nsys exit {code}"
            code, stats = run(["nsys", "stats", "-r", "cuda_api_sum", "-f", "csv", report + ".nsys-rep"], 120)
        rows = list(csv.reader(line for line in stats.splitlines() if line.count(",") >= 2))
        head = next((r for r in rows if "Num Calls" in r and "Name" in r), None)
        if head is None:
            return f"nsys stats printed no cuda_api_sum table: {stats.strip().splitlines()[-1:]}"
        calls = sum(int(float(r[head.index("Num Calls")])) for r in rows[rows.index(head) + 1:]
                    if len(r) == len(head) and "Synchronize" in r[head.index("Name")])
        return f"ok: {calls} synchronisations in 6 steps (setup included): compare docs/cuda.md's host waits"

    check("host syncs per steady step (nsys)", host_syncs, needs_two=True,
          skip=None if shutil.which("nsys") else "nsys is not on PATH")

    def case(name, expect_ranks=(0, 1), timeout=180):
        code, out = torchrun([".ci/gpu_cases.py", name, *cpu], timeout)
        # (two ranks' lines may interleave on one line)
        results = {m[0]: f"{m[1]} {m[2].strip()}".strip()
                   for m in re.findall(r"RESULT (\d+) (ok|FAIL)(.*?)(?=RESULT \d+ |\n|$)", out)}
        missing = [r for r in expect_ranks if str(r) not in results]
        if missing:
            return f"ranks {missing} reported nothing (exit {code}): {out.strip().splitlines()[-1:] }"
        bad = {r: v for r, v in results.items() if int(r) in expect_ranks and not v.startswith("ok")}
        return "; ".join(f"rank {r}: {v}" for r, v in bad.items())

    for schedule in ("interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"):
        for lazy in ([False] if args.cpu else [False, True]):
            def three_ranks(schedule=schedule, lazy=lazy):
                code, out = torchrun(["examples/train_gpt.py", "--schedule", schedule, "--stages-per-rank", "2",
                                      "--steps", "3", "--check-steps", "2", "--timeline", "", "--sample-tokens", "0",
                                      *(["--lazy-group"] if lazy else []), *cpu], 180, ranks=3)
                if code != 0:
                    return f"exit {code}: {out.strip().splitlines()[-1] if out.strip() else ''}"
                found = re.findall(r"vs one process: (\w+) (?:of step \d+|after \d+ AdamW steps) within (\S+)", out)
                return "ok: vs one process, " + ", ".join(f"{what} within {value}" for what, value in found)
            check(f"train_gpt {schedule}, 3 ranks{', lazy group' if lazy else ''}", three_ranks, needs_three=True)

    check("stopped rank (kill -STOP)", lambda: case("stopped_rank", expect_ranks=(0,), timeout=40), needs_two=True)
    check("growth past 8 MiB (64 MiB)", lambda: case("growth"), needs_two=True)
    check("complex64 and int16 boundary", lambda: case("complex_boundary"), needs_two=True)
    check("variable_shapes on one rank only", lambda: case("shapes_on_one_rank"), needs_two=True)

    width = max(len(r[0]) for r in rows)
    table = [f"{'check':<{width}}  {'result':<7}  {'s':>6}  detail"]
    table += [f"{name:<{width}}  {result:<7}  {seconds:6.1f}  {detail}" for name, result, seconds, detail in rows]
    print("\n" + "\n".join(table))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(f"torch {torch.__version__}, {gpus} GPU(s)"
                f"{': ' + torch.cuda.get_device_name() if gpus else ''}\n" + "\n".join(table) + "\n")
    with open(os.path.join(args.out, "output.log"), "w") as f:
        f.writelines(OUTPUTS)
    print(f"table: {os.path.join(args.out, 'table.txt')}, every command's output: {os.path.join(args.out, 'output.log')}")
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
