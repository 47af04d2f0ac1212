"""The communication service of one Pipeline: the small native collectives, the store where a
failing rank leaves its error, and whether the group broke.

The runtime and the training modules (data parallel, ties, clipping, checkpoints) talk to the other
ranks through this object; none of them holds the Pipeline's private state. The small collectives are
the executor's own (csrc/collectives.h says why they are native): a hung or dead peer ends them with
a timeout whose message names the rank and what it waited for, and the group is then marked broken.
The checkpoints' agreements are torch.distributed's, bounded by the group's own timeout (below:
`patient_*`); what DCP itself reads and writes it exchanges over the group by itself.
"""

from __future__ import annotations

import pickle
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipecore.errors import CommunicationError
from pipecore.executor.descriptions import DESCRIPTION_TAG, Descriptions
from pipecore.executor.native import C, CommError


class Comm:
    """Talks to the other ranks of one Pipeline's `group` (and, when asked, of another group such as
    the data-parallel one)."""

    def __init__(self, group, timeout: float, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.who = who(group)  # this rank in errors
        self.world = dist.get_world_size(group)
        self.timeout = timeout
        self.device = device  # the stages' device
        self.store = dist.distributed_c10d._get_default_store() if self.world > 1 else None
        # names this Pipeline's keys in the store, alike on every rank: set at the first agreement
        self.uid: str | None = None
        self.broken: str | None = None  # why the group broke (no later step may use it)
        self.channels: list = []  # more communicators of these ranks (open_channels)
        self.reverse_channel = None  # gloo's second connection (open_reverse_channel)
        self._follow_ups_open = False
        self._connected = False  # the communicators the messages go on (open_channels)
        self.descriptions: Descriptions | None = None  # where discovery steps send boundaries (open_descriptions)
        self.step = -1  # the step in progress: its failures are left under its key
        self._messages = None  # the executor (attach)

    # -- the small collectives ---------------------------------------------------------------
    def all_reduce_sum(self, values: list[int], what: str, group=None) -> list[int]:
        return self._call(C.all_reduce_sum, values, what=what, group=group, on_device=True)

    def all_gather(self, values: list[int], what: str, group=None) -> list[list[int]]:
        return self._call(C.all_gather, values, what=what, group=group, on_device=True)

    def all_reduce_tensor(self, tensor: torch.Tensor, op: str, what: str, group=None) -> torch.Tensor:
        return self._call(C.all_reduce_tensor, tensor, op, what=what, group=group)

    def exchange(self, tensor: torch.Tensor, peer: int, what: str) -> torch.Tensor:
        """Sends `tensor` to group rank `peer` and returns what `peer` sends, between steps (a tie's or a
        dualpipe mirror's sum), on the communicators the executor's messages use (`attach`): on NCCL one
        group on the pipeline's communicator, whose path to `peer` was connected at the first agreement
        (`exchange_peers`), not a communicator of the two ranks made inside the step."""
        try:
            return self._messages.exchange(tensor, peer, what)
        except CommError as exc:
            raise self._failed(exc) from exc.__cause__

    def attach(self, executor):
        """The executor whose message path carries `exchange` (made after this Comm); returns it."""
        self._messages = executor
        return executor

    def gather_objects(self, obj: Any, what: str, group=None) -> list[Any]:
        """Every rank's picklable `obj`, in group rank order (the int64 all-gather twice: sizes, then
        the bytes; once when no rank has anything to say)."""
        if (self.world if group is None else dist.get_world_size(group)) == 1:
            return [obj]
        data = pickle.dumps(obj) if obj else b""
        sizes = [row[0] for row in self.all_gather([len(data)], what, group)]
        if not any(sizes):
            return [obj for _ in sizes]
        words = (max(sizes) + 7) // 8
        padded = data.ljust(words * 8, b"\0")
        mine = [int.from_bytes(padded[i:i + 8], "little", signed=True) for i in range(0, len(padded), 8)]
        out = []
        for size, row in zip(sizes, self.all_gather(mine, what, group)):
            raw = b"".join(v.to_bytes(8, "little", signed=True) for v in row)[:size]
            out.append(pickle.loads(raw) if size else [])
        return out

    # -- torch.distributed's collectives, at the process group's own pace -----------------------
    # The checkpoints agree around writing and reading files, which may take longer than a step: these
    # wait as long as the group's own timeout allows, not the Pipeline's `timeout`, and a wait that
    # runs out does not mark this Pipeline's group broken (no step was running).
    def patient_gather_objects(self, obj: Any, group=None) -> list[Any]:
        """Every rank's picklable `obj`, in group rank order (torch.distributed.all_gather_object)."""
        group = self.group if group is None else group
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def patient_any(self, flag: bool, group=None) -> bool:
        """Whether any rank of `group` says `flag` (one all-reduce of a small tensor)."""
        group = self.group if group is None else group
        anyone = torch.tensor([int(flag)], device=self.device_for(group))
        dist.all_reduce(anyone, group=group)
        return bool(anyone)

    def _call(self, fn, *args, what: str, group=None, on_device: bool = False):
        group = self.group if group is None else group
        try:
            return fn(group, *args, timeout=self.timeout, what=what,
                      **({"device": str(self.device_for(group))} if on_device else {}))
        except CommError as exc:
            raise self._failed(exc, group) from exc.__cause__

    def _failed(self, exc: CommError, group=None) -> CommunicationError:
        """A small collective or an exchange failed (on `group`, default the pipeline's): the group is broken."""
        aborted = self.mark_broken(str(exc), group)
        return CommunicationError(f"{exc}; a rank hung or died: {aborted}rebuild the process group")

    def device_for(self, group=None) -> torch.device:
        """Where small collectives over `group` run: CPU when it has a CPU backend (gloo, also in
        "cpu:gloo,cuda:nccl"), else the stages' device."""
        group = self.group if group is None else group
        return torch.device("cpu") if backend_of(group, torch.device("cpu")) else self.device

    def abandon_group(self, exc: Exception, failed_group=None, explain=None) -> CommunicationError:
        """The executor's wait timed out or a connection broke (on `failed_group`, e.g. the data-parallel
        group, if not on the pipeline's): marks the group broken and aborts (`mark_broken`), and returns
        the error to raise, which says both, after `explain()`'s text (the cause as every rank says it:
        asked once the communicators were aborted, before c10d's watchdog would end the process)."""
        aborted = self.mark_broken(str(exc), failed_group)
        diagnosis = explain() if explain is not None else ""
        if diagnosis:
            return CommunicationError(f"{diagnosis}.\nHere: {exc}. {aborted + 'r' if aborted else 'R'}ebuild the "
                                      "process group and the Pipeline (README: after a CommunicationError).")
        return CommunicationError(f"{exc}. A peer hung or died: {aborted}rebuild the process group and the "
                                  "Pipeline (README: after a CommunicationError).")

    def mark_broken(self, why: str, failed_group=None) -> str:
        """No later step may run on the group (`why` is said again then). Every path that decides so
        comes here, and aborts what may hold stuck transfers (`abort_nccl`). Says what it aborted."""
        self.broken = why
        return self.abort_nccl(failed_group)

    def abort_nccl(self, failed_group=None) -> str:
        """NCCL: the broken step's transfers never complete, and the compute stream waits on their
        events, so everything queued on it after them would wait until c10d's watchdog ends the process.
        Aborting the communicators ends them: `failed_group`'s (where the failure was, if not on this
        group), this group's and its channels'. Says what it did, for the error."""
        groups = [failed_group] if failed_group is not None and failed_group is not self.group and \
            self._is_nccl(failed_group) else []
        if self.p2p_is_nccl():
            groups.append(self.group)
        channels = [c for c in self.channels if dist.is_nccl_available() and isinstance(c, dist.ProcessGroupNCCL)]
        if not groups and not channels:
            return ""
        try:
            for channel in channels:  # the follow-ups' (a send may wait there for its receiver)
                channel.abort()
            for group in groups:
                dist.distributed_c10d._abort_process_group(group)
        except Exception as exc:  # noqa: BLE001 - the error says what happened
            return f"aborting the NCCL communicators failed ({type(exc).__name__}: {exc}); "
        if len(groups) > 1:
            return ("pipecore aborted the data-parallel group's and the pipeline group's NCCL communicators (their "
                    "stuck transfers ended); ")
        return "pipecore aborted the group's NCCL communicator (its stuck transfers ended); "

    def p2p_is_nccl(self) -> bool:
        """Do the stages' messages go through NCCL?"""
        return self._is_nccl(self.group)

    def _is_nccl(self, group) -> bool:
        return dist.is_nccl_available() and isinstance(self._backend(group), dist.ProcessGroupNCCL)

    def _p2p_backend(self):
        """The backend that serves the stages' device on the group (None if none does)."""
        return self._backend(self.group)

    def _backend(self, group):
        backend = backend_of(group, self.device)
        return getattr(backend, "wrapped_pg", backend)  # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps it

    # -- failures left in the store -----------------------------------------------------------
    def error_key(self, step: int | None = None) -> str | None:
        """Where step `step`'s (default: this step's) first error is left; None before the first
        agreement named this Pipeline's keys."""
        if self.uid is None:
            return None
        return f"pipecore/{self.uid}/step{self.step if step is None else step}/error"

    def publish_error(self, error: str, action: str, own: bool = True) -> None:
        """The first failing rank of this step: leave its error where the other ranks will look. `own`: an
        error of its own (its forward's, its inputs'), not what it learnt of a broken group, which the
        doctor also keeps apart (`own_error_key`) as the cause of a hang the others see."""
        key = self.error_key()
        if self.world == 1 or key is None:
            return
        text = f"{who(self.group)} failed in {action}: {error.strip().splitlines()[0] if error.strip() else error}"
        leave_first(self.store, [key], text)
        if own:
            leave_first(self.store, [self.own_error_key()], text)

    def own_error_key(self, step: int | None = None) -> str | None:
        """Where the first error of a rank's own in step `step` (default: this step) is left (publish_error)."""
        key = self.error_key(step)
        return None if key is None else key + "/own"

    def meet(self, kind: str, what: str, group=None) -> str | None:
        """Every rank of `group` (default: the pipeline's) reaches its next `kind` meeting point (the
        first agreement of a Pipeline, the data-parallel replicas' agreement), or a rank that cannot
        come left why there (`cannot_meet`): returns None, or that text. Through the store, polled,
        before the collective it guards: a rank that failed before it never joins a collective."""
        group = self.group if group is None else group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        point = _next_point(kind, group)
        store = dist.distributed_c10d._get_default_store()  # (also for a pipeline of one rank's replicas)
        store.set(f"{point}/arrived{rank}", b"1")
        arrived, failed = [f"{point}/arrived{r}" for r in range(world)], f"{point}/failed"
        deadline, pause = time.monotonic() + self.timeout, 0.0005
        while not store.check(arrived):
            if store.check([failed]):
                return store.get(failed).decode()
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(arrived) if not store.check([key])]
                aborted = self.mark_broken(f"ranks {missing} did not arrive")
                raise CommunicationError(f"{self.who}: {what} failed within {self.timeout} s: group ranks "
                                         f"{missing} did not arrive; a rank hung or died: {aborted}rebuild the "
                                         "process group")
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        return None

    def peer_error(self) -> str:
        """The error the first failing rank of this step left (waiting briefly for it)."""
        key = self.error_key()
        try:
            self.store.wait([key], timedelta(seconds=10))
            return self.store.get(key).decode()
        except Exception:  # noqa: BLE001 - the step fails anyway; only its message is missing
            return "another rank failed (its error message did not arrive)"

    # -- channels ---------------------------------------------------------------------------------
    def p2p_is_gloo(self) -> bool:
        """Do the stages' messages go through gloo? Asked of the backend that serves the stages'
        device: a group made with "cpu:gloo,cuda:nccl" is gloo on CPU and NCCL on CUDA."""
        backend = self._p2p_backend()
        if backend is None:
            return dist.get_backend(self.group) == "gloo"
        return dist.is_gloo_available() and isinstance(backend, dist.ProcessGroupGloo)

    def open_reverse_channel(self):
        """gloo: a second gloo group over these ranks for the messages that travel to a lower rank,
        so that a rank's sends never share a connection with the data it receives (see
        Executor.set_reverse_channel). It runs on the group's own gloo device: no extra thread. Opened
        right after an agreement, when every rank of the group is here to connect."""
        return self._open_channel("reverse", self.group._get_backend(torch.device("cpu")))

    def open_follow_up_channels(self):
        """The device path's follow-up channels (Executor.set_follow_up_channels): two more communicators
        of these ranks, of the stages' backend (NCCL; gloo where the CPU model runs the device path), on
        which messages that outgrew their receive follow, to higher ranks on the first and to lower ranks
        on the second. Opened right after an agreement; NCCL connects at the first follow-up."""
        return tuple(self._open_channel(f"follow-ups-{way}", self._p2p_backend()) for way in ("up", "down"))

    def open_descriptions(self) -> Descriptions:
        """Where the first step of a batch signature sends the boundaries' descriptions
        (pipecore/executor/descriptions.py): the group's gloo under a tag of their own, else a
        communicator of their own (NCCL). Opened right after an agreement, once."""
        if self.descriptions is None:
            device = self.device_for()
            if device.type == "cpu":  # (the group's own CPU backend)
                self.descriptions = Descriptions(self.group, DESCRIPTION_TAG, device)
            else:
                self.descriptions = Descriptions(self._open_channel("descriptions", self._p2p_backend()), 0,
                                                 self.device)
        return self.descriptions

    def open_channels(self, executor, gloo: bool, peers: list[int], exchange_peers: list[int]) -> None:
        """At an agreement (every rank of the group is there): the channels `executor`'s messages need that
        are not open yet, then every communicator they go on connected, before any step posts on it
        ([Note: connecting before the first step], csrc/device_comm.h). `gloo`: the messages go through
        gloo; `peers`: the ranks this rank's programs exchange messages with; `exchange_peers`: those `exchange`
        goes to."""
        if self.world == 1:
            return
        opened = len(self.channels)
        if gloo and self.reverse_channel is None:
            self.reverse_channel = self.open_reverse_channel()
            executor.set_reverse_channel(self.reverse_channel)
        if executor.device_comm and executor.shapes_travel and not self._follow_ups_open:
            self._follow_ups_open = True  # (csrc/executor.h, set_follow_up_channels)
            executor.set_follow_up_channels(*self.open_follow_up_channels())
        self.open_descriptions()  # (the first step of each batch signature sends boundaries there)
        if not self._connected or len(self.channels) > opened:
            self.connect(executor, self.channels[opened:], peers, exchange_peers)
            self._connected = True

    def connect(self, executor, channels: list, peers: list[int], exchange_peers: list[int]) -> None:
        """At an agreement, every rank of the group here: the communicators the executor's messages go on
        connected now, not by a step's first operation on them (csrc/executor.h, connect_communicators).
        `channels`: those opened since the last call; `peers`: the ranks this rank's programs exchange
        messages with; `exchange_peers`: those `exchange` goes to. One that fails breaks the group. (On a
        GPU nothing bounds a connection whose peers never come: NCCL's has no timeout, which is why it is
        made here, where every rank just agreed.)"""
        try:
            executor.connect_communicators(channels, peers, exchange_peers)
        except RuntimeError as exc:  # (CommError; c10d's DistBackendError, DistStoreError)
            raise CommunicationError(f"{self.who}: connecting the group's communicators failed ({exc}); a rank hung "
                                     f"or died: {self.mark_broken(str(exc))}rebuild the process group") from None

    def _open_channel(self, name: str, like):
        """One more communicator of these ranks, of `like`'s kind, with `like`'s c10d timeout (`channel_timeout`)."""
        store = dist.PrefixStore(f"pipecore/{self.uid}/{name}", self.store)
        timeout = channel_timeout(self.timeout, like)
        try:
            if dist.is_nccl_available() and isinstance(like, dist.ProcessGroupNCCL):
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                channel = dist.ProcessGroupNCCL(store, self.rank, self.world, options)
            else:
                options = dist.ProcessGroupGloo._Options()
                options._devices = like.options._devices
                options._timeout = timeout
                options._threads = 1  # its collective threads idle: only send and receive run on it
                channel = dist.ProcessGroupGloo(store, self.rank, self.world, options)
        except RuntimeError as exc:
            aborted = self.mark_broken(str(exc))
            raise CommunicationError(f"{self.who}: connecting the ranks' {name} channel failed within "
                                     f"{self.timeout} s ({exc}); a rank hung or died: {aborted}rebuild the process "
                                     "group") from None
        if not self.channels:
            _end_with_the_world(self)
        self.channels.append(channel)
        return channel

    def end_channels(self) -> None:
        """Shut down every channel this Comm opened (destroy_process_group() does, through
        `_end_with_the_world`); a later step on the group fails as on any destroyed group."""
        channels, self.channels = self.channels, []
        self.reverse_channel = None
        for channel in channels:
            shutdown = getattr(channel, "shutdown", None)
            if shutdown is not None:
                shutdown()


class _ChannelsEnder:
    """Sits in c10d's list of communicators that `destroy_process_group()` finalises (`_world.comms`)
    and shuts down one Comm's channels there: they are communicators c10d did not make (no group is
    registered for them), and an NCCL one destroyed without it warns, or waits, at the process's exit.
    Holds its Comm weakly: a Pipeline let go of takes its channels with it."""

    def __init__(self, comm: Comm):
        self._comm = weakref.ref(comm)

    def finalize(self) -> None:
        comm = self._comm()
        if comm is not None:
            comm.end_channels()


def _end_with_the_world(comm: Comm) -> None:
    comms = getattr(dist.distributed_c10d._world, "comms", None)  # (where c10d keeps that list; else let go of)
    if isinstance(comms, list):
        comms.append(_ChannelsEnder(comm))


def channel_timeout(pipeline_timeout: float, like) -> timedelta:
    """A channel's own c10d timeout: that of the group's backend `like`, which on NCCL is above the
    Pipeline's (message_path.py refuses a group whose is not), so that pipecore's wait times out first,
    aborts and says which message was missing, before c10d's watchdog ends a channel's stuck transfer by
    ending the process. The Pipeline's where `like` says none."""
    group_timeout = getattr(getattr(like, "options", None), "_timeout", None)
    return group_timeout if isinstance(group_timeout, timedelta) else timedelta(seconds=pipeline_timeout)


_MEETINGS: dict[tuple[str, str], int] = {}  # (kind, process group name): meeting points passed in this process


def _next_point(kind: str, group) -> str:
    """The store prefix of this process's next `kind` meeting point on `group`: the ranks of a group
    pass the same points in the same order (each Pipeline's first agreement; each replica's)."""
    key = (kind, dist.distributed_c10d._get_process_group_name(group))
    count = _MEETINGS.get(key, 0)
    _MEETINGS[key] = count + 1
    return f"pipecore/meet/{kind}/{key[1]}/{count}"


def cannot_meet(kind: str, group, text: str) -> None:
    """This rank will not come to its next `kind` meeting point on `group` (its Pipeline could not
    be built, or cannot run): the other ranks' `Comm.meet` returns `text` instead of waiting."""
    leave_first(dist.distributed_c10d._get_default_store(), [f"{_next_point(kind, group)}/failed"], text)


def who(group) -> str:
    """This rank as every error names it: its global rank, and where the pipeline `group` is not every
    rank (data or tensor parallel besides), its rank in that group too: "rank 5 (pp rank 1)"."""
    me = dist.get_rank()
    return f"rank {me}" if dist.get_world_size(group) == dist.get_world_size() else \
        f"rank {me} (pp rank {dist.get_rank(group)})"


def leave_first(store, keys: list[str], text: str) -> None:
    """`text` under each key unless an error is there already (the first one stays)."""
    for key in keys:
        try:
            store.compare_set(key, "", text)
        except Exception:  # noqa: BLE001 - the message is best effort; the failure travels anyway
            pass


def backend_of(group, device: torch.device):
    """The backend `group` uses for tensors on `device`, or None if it has none for that device."""
    try:
        return group._get_backend(device)
    except RuntimeError:
        return None
