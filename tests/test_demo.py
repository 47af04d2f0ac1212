"""The front door: `make demo`'s own command, run as a newcomer would, from an empty working directory
with its timeline and checkpoint under folders that do not exist yet; resumed from that checkpoint; and
one rank's failure named on every rank."""

import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from exactness import default_dtype, rounding_bound
from gpt import GPTConfig
from gpt_cases import gradient_terms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")



def demo_bound() -> float:
    """The demo's model (train_gpt.py's defaults: 6 blocks of width 128, 4 heads, 64 tokens, 32 rows a step)
    in fp32: its first step's gradients are within the rounding of its longest sums (25,728 terms: 3.1e-3)."""
    import train_gpt

    args = train_gpt.parse_args([])
    cfg = GPTConfig(seq_len=args.seq_len, width=args.width, heads=args.heads, layers=args.layers)
    return rounding_bound(torch.float32, gradient_terms(cfg, tokens=args.rows * args.seq_len))



def demo_command(steps: int, demo_dir: str) -> list[str]:
    """The command `make demo STEPS=steps DEMO_DIR=demo_dir` runs (read from the Makefile, so the two
    cannot drift apart)."""
    out = subprocess.run(["make", "--no-print-directory", "-n", "-C", ROOT, "demo", f"STEPS={steps}",
                          f"DEMO_DIR={demo_dir}", f"PYTHON={sys.executable}"],
                         capture_output=True, text=True, timeout=60, check=True)
    lines = out.stdout.replace("\\\n", " ").splitlines()
    command = [shlex.split(line) for line in lines if "examples/train_gpt.py" in line]
    assert len(command) == 1, out.stdout
    return [os.path.join(ROOT, a) if a == "examples/train_gpt.py" else a for a in command[0]]


def run(command: list[str], cwd, timeout=400) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def losses(stdout: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step +(\d+)/\d+ +loss (\S+)", stdout)}


@pytest.mark.slow
def test_demo_trains_writes_its_files_and_resumes(tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    demo_dir = os.path.join("out", "new")  # relative to the working directory, and not there yet
    first = run(demo_command(4, demo_dir), work)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    grads = re.search(r"gradients of step 0 within ([0-9.e+-]+)", first.stdout)
    assert grads and float(grads.group(1)) <= demo_bound(), first.stdout
    timeline = work / demo_dir / "gpt_timeline.png"
    assert timeline.stat().st_size > 10_000, "the timeline picture is missing or empty"
    assert str(timeline) in first.stdout  # the demo names where it wrote it
    checkpoint = work / demo_dir / "checkpoint"
    assert (checkpoint / ".metadata").is_file(), sorted(os.listdir(work / demo_dir))
    assert "sample (the prompt, then what the model wrote)" in first.stdout

    assert sorted(os.listdir(work)) == ["out"]  # nothing else in the working directory


@pytest.mark.slow
def test_the_demo_resumed_gives_the_losses_of_one_run(tmp_path):
    """4 steps, then resumed from their checkpoint for 2 more: the same losses as 6 steps in one go (the demo's
    command on a smaller model: the demo's own run is the test above)."""
    small = ["--width", "32", "--heads", "2", "--seq-len", "16", "--rows", "8", "--timeline", "",
             "--sample-tokens", "0", "--check-steps", "0"]
    checkpoint = os.path.join("out", "checkpoint")

    def train(steps: int, *more: str) -> subprocess.CompletedProcess:
        out = run([sys.executable, SCRIPT, *demo_command(steps, "unused")[2:], *small, *more], tmp_path)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out

    train(4, "--checkpoint-dir", checkpoint)
    resumed = train(6, "--checkpoint-dir", checkpoint, "--resume")
    assert f"resumed from {checkpoint} at step 4" in resumed.stdout, resumed.stdout
    straight = train(6, "--checkpoint-dir", "")
    after = losses(resumed.stdout)
    assert set(after) == {5, 6}, resumed.stdout
    assert after == {s: v for s, v in losses(straight.stdout).items() if s in after}, (resumed.stdout, straight.stdout)


def test_one_rank_failing_is_named_on_every_rank(tmp_path):
    """Rank 0 alone fails after the last step (its timeline's folder cannot be made): every rank says
    so, instead of gloo's "Connection closed by peer" tracebacks, and nobody waits out a timeout (the
    example's is 300 s, longer than this run may take: it takes 14 s alone, and 120 s was too short
    beside three other suites on 2 cores)."""
    out = run([sys.executable, SCRIPT, "--ranks", "4", "--cpu", "--steps", "1", "--width", "32", "--heads", "2",
               "--seq-len", "16", "--rows", "8", "--sample-tokens", "0", "--check-steps", "0",
               "--timeline", "/dev/null/timeline.png"], tmp_path, timeout=280)
    assert out.returncode != 0
    error = "rank 0 failed: FileExistsError: [Errno 17] File exists: '/dev/null'"
    for rank in range(4):
        assert re.search(rf"^\[rank {rank}\] .*{re.escape(error)}", out.stderr, re.M), (rank, out.stderr[-4000:])
    # the ranks that stopped because of it print one line each, not a traceback, and said so in time
    assert out.stderr.count("Traceback (most recent call last)") <= 2, out.stderr[-4000:]  # rank 0's and torchrun's
    assert "not every rank said it stopped" not in out.stderr, out.stderr[-4000:]


def test_a_rank_says_its_line_in_one_write(monkeypatch):
    """Every rank prints its line at once into torchrun's one pipe. Where Python runs unbuffered
    (PYTHONUNBUFFERED=1, as here and in many containers), print() writes a line and its newline apart,
    and another rank's line landed in between: '[rank 2] stopped: ...[rank 3] stopped: ...' (the test
    above failed so in 1 of 26 runs beside two CPU burners). say() writes each line whole."""
    import io

    import first_failure

    class Writes(io.RawIOBase):
        def __init__(self):
            self.seen = []

        def writable(self):
            return True

        def write(self, data):
            self.seen.append(bytes(data))
            return len(data)

    unbuffered = Writes()  # what PYTHONUNBUFFERED=1 makes of sys.stderr: no buffer, every write goes out
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(unbuffered, write_through=True))
    print("[rank 2] stopped: print", file=sys.stderr, flush=True)
    first_failure.say("[rank 2] stopped: say")
    assert unbuffered.seen == [b"[rank 2] stopped: print", b"\n", b"[rank 2] stopped: say\n"], unbuffered.seen


@pytest.mark.parametrize("ending", ["close", "failed"])
def test_no_watching_thread_is_left_when_a_rank_leaves(ending, monkeypatch, capsys):
    """The watching thread has ended when close() or failed() returns. A daemon thread still inside a
    store call when the interpreter exits aborts the process ("terminate called without an active
    exception", exit code -6): `make demo` failed so in about 1 of 10 runs, a rank gone after its last
    line. The watcher here calls the store without pause, so it is inside a call whenever it can be."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    import first_failure

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))  # noqa: F841
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    watch = first_failure.FirstFailure(poll_seconds=0.0)
    assert watch.watcher.is_alive()
    if ending == "close":
        watch.close()
    else:
        with pytest.raises(SystemExit):
            watch.failed(RuntimeError("this rank's error"))
        assert "[rank 0] rank 0 failed: RuntimeError: this rank's error" in capsys.readouterr().err
    assert not watch.watcher.is_alive()


QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


def test_readme_quickstart_is_the_example_file():
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"`examples/quickstart.py`.*?```python\n(.*?)```", readme, re.S)
    assert block, "the README's quickstart block is missing"
    assert block.group(1) == open(QUICKSTART).read()


def test_quickstart_trains_as_one_process_would(tmp_path):
    """The quickstart on 2 ranks (torchrun, as the README says to run it) prints the losses of the same
    model trained in one process: its model and data lines run here, the loop as one process would."""
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", QUICKSTART],
              tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    printed = re.findall(r"step (\d+): loss (\S+)", out.stdout)
    assert [int(s) for s, _ in printed] == [20, 40, 60, 80, 100], out.stdout

    source = open(QUICKSTART).read()
    definitions = source[:source.index("dist.init_process_group")]  # imports and the model's classes
    setup = source[source.index("torch.manual_seed(0)"):source.index("sched = ")]  # the model and the teacher
    scope = {}
    expected = {}
    with default_dtype(torch.float32):  # the quickstart's dtype
        exec(definitions + setup, scope)
        model, teacher = scope["model"], scope["teacher"]
        opt = torch.optim.AdamW(model.parameters(), lr=float(re.search(r"lr=([0-9.e-]+)", source).group(1)))
        for step in range(100):
            x = torch.randn(32, 64)
            loss = torch.nn.functional.mse_loss(model(x), teacher(x))
            loss.backward()
            opt.step()
            opt.zero_grad()
            expected[step + 1] = loss.item()
    for step, value in printed:  # printed to 4 decimals; the two runs' rounding may differ in the last bits
        assert abs(float(value) - expected[int(step)]) <= 1e-4, (step, value, expected[int(step)])
