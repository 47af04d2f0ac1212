"""How the tests compare a pipeline's numbers with one process's: one measure, one dtype, one bound.

"The gradients of one process" is a claim about the algorithm, so it is tested where it cannot depend
on which kernel ran: both sides run in float64 (`EXACT_DTYPE`, the default dtype of every test process),
and they must agree within `FLOAT64_BOUND`. fp32 runs stay where fp32 behaviour is the point (the example
GPT as users run it, the demo, autocast, bf16/fp16 boundaries); those compare within `rounding_bound`,
derived from the sums involved at each call site, never tuned to one machine.

The derivation. Two computations of one value that add the same n terms in different orders (the
microbatches one by one against one GEMM over the whole batch, W actions in the schedule's order,
another CPU's GEMM blocking) each differ from the exact sum by at most gamma_n * sum|t|, with
gamma_n = n*u/(1 - n*u) and u the unit roundoff, eps/2 (Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., section 4.2). So they differ from each other by at most about 2 * n * u * sum|t|
= n * eps * sum|t|. The tests measure that difference relative to the tensor's largest entry, and take
sum|t| to be of the order of that entry: rounding errors add like a random walk (sqrt(n) * u, not
n * u), which leaves room for terms whose magnitudes sum to sqrt(n) times the result. An error of the
algorithm (a microbatch lost, counted twice or scaled wrongly, a stale weight) is a relative error of
1/m or more; a float32 step hidden in a float64 path is about 1e-7: both far above these bounds.
"""

from __future__ import annotations

import contextlib
import os

import torch

EXACT_DTYPE = torch.float64


def rounding_bound(dtype: torch.dtype, terms: int) -> float:
    """How far two computations of a sum of `terms` terms, in any order, may be apart in `dtype`,
    relative to the largest entry: terms * eps (the derivation above)."""
    return terms * torch.finfo(dtype).eps


def transformer_terms(*, tokens: int, width: int, mlp_width: int, layers: int, head_width: int, seq_len: int,
                      vocab: int) -> int:
    """The longest sum behind one gradient entry of a decoder-only transformer, for rounding_bound: a
    weight gradient sums over the batch's `tokens`, and its factors went through the sums of every
    block and of the head, forward and backward, whose rounding errors add along the chain (to first
    order). A block's forward sums: its two norms (a mean and a variance each, 4 x width), q, k, v and
    the output projection (4 x width), the MLP's (width, then mlp_width), q.k over a head's width, and
    attention's softmax and weighted sum over the sequence. The head's: its norm (2 x width), the
    logits (width), the softmax over the vocabulary and its gradient's sum (2 x vocab)."""
    block = 9 * width + mlp_width + head_width + 2 * seq_len
    head = 3 * width + 2 * vocab
    return tokens + 2 * (layers * block + head)


# The longest chains of sums behind a float64 gradient in the tests, counted as for fp32 above: the
# example GPT at 8 stages, 8,896 terms (gpt_cases asserts its count is within this), a Linear weight over
# 12 microbatches of 512 rows, 6,144 (memory_cases). 2^14 * 2^-52 = 2^-38 = 3.6e-12.
#
FLOAT64_TERMS = 2 ** 14
FLOAT64_BOUND = rounding_bound(torch.float64, FLOAT64_TERMS)


def after_adamw(lr: float, steps: int, eps: float = 1e-8) -> float:
    """How far weights may be apart after `steps` AdamW steps, relative to the largest (weights and
    gradients of order 1), when every step's gradients were within FLOAT64_BOUND: AdamW's update
    lr * m / (sqrt(v) + eps) moves by at most lr / eps per unit of gradient difference. An entry whose
    gradient is zero in exact arithmetic meets that: attention's key bias, which the softmax cannot
    see, has rounding noise of about 1e-17 for a gradient, and AdamW turns it into steps of about
    lr * 1e-9 that differ from one process's (4.0e-11 after 3 steps of lr 1e-2, measured). What the
    weights compute next (losses, outputs, the next gradients) moves with them: where such an entry
    feeds later sums (a norm's bias, found by tests/config_space.py: 3.9e-12 after one step), the next
    gradients are held to this bound too."""
    return FLOAT64_BOUND * (1 + steps * lr / eps)


def use_exact_dtype() -> None:
    """Every test process makes its models and batches in float64 unless a test names another dtype."""
    torch.set_default_dtype(EXACT_DTYPE)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Tensors made inside take `dtype` by default (a run as users make it, in fp32, say)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def difference(got: torch.Tensor, want: torch.Tensor, label: str | None = None) -> float:
    """The largest |got - want| relative to want's largest entry (examples/gpt.py's relative_difference,
    which the examples print), noted for the suite's summary (see record). Where want is all zeros,
    the largest |got| itself; inf where either side is not finite (a NaN must fail every bound, and
    max() over differences would drop it). `label`: what the summary counts it under (the dtype)."""
    assert got.shape == want.shape, f"shapes {tuple(got.shape)} and {tuple(want.shape)}"
    label = label or str(got.dtype).removeprefix("torch.")
    got, want = got.detach().double(), want.detach().double()
    if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())):
        err = float("inf")
    elif want.numel() == 0:
        err = 0.0
    else:
        largest = float(want.abs().max())
        err = float((got - want).abs().max()) / (largest if largest > 0 else 1.0)
    record(label, err)
    return err


def assert_matches(got: torch.Tensor | None, want: torch.Tensor | None, what: str,
                   bound: float | None = None) -> float:
    """`got` (a pipeline's gradient, output or loss) equals `want` (one process's) within `bound`
    (FLOAT64_BOUND for float64 tensors; a lower-precision comparison must name its derived bound);
    returns the difference. None must meet None: one process leaves .grad None where no forward used
    a parameter."""
    if want is None:
        assert got is None, f"{what}: one process leaves .grad None, the pipeline gave {got}"
        return 0.0
    assert got is not None, f"{what}: missing (one process has it)"
    if not isinstance(want, torch.Tensor):  # losses as Python floats (float64's precision), or lists of them
        got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, one process has {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, one process has {want.dtype}"
    if bound is None:
        assert want.dtype == EXACT_DTYPE, f"{what}: a {want.dtype} comparison needs a bound derived for it"
        bound = FLOAT64_BOUND
    label = None if bound == FLOAT64_BOUND or want.dtype != EXACT_DTYPE else f"float64 within {bound:.1e}"
    err = difference(got, want, label)
    assert err <= bound, f"{what}: {err:.3e} off, relative to the largest entry (bound {bound:.1e})"
    return err


def assert_within(err: float, what: str, bound: float = FLOAT64_BOUND) -> None:
    """A difference a case computed with `difference` (on its own rank) is within `bound`."""
    assert err <= bound, f"{what}: {err:.3e} off, relative to the largest entry (bound {bound:.1e})"


# The suite's summary: every difference measured, by dtype, in a folder the session names
# (conftest.py sets it before any rank is spawned; each process appends to a file of its own).
RECORD_DIR = "PIPECORE_TEST_DIFFERENCES"


def record(label: str, err: float) -> None:
    folder = os.environ.get(RECORD_DIR)
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "a") as f:
            f.write(f"{label}\t{err!r}\n")


def note(line: str) -> None:
    """A line for the suite's closing summary (conftest prints `notes`), e.g. how many configurations a
    generated search ran."""
    folder = os.environ.get(RECORD_DIR)
    if folder:
        with open(os.path.join(folder, "notes.log"), "a") as f:
            f.write(line.replace("\n", " ") + "\n")


def notes(folder: str) -> list[str]:
    path = os.path.join(folder, "notes.log")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return f.read().splitlines()


def summary(folder: str) -> dict[str, tuple[int, float]]:
    """{label: (comparisons, largest difference)} over every file in `folder` (a line a process was
    killed while writing is skipped)."""
    out: dict[str, tuple[int, float]] = {}
    for name in os.listdir(folder):
        if not name.endswith(".txt"):
            continue
        with open(os.path.join(folder, name)) as f:
            for line in f:
                try:
                    label, err = line.rstrip("\n").split("\t")
                    float(err)
                except ValueError:
                    continue
                n, worst = out.get(label, (0, 0.0))
                out[label] = (n + 1, max(worst, float(err)))
    return out
