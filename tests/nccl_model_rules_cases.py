"""Cases that drive the device path over the CPU model of NCCL one batch at a time (`_C.NcclModel`,
csrc/testing/nccl_model_harness.cpp), posting what the executor never would, to show the model fails
where NCCL and CUDA would: a hang is an error that names it, a free on the wrong stream a violation.

Each case runs on a gloo group of its own, and leaves it (with what is still posted on it) alive in
the process: the test's pool is closed after it (nothing pending may be freed under gloo)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pipecore import _C
from said import said

_KEPT = []  # groups and models of finished cases, with their pending operations


def _model(timeout: float, eager_bytes: int = 0, device: int = 0):
    group = dist.new_group(backend="gloo")
    model = _C.NcclModel(group, timeout, device_index=device, eager_bytes=eager_bytes)
    _KEPT.append((group, model))
    return model


def _outcome(fn, *args) -> tuple[str | None, float]:
    """What fn(*args) raised (None: nothing), and how long it took."""
    start = time.monotonic()
    try:
        fn(*args)
    except _C.CommError as e:
        return said(e), time.monotonic() - start
    return None, time.monotonic() - start


def _error(fn, *args) -> tuple[str, float]:
    """What fn(*args) raised, and how long it took to."""
    error, seconds = _outcome(fn, *args)
    if error is None:
        raise AssertionError(f"{fn.__name__} did not fail")
    return error, seconds


def receive_of_another_size(rank, world):
    """Rank 0 sends 64 float64, rank 1 receives 48: NCCL would leave both waiting. Each rank's error."""
    model = _model(timeout=30)
    if rank == 0:
        batch = model.post([(True, 1, torch.arange(64, dtype=torch.float64))])
        return _error(model.wait, batch)
    batch = model.post([(False, 0, torch.zeros(48, dtype=torch.float64))])
    return _error(model.consume, batch)


def posting_error_aborts_the_communicator(rank, world):
    """Rank 0 posts a batch of two sends whose second c10d refuses (out of memory): posting fails after the
    first send was added. The group is ended (NCCL cannot drop an open group: that half may launch), then
    the communicator aborted, which ends what did not complete: rank 1's receive completes (the half
    reached it first) or times out. On a second communicator, rank 0 first waits for a receive rank 1
    never sends: the abort must end it at once, and refuse what is posted after it."""
    first, second = _model(timeout=30 if rank == 0 else 3), _model(timeout=30)
    ones = torch.ones(8, dtype=torch.float64)
    if rank == 0:
        try:
            posting, _ = _error(lambda: first.post([(True, 1, ones), (True, 1, ones)], refused=1))
            pending = second.post([(False, 1, torch.zeros(8, dtype=torch.float64))])
            _error(lambda: second.post([(True, 1, ones), (True, 1, ones)], refused=1))
            ended, seconds = _error(second.consume, pending)
            after, _ = _error(second.post, [(True, 1, ones)])
            return posting, ended, seconds, after
        finally:
            dist.barrier()  # (rank 1 waits only now: a gloo wait that times out closes the pair's connection)
    received = torch.zeros(8, dtype=torch.float64)
    batch = first.post([(False, 0, received)])
    dist.barrier()
    timed_out, seconds = _outcome(first.consume, batch)
    return timed_out, seconds, received.sum().item()


def group_end_failure_leaves_no_group_open(rank, world):
    """Rank 0 posts a batch whose second send goes to a rank the communicator lacks (NCCL would refuse it
    inside the group and fail the group's end), then one whose second send c10d refuses (out of memory:
    NCCL never sees it); then, on a communicator of its own, one send goes alone to rank 1, as a follow-up
    goes. Had a group's end failed, c10d would count a group open on this thread: the send alone would join
    it and never launch. Returns rank 0's posting errors and what the send alone did; rank 1 what
    receiving alone did, and what it received."""
    first, second = _model(timeout=10), _model(timeout=10)
    ones = torch.ones(8, dtype=torch.float64)
    if rank == 0:
        refused, _ = _error(first.post, [(True, 1, ones), (True, 5, ones)])
        failed, _ = _error(lambda: first.post([(True, 1, ones), (True, 1, ones)], refused=1))
        alone, _ = _outcome(lambda: second.wait(second.post([(True, 1, ones)], alone=True)))
        dist.barrier()
        return refused, failed, alone
    first.post([(False, 0, torch.zeros(8, dtype=torch.float64))])  # (where the half of the failed batch may go)
    received = torch.zeros(8, dtype=torch.float64)
    error, _ = _outcome(lambda: second.consume(second.post([(False, 0, received)], alone=True)))
    dist.barrier()
    return error, received.sum().item()


def groups_on_one_communicator_run_in_order(rank, world):
    """Each rank receives from the other, then sends to it: as one group it completes (a coalesced group
    launches as one); as two groups each rank's receive waits for a send queued behind it, on both ranks,
    which NCCL would wait on forever."""
    peer = 1 - rank
    model = _model(timeout=2)
    received = torch.zeros(4, dtype=torch.float64)
    batch = model.post([(False, peer, received), (True, peer, torch.full((4,), float(rank + 1), dtype=torch.float64))])
    model.consume(batch)
    together = received.tolist()
    model.release(batch, consumed=True)
    receive = model.post([(False, peer, torch.zeros(4, dtype=torch.float64))])
    send = model.post([(True, peer, torch.ones(4, dtype=torch.float64))])
    waited, _ = _error(model.consume, receive)
    queued, _ = _error(model.wait, send)
    return together, waited, queued


def release_on_the_posting_stream(rank, world):
    """A receive posted on the default compute stream, let go of unread while a second stream is current
    (the thread that drops it runs under torch.cuda.stream(...)): the stream the buffer goes back to must
    wait for the transfer (M5: the wait went to the current stream). Then the model's own check: read on
    the second stream and freed as read on the default one, whose stream never waited."""
    peer = 1 - rank
    model = _model(timeout=30)
    out = []
    for _ in range(2):
        batch = model.post([(False, peer, torch.zeros(4, dtype=torch.float64)),
                            (True, peer, torch.ones(4, dtype=torch.float64))])
        model.wait(batch)
        out.append(batch)
    model.release(out[0], consumed=False, second_stream=True)
    dropped = list(model.violations())
    model.consume(out[1], second_stream=True)
    try:
        model.release(out[1], consumed=True)
    except RuntimeError:  # (the ledger refuses as it records)
        pass
    return dropped, list(model.violations())


def send_to_self_without_its_receive(rank, world):
    """Each rank posts a send to itself, its receive in a later batch: NCCL refuses the first group
    at its end (invalid usage), as c10d's endCoalescing raises it. The error's text."""
    model = _model(timeout=30)
    try:
        model.post([(True, rank, torch.ones(8, dtype=torch.float64))])
    except RuntimeError as e:
        return str(e)
    raise AssertionError("posted")


def sends_complete_eagerly_up_to(rank, world, eager_bytes):
    """Rank 0 sends 64 bytes, then 4096, each time waiting (2 s) for its send before rank 1 posts the
    receive (rank 1 waits for the store's word that rank 0's wait ended), and overwrites what it sent
    once its wait returns. With NCCL's eager protocol a send up to `eager_bytes` completes before its
    receiver posts, a larger one does not. Rank 0: each wait's error (None: it completed); rank 1: what
    it received."""
    model = _model(timeout=2, eager_bytes=eager_bytes)
    store = dist.distributed_c10d._get_default_store()
    key = f"eager-{eager_bytes}"
    out = []
    for i, count in enumerate((8, 512)):  # float64: 64 and 4096 bytes
        if rank == 0:
            sent = torch.full((count,), float(i + 1), dtype=torch.float64)
            batch = model.post([(True, 1, sent)])
            out.append(_outcome(model.wait, batch)[0])
            sent.fill_(-1.0)  # (an eager send went from a copy; a pending one reads this later)
            store.set(f"{key}/{i}", b"1")
        else:
            store.wait([f"{key}/{i}"])
            received = torch.zeros(count, dtype=torch.float64)
            batch = model.post([(False, 0, received)])
            model.consume(batch)
            out.append(sorted(set(received.tolist())))
            model.release(batch, consumed=True)
    return out


def a_device_wide_sync_waits_for_a_peer(rank, world):
    """Rank 0 posts a receive from rank 1 and synchronises the device (cudaFree); rank 1 posts the send only
    once rank 0's host is past that point (the word it leaves in the store stands for what rank 0 would
    post next, on which rank 1's send waits): the synchronisation waits for a receive whose send waits for
    it, the hang it would be, reported within the timeout. Then both complete. Rank 0: the
    synchronisation's error and what it received."""
    model = _model(timeout=2, device=7)  # (a device of its own: earlier cases' models hold what never completes)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["past the synchronisation"])
        model.wait(model.post([(True, 0, torch.full((4,), 2.0, dtype=torch.float64))]))
        return None
    received = torch.zeros(4, dtype=torch.float64)
    receive = model.post([(False, 1, received)])
    error, _ = _outcome(_C._model_device_synchronize, "cudaFree (the caching allocator off)", 7)
    store.set("past the synchronisation", b"1")
    model.consume(receive)
    model.release(receive, consumed=True)
    return error, received.tolist()
