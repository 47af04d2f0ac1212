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


# The tests' longest sums in float64 have at most 4,096 terms (a weight gradient over every row of a
# batch, a dot product over a layer's width, the microbatches of a step): 4096 * 2^-52 = 2^-40 = 9.1e-13.
FLOAT64_TERMS = 4096
FLOAT64_BOUND = rounding_bound(torch.float64, FLOAT64_TERMS)


def after_adamw(lr: float, steps: int, eps: float = 1e-8) -> float:
    """How far weights may be apart, relative to the largest, after `steps` AdamW steps from equal
    weights whose gradients were within FLOAT64_BOUND of each other (the largest gradient about 1):
    an update lr * m / (sqrt(v) + eps) moves by at most lr / eps per unit of gradient difference (an
    entry whose gradient is near zero flips the sign of its update). What those weights compute next
    (losses, outputs, the next gradients) is compared within the same bound."""
    return steps * lr / eps * FLOAT64_BOUND


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


def difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| relative to want's largest entry (the largest |got| where want is all
    zeros; examples/gpt.py prints the same measure), noted for the suite's summary (see record)."""
    dtype = got.dtype
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return 0.0
    largest = float(want.abs().max())
    err = float((got - want).abs().max()) / (largest if largest > 0 else 1.0)
    record(dtype, err)
    return err


def assert_matches(got: torch.Tensor | None, want: torch.Tensor | None, what: str,
                   bound: float | None = None) -> None:
    """`got` (a pipeline's gradient, output or loss) equals `want` (one process's) within `bound`
    (FLOAT64_BOUND for float64 tensors; a lower-precision comparison must name its derived bound).
    None must meet None: one process leaves .grad None where no forward used a parameter."""
    if want is None:
        assert got is None, f"{what}: one process leaves .grad None, the pipeline gave {got}"
        return
    assert got is not None, f"{what}: missing (one process has it)"
    if not isinstance(want, torch.Tensor):  # losses as Python floats (float64's precision), or lists of them
        got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, one process has {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, one process has {want.dtype}"
    if bound is None:
        assert want.dtype == EXACT_DTYPE, f"{what}: a {want.dtype} comparison needs a bound derived for it"
        bound = FLOAT64_BOUND
    err = difference(got, want)
    assert err <= bound, f"{what}: {err:.3e} off, relative to the largest entry (bound {bound:.1e})"


def assert_within(err: float, what: str, bound: float = FLOAT64_BOUND) -> None:
    """A difference a case computed with `difference` (on its own rank) is within `bound`."""
    assert err <= bound, f"{what}: {err:.3e} off, relative to the largest entry (bound {bound:.1e})"


# The suite's summary: every difference measured, by dtype, in a folder the session names
# (conftest.py sets it before any rank is spawned; each process appends to a file of its own).
RECORD_DIR = "PIPECORE_TEST_DIFFERENCES"


def record(dtype: torch.dtype, err: float) -> None:
    folder = os.environ.get(RECORD_DIR)
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "a") as f:
            f.write(f"{str(dtype).removeprefix('torch.')} {err!r}\n")


def summary(folder: str) -> dict[str, tuple[int, float]]:
    """{dtype: (comparisons, largest difference)} over every file in `folder`."""
    out: dict[str, tuple[int, float]] = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                dtype, err = line.split()
                n, worst = out.get(dtype, (0, 0.0))
                out[dtype] = (n + 1, max(worst, float(err)))
    return out
