"""World-of-one probes of `make gpu-check` (.ci/gpu_check.py): what NCCL and c10d do where pipecore's CPU
model of them makes an assumption, each in a process of its own (a probe may hang or abort). Prints one
line, `RESULT <ok|FAIL> <detail>`.

  self_wait        a coalesced send and receive to self, posted behind a long kernel: wait() returns at
                   once (it makes the current stream wait; the host does not), and the bytes arrive
  group_end_first  a group of a send and a receive to self whose posting "failed" after they were added,
                   ended and then its communicator aborted, as csrc/device_comm.cpp does: what each call
                   did, then an all-reduce on a new group (the process goes on)
  abort_first      the other order (before issue 61): what each call did (NCCL may refuse to end a group
                   on a communicator aborted inside it), then the same all-reduce
  channel          a communicator of all ranks connected as pipecore connects a group's (a one-byte
                   all-reduce): seconds, device memory and store operations it took (--cpu: gloo); in a
                   world of one it has no point-to-point connections, which pipecore's pairs add
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


class CountingStore(dist.Store):
    """A HashStore that counts the operations made on it (what connecting costs the store)."""

    def __init__(self):
        super().__init__()
        self.inner = dist.HashStore()
        self.operations = 0

    def set(self, key, value):
        self.operations += 1
        return self.inner.set(key, value)

    def get(self, key):
        self.operations += 1
        return self.inner.get(key)

    def add(self, key, value):
        self.operations += 1
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self.operations += 1
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        self.operations += 1
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        self.operations += 1
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def _world_of_one(backend: str, device):
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            **({"device_id": device} if backend == "nccl" else {}))


def self_wait(device) -> str:
    _world_of_one("nccl", device)
    data = torch.arange(1 << 20, dtype=torch.float32, device=device)
    out = torch.zeros_like(data)
    torch.cuda._sleep(int(2e9))  # about a second of a spinning kernel on the current stream
    started = time.monotonic()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, data, 0), dist.P2POp(dist.irecv, out, 0)])
    for work in works:
        work.wait()
    host = time.monotonic() - started
    torch.cuda.synchronize()
    total = time.monotonic() - started
    if not torch.equal(out, data):
        return "FAIL the bytes received to self are not those sent"
    if host > 0.1 * total:
        return f"FAIL wait() held the host {host:.3f} s of the {total:.3f} s behind the kernel"
    return f"ok wait() took {host * 1e3:.1f} ms on the host, {total:.2f} s with the kernel"


def failed_posting(device, end_first: bool) -> str:
    _world_of_one("nccl", device)
    group = dist.new_group([0], backend="nccl")
    backend = group._get_backend(device)
    data, out = torch.ones(8, device=device), torch.zeros(8, device=device)
    group._start_coalescing(device)
    dist.isend(data, 0, group=group)  # the part added before the posting failed (to self: with its receive)
    dist.irecv(out, 0, group=group)
    steps = [("end", lambda: group._end_coalescing(device)), ("abort", backend.abort)]
    if not end_first:
        steps.reverse()
    outcome = []
    for name, fn in steps:
        try:
            fn()
            outcome.append(f"{name} ok")
        except Exception as exc:  # noqa: BLE001 - what it did is the finding
            outcome.append(f"{name} raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    fresh = dist.new_group([0], backend="nccl")
    value = torch.ones(4, device=device)
    started = time.monotonic()
    dist.all_reduce(value, group=fresh)
    torch.cuda.synchronize()  # (a hang here is ended by gpu_check's timeout and reported)
    return f"ok {', '.join(outcome)}; an all-reduce on a new group then took {time.monotonic() - started:.3f} s"


def channel(device) -> str:
    backend = "gloo" if device.type == "cpu" else "nccl"
    _world_of_one(backend, device)
    store = CountingStore()
    free_before = torch.cuda.mem_get_info(device)[0] if backend == "nccl" else 0
    started = time.monotonic()
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=60)
        made = dist.ProcessGroupNCCL(store, 0, 1, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        options._timeout = timedelta(seconds=60)
        made = dist.ProcessGroupGloo(store, 0, 1, options)
    created = time.monotonic() - started
    made.allreduce([torch.zeros(1, dtype=torch.uint8, device=device)]).wait()
    if backend == "nccl":
        torch.cuda.synchronize()
    connected = time.monotonic() - started - created
    memory = (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20 if backend == "nccl" else 0.0
    return (f"ok {backend}: made in {created:.3f} s, connected in {connected:.3f} s, {memory:.0f} MiB of device memory, "
            f"{store.operations} store operations")


PROBES = {"self_wait": lambda d: self_wait(d), "group_end_first": lambda d: failed_posting(d, True),
          "abort_first": lambda d: failed_posting(d, False), "channel": channel}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe", choices=sorted(PROBES))
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (the probes that can)")
    args = ap.parse_args()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if not args.cpu:
        torch.cuda.set_device(device)
    try:
        line = PROBES[args.probe](device)
    except Exception as exc:  # noqa: BLE001 - a row of the table
        line = f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    print(f"RESULT {line}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # no teardown: an aborted communicator could block it


if __name__ == "__main__":
    main()
