"""When a step fails on a wait (a timeout, a broken connection), say why on every rank: who is stuck,
where, and since when (issue 62).

Every rank keeps a flight record (csrc/flight_record.h: the step's phase, the action running and the
part of it, the message it waits for, its last actions), written by the executor without locks. A
watcher thread per process (`_Watcher`) answers questions through the store, the one channel left when
point-to-point traffic is stuck (on a client of its own: `Store.clone`): each rank's record for each of
its live Pipelines, with the Python stack of the thread running that Pipeline's step (sys._current_frames:
it needs the GIL, which a thread sleeping or waiting in C++ lets go of; a rank whose threads hold it
gives no answer). Ranks are global ranks throughout.

The first rank whose step fails on a wait asks (`Doctor.explain`), waits `ANSWER_WITHIN` seconds for the
answers, follows the wait-for chain from its own failed wait (`diagnose`), and leaves the diagnosis in the
store; every other rank whose step fails reads it there, so each says the same.
"""

from __future__ import annotations

import json
import re
import os
import sys
import threading
import time
import traceback
import weakref

import torch.distributed as dist

from pipecore.executor.program import labels_of
from pipecore.schedule.action import Action

ANSWER_WITHIN = 3.0  # seconds the asking rank waits for the others' records
POLL_S = 0.2  # how often the watcher looks for a question (one store operation)
_ASKS = "pipecore/doctor/asks"  # a counter on the default store: the questions asked so far
_LIBRARIES = (os.sep + "torch" + os.sep, os.sep + "pipecore" + os.sep)  # not the user's frames


def _stack(frame) -> list[list]:
    """The innermost 8 frames from `frame` (none: []) as [file, line, function, source]."""
    if frame is None:
        return []
    return [[f.filename, f.lineno, f.name, f.line or ""] for f in traceback.extract_stack(frame)[-8:]]


def _answer_key(question: int, rank: int) -> str:
    return f"pipecore/doctor/{question}/{rank}"


class Doctor:
    """One Pipeline's side: its record for the watcher, the question and the diagnosis."""

    def __init__(self, pipe, lowered: dict):
        """`lowered`: the schedule the ranks agreed on, lowered, per mode (True: training)."""
        self._pipe = weakref.ref(pipe)  # (the watcher holds doctors; a doctor must not hold its Pipeline)
        self._lowered = lowered
        self.comm = pipe.comm
        self.executor = pipe.executor
        self.step_thread: int | None = None  # the thread running a step now (for its Python stack)
        if pipe.world > 1:
            _Watcher.watch(self)

    def begin_step(self, step: int) -> None:
        self.step_thread = threading.get_ident()
        self.executor.set_flight_phase("agreement", step)

    def set_phase(self, phase: str) -> None:
        self.executor.set_flight_phase(phase)

    def end_step(self) -> None:
        self.executor.set_flight_phase("idle")
        self.step_thread = None

    def record(self, stack: bool = True) -> dict:
        """This rank's flight record of the Pipeline, and where its step's thread is in Python."""
        out = self.executor.flight_record()
        pipe = self._pipe()
        out["rank"] = dist.get_rank() if dist.is_initialized() else 0
        # (the executor's peers are ranks of the group; the doctor's, global)
        for entry in [out["waiting"], out["failed_wait"], *out["in_flight"]]:
            if entry is not None and entry["peer"] >= 0 and self.comm.world > 1:
                entry["peer"] = dist.get_global_rank(self.comm.group, entry["peer"])
        out["pipeline"] = self.comm.uid
        out["discovery"] = bool(pipe is not None and pipe.plans.discovery is not None)
        mode = pipe.plans.loaded_mode if pipe is not None else None
        out["program"] = pipe.programs[mode].labels if mode is not None else None  # (as run: its own order)
        frames = sys._current_frames() if stack else {}
        out["stack"] = _stack(frames.get(self.step_thread))
        for half in (out["action"] or {}).get("halves", []):  # (an OVERLAP_F_B pair's other half, on its thread)
            half["stack"] = _stack(frames.get(half.pop("thread")))
        return out

    # -- the question and the diagnosis -----------------------------------------------------------
    def explain(self, step: int) -> str:
        """Why this step failed on a wait, the same text on every rank: the first rank to ask asks and
        leaves the diagnosis; the others read it. "" when nothing can be said (no store). With
        PIPECORE_FLIGHT_DIR set, this rank's record and the diagnosis go to a file there (`dump`)."""
        text = self._diagnosis(step)
        folder = os.environ.get("PIPECORE_FLIGHT_DIR")
        if folder:
            dump(folder, self.record(stack=False), step, text, dist.get_process_group_ranks(self.comm.group))
        return text

    def _diagnosis(self, step: int) -> str:
        store = self.comm.store
        if store is None or self.comm.uid is None:
            return ""
        key = f"pipecore/{self.comm.uid}/doctor/{step}"
        me = str(dist.get_rank())
        try:
            asker = store.compare_set(f"{key}/asker", "", me)
            asker = asker.decode() if isinstance(asker, bytes) else asker
            if asker == me:
                text = "(no diagnosis: asking the other ranks failed)"
                try:
                    pipe = self._pipe()
                    mode = pipe.plans.loaded_mode if pipe is not None else None
                    group = self.comm.group  # (global ranks in group rank order)
                    records = self._ask(store)
                    error = self.comm.own_error_key(step)  # (a rank that failed on its own error left it there)
                    published = store.get(error).decode() if error is not None and store.check([error]) else None
                    text = diagnose(dist.get_rank(), records, self.comm.timeout, step, self._lowered.get(mode),
                                    [dist.get_global_rank(group, g) for g in range(group.size())], published)
                finally:  # (the other ranks wait for it)
                    store.set(f"{key}/diagnosis", text)
                # ranks that learn of the failure from an "aborted" message read the step's error here
                self.comm.publish_error(text, "a wait", own=False)
                return text
            deadline = time.monotonic() + ANSWER_WITHIN + 3
            while not store.check([f"{key}/diagnosis"]):
                if time.monotonic() > deadline:
                    return f"(no diagnosis: rank {asker} asked the other ranks and did not say what they answered)"
                time.sleep(POLL_S / 4)
            return store.get(f"{key}/diagnosis").decode()
        except Exception as exc:  # noqa: BLE001 - the step's own error is raised anyway
            return f"(no diagnosis: asking the other ranks failed: {type(exc).__name__}: {exc})"

    def _ask(self, store) -> dict[int, dict | None]:
        """Every rank's record of this Pipeline (None: no answer within ANSWER_WITHIN)."""
        ranks = dist.get_process_group_ranks(self.comm.group)
        question = store.add(_ASKS, 1)
        records: dict[int, dict | None] = {r: None for r in ranks}
        records[dist.get_rank()] = self.record(stack=False)
        missing = [r for r in ranks if records[r] is None]
        deadline = time.monotonic() + ANSWER_WITHIN
        while missing and time.monotonic() < deadline and not store.check([_answer_key(question, r) for r in missing]):
            time.sleep(POLL_S / 4)  # (one store operation a poll, whatever the number of ranks)
        for r in missing:
            if store.check([_answer_key(question, r)]):
                answer = json.loads(store.get(_answer_key(question, r)))
                records[r] = answer.get(self.comm.uid, {"rank": r, "phase": "elsewhere"})
        return records


class _Watcher:
    """The process's one thread that answers the doctors' questions while a Pipeline of it lives, on a
    client of the store of its own (a blocking call of the step's thread on the shared one would hold it)."""

    _lock = threading.Lock()
    _doctors: weakref.WeakSet = weakref.WeakSet()
    _thread: threading.Thread | None = None

    @classmethod
    def watch(cls, doctor: Doctor) -> None:
        with cls._lock:
            cls._doctors.add(doctor)
            if cls._thread is None or not cls._thread.is_alive():
                cls._thread = threading.Thread(target=cls._serve, name="pipecore-doctor", daemon=True)
                cls._thread.start()

    @classmethod
    def _serve(cls) -> None:
        default = client = None  # the default store, and this thread's client of it
        answered = 0  # the questions on it answered (those before this thread came are not its)
        while True:
            time.sleep(POLL_S)
            with cls._lock:
                if not cls._doctors:
                    cls._thread = None
                    return
            try:
                store = dist.distributed_c10d._get_default_store()
                if store is not default:  # (the first, or the default group was made again)
                    default, client = store, store.clone()
                    answered = client.add(_ASKS, 0)
                asked = client.add(_ASKS, 0)
            except Exception:  # noqa: BLE001 - no default group now (between two), or its store closed
                continue
            for question in range(answered + 1, asked + 1):
                if not cls._answer(client, question):
                    break
            answered = asked

    @classmethod
    def _answer(cls, client, question: int) -> bool:
        """Every live doctor's record, for `question` (a function: none of them stays referenced here)."""
        with cls._lock:
            doctors = list(cls._doctors)
        records = {}
        for doctor in doctors:
            if doctor.comm.uid is not None:
                try:
                    records[doctor.comm.uid] = doctor.record()
                except Exception as exc:  # noqa: BLE001 - answer what can be answered
                    records[doctor.comm.uid] = {"error": f"{type(exc).__name__}: {exc}"}
        folder = os.environ.get("PIPECORE_FLIGHT_DIR")
        if folder:  # (the rank that hangs never fails its step: what it said when asked is its file)
            for record in records.values():
                if "rank" in record:
                    _write(os.path.join(folder, _dump_name(record["rank"], asked=True)), {"record": record})
        try:
            client.set(_answer_key(question, dist.get_rank()), json.dumps(records))
            return True
        except Exception:  # noqa: BLE001 - the store went
            return False


# -- the files a failed step leaves (PIPECORE_FLIGHT_DIR), and `python -m pipecore doctor DIR` ----------
def _dump_name(rank: int, asked: bool = False) -> str:
    return f"pipecore-flight-rank{rank}{'.asked' if asked else ''}.json"


def _write(path: str, content: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".part", "w") as f:
        json.dump(content, f, indent=1)
    os.replace(path + ".part", path)


def dump(folder: str, record: dict, step: int, diagnosis: str, ranks: list[int]) -> None:
    """This rank's record at its failed step, with the diagnosis it raised, as `folder`/pipecore-flight-rankR.json
    (what it answered when asked, its stack with it, is pipecore-flight-rankR.asked.json)."""
    _write(os.path.join(folder, _dump_name(record["rank"])),
           {"step": step, "ranks": ranks, "diagnosis": diagnosis, "record": record})


def read_dumps(folder: str) -> str:
    """The whole picture from the files of `folder`: the diagnosis the ranks raised (made while the step
    hung), then each rank's record as it answered when asked (with its stack) and as it was when its step
    failed."""
    dumps = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("pipecore-flight-rank") and name.endswith(".json") and not name.endswith(".asked.json"):
            with open(os.path.join(folder, name)) as f:
                d = json.load(f)
            dumps[d["record"]["rank"]] = d
    if not dumps:
        raise FileNotFoundError(f"no pipecore-flight-rank*.json in {folder}: set PIPECORE_FLIGHT_DIR for the run")
    ranks = sorted({r for d in dumps.values() for r in d["ranks"]})
    records = {r: dumps[r]["record"] if r in dumps else None for r in ranks}
    said = {(d["step"], d["diagnosis"]) for d in dumps.values()}
    lines = [f"step {step}: {text}" for step, text in sorted(said)]
    for r in ranks:
        asked = os.path.join(folder, _dump_name(r, asked=True))
        if os.path.exists(asked):
            with open(asked) as f:
                then = json.load(f)["record"]
            action = then.get("action") or {}
            lines.append(f"rank {r} when asked: step {then.get('step')}, phase {then.get('phase')}" +
                         (f", in {action['label']} ({action['part']}) for {action['seconds']:.1f} s" if action else ""))
            for frame in then.get("stack", [])[-3:]:
                lines.append(f"  {frame[0]}:{frame[1]} in {frame[2]}: {frame[3]}")
            lines += _in_flight_lines(then)
        rec = records[r]
        if rec is None:
            lines.append(f"rank {r}: no file of a failed step (its process died, or its step did not fail)")
            continue
        lines.append(f"rank {r} when its step failed: step {rec['step']}, phase {rec['phase']}")
        wait = rec.get("failed_wait")
        if wait and wait["peer"] < 0:
            lines.append(f"  failed wait: {wait['action']} for {wait['what']} after {wait['seconds']:.1f} s")
        elif wait:
            lines.append(f"  failed wait: {wait['action']} for the {wait['what']} of microbatch {wait['microbatch']} "
                         f"{'to' if wait['send'] else 'from'} rank {wait['peer']} after {wait['seconds']:.1f} s")
        lines += _in_flight_lines(rec)
        last = rec.get("last", [])
        if last:
            label, ago, seconds = max(last, key=lambda a: a[2])
            lines.append(f"  longest of its last {len(last)} actions: {label}, {seconds * 1e3:.3f} ms")
        for label, ago, seconds in last[-5:]:
            lines.append(f"  {label:>14}  {seconds * 1e3:9.3f} ms, ended {ago - seconds:.1f} s before the file")
    return "\n".join(lines)


IN_FLIGHT_SHOWN = 8  # messages in flight a rank's part of the picture lists, the oldest


def _in_flight_lines(record: dict) -> list[str]:
    """The messages `record`'s rank posted in its run and had not seen complete, oldest first. A small send on
    gloo is seen complete only when its peer's send thread next wakes (csrc/send_tracker.h): it may be listed
    after it arrived."""
    messages = record.get("in_flight") or []
    more = max(0, len(messages) - IN_FLIGHT_SHOWN) + record.get("in_flight_unlisted", 0)
    if not messages and not more:
        return []
    lines = [f"  posted and not seen complete ({len(messages)}" + (f", {more} more not listed" if more else "")
             + "):"]
    for m in messages[:IN_FLIGHT_SHOWN]:
        lines.append(f"  {m['label']:>14}  {'to' if m['send'] else 'from'} rank {m['peer']}, {m['bytes']} bytes"
                     + (" (a grown message's second sending)" if m["follow_up"] else "")
                     + f", posted {m['seconds']:.1f} s before")
    return lines


# -- the diagnosis (a pure function of the records: tests feed it records) ----------------------------
_LEFT = re.compile(r"is in no step|gave no answer|is in step \d+ of this Pipeline, not step|has not called step")
_BUDGET = "room in its send budget"  # (csrc/host_path.cpp's wait for it)
_USER_PARTS = {"forward": "its forward (user code)", "backward": "a backward (autograd, and the user's hooks)"}


def _where_in_python(record: dict) -> str:
    """The innermost frame of the user's code in `record`'s stack (else the innermost), as
    'file:line in function: source'; and the library call it is in, if any."""
    stack = record.get("stack") or []
    if not stack:
        return ""
    user = [f for f in stack if not any(lib in f[0] for lib in _LIBRARIES)]
    frame = user[-1] if user else stack[-1]
    text = f"{frame[0]}:{frame[1]} in {frame[2]}: {frame[3]}".rstrip(": ")
    inner = stack[-1]
    if os.sep + "distributed" + os.sep in inner[0] and inner is not frame:
        text += (f", inside torch.distributed's {inner[2]} (a collective the user's code entered: do the other "
                 "ranks of its group enter it too?)")
    return text


def _wait_of(record: dict) -> tuple[dict | None, str]:
    """The wait `record` says its rank is in (once a wait failed, the abort waits for others: the failed
    one), and the label of the action waiting."""
    wait = record.get("failed_wait") or record.get("waiting")
    if wait is None:
        return None, ""
    return wait, wait.get("action") or (record.get("action") or {}).get("label") or "the step's end"


def _half_in_user_code(rank: int, record: dict | None, timeout: float) -> str | None:
    """What a thread other than the step's (an OVERLAP_F_B pair's other half) does, if it has been in user code
    for over half the timeout: the longest of them."""
    action = (record or {}).get("action") or {}
    slow = [h for h in action.get("halves", []) if h["part"] in _USER_PARTS and h["seconds"] >= timeout / 2]
    if not slow:
        return None
    half = max(slow, key=lambda h: h["seconds"])
    where = _where_in_python({"stack": half.get("stack")})
    return (f"rank {rank} has been in {action['label']}, its other half (on a thread of its own) in "
            f"{_USER_PARTS[half['part']]} for {half['seconds']:.1f} s" + (f", at {where}" if where else ""))


def _state(rank: int, record: dict | None, timeout: float, step: int | None) -> tuple[str, str | None, int | None]:
    """(what `rank` is doing, the cause if it is one, the rank it waits for if it waits), in step `step`."""
    if record is None:
        return (f"rank {rank} gave no answer in {ANSWER_WITHIN:g} s", f"rank {rank} gave no answer: its process "
                "died, or a thread of it holds Python's GIL", None)
    if record.get("phase") == "elsewhere" or "error" in record:
        return (f"rank {rank} runs no step of this Pipeline", f"rank {rank} runs no step of this Pipeline", None)
    if record.get("phase") == "idle":
        text = f"rank {rank} is in no step of this Pipeline (its last was step {record.get('step')})"
        if record.get("step", -1) < 0:
            text = f"rank {rank} has not called step() on this Pipeline"
        return text, text + ": every rank must call step() together", None
    if step is not None and record.get("step") != step:
        text = f"rank {rank} is in step {record.get('step')} of this Pipeline, not step {step}"
        return text, text + ": every rank must call step() together", None
    action = record.get("action")
    wait, label = _wait_of(record)
    phase = record.get("phase")
    half = _half_in_user_code(rank, record, timeout)
    if half is not None and wait is None:  # (this thread waits for the half, or is done; a wait is followed)
        return half, half, None
    if wait is not None:
        if wait["peer"] < 0:  # (the step's last sends, or its work on the device: its oldest send not complete)
            text = f"rank {rank} waits in {label} for {wait['what']} ({wait['seconds']:.1f} s)"
            sends = [m for m in record.get("in_flight") or [] if m["send"] and m["peer"] >= 0]
            if not sends:
                return text, None, None
            oldest = sends[0]
            return (f"{text}, the oldest not complete its {oldest['label']} to rank {oldest['peer']}", None,
                    int(oldest["peer"]))
        if wait["what"] == _BUDGET:
            whose = f"{_BUDGET} to rank {wait['peer']} (sends to it have not completed)"
        elif wait["send"]:
            whose = (f"its send of the {wait['what']} of microbatch {wait['microbatch']} to rank {wait['peer']} to "
                     "complete")
        else:
            whose = f"the {wait['what']} of microbatch {wait['microbatch']} from rank {wait['peer']}"
        return f"rank {rank} waits in {label} for {whose} ({wait['seconds']:.1f} s)", None, int(wait["peer"])
    if action is not None:
        part = action.get("part")
        where = _where_in_python(record)
        text = (f"rank {rank} has been in {action['label']}, {_USER_PARTS.get(part, part)}, for "
                f"{action['seconds']:.1f} s" + (f", at {where}" if where else ""))
        slow = part in _USER_PARTS and action["seconds"] >= timeout / 2
        return text, (text if slow else None), None
    return f"rank {rank} is in step {record.get('step')}, phase {phase}", None, None


# the messages a wait can be for, by the kind of send that sends them (the executor's words: message_name in
# csrc/program.h, and discovery's)
_SENT_BY = {"activations": "F", "shapes of the activations": "F", "output gradients": "B", "shapes of its outputs": "B"}
_LOCAL_ONLY = ("UNSHARD", "RESHARD")  # actions a rank adds to its own row after the ranks agreed (FSDP2's)


def _comparable(labels: list[str]) -> list[int]:
    """The indices of `labels` that every rank's program has alike."""
    return [i for i, label in enumerate(labels) if not any(kind in label for kind in _LOCAL_ONLY)]


def _against_schedule(cycle: list[int], records: dict, lowered, ranks: list[int]) -> str:
    """What the schedule says of a wait-for cycle: the ranks whose programs are not the schedule's rows
    (the first action that differs), and where the schedule has each awaited message sent."""
    group_rank = {g: r for r, g in enumerate(ranks)}
    differ, sent = [], []
    for c in cycle:
        record = records.get(c) or {}
        if c not in group_rank:
            continue
        expected = labels_of(lowered, group_rank[c])
        ran = record.get("program")
        if ran is not None:
            mine = _comparable(ran)  # (indices into the program as it runs, which the flight record counts in)
            wanted = [expected[i] for i in _comparable(expected)]
            i = next((k for k, (a, b) in enumerate(zip(mine, wanted)) if ran[a] != b), min(len(mine), len(wanted)))
            if i < max(len(mine), len(wanted)):
                at, has = (mine[i], ran[mine[i]]) if i < len(mine) else (len(ran), "the end")
                differ.append(f"rank {c}'s program is not the schedule's: its action {at} is {has} where the "
                              f"schedule has {wanted[i] if i < len(wanted) else 'the end'}")
        wait, label = _wait_of(record)
        if wait is None or wait["send"] or wait["peer"] not in group_rank:
            continue
        try:
            stage = Action.parse(label.removeprefix("PP:")).stage
        except Exception:  # noqa: BLE001 - no action's label ("the step's end"): nothing to say
            continue
        if wait["what"] not in _SENT_BY:  # (a send's budget, the step's end: no one message)
            continue
        activations = _SENT_BY[wait["what"]] == "F"
        sender = (lowered.topology.prev_stage if activations else lowered.topology.next_stage)[stage]
        send = f"PP:{sender}{'SEND_F' if activations else 'SEND_B'}{wait['microbatch']}"
        theirs = labels_of(lowered, group_rank[wait["peer"]])
        if sender >= 0 and send in theirs:
            sent.append(f"rank {wait['peer']} send the {wait['what']} of microbatch {wait['microbatch']} in "
                        f"{send} (its action {theirs.index(send)})")
    text = (". The schedule has " + ", and ".join(sent)) if sent else ""
    if differ:
        text += ". " + "; ".join(differ) + " (ranks that run other programs than the schedule's match messages out " \
            "of step)"
    return text


def diagnose(me: int, records: dict[int, dict | None], timeout: float, step: int | None = None, lowered=None,
             ranks: list[int] | None = None, published: str | None = None) -> str:
    """The cause first, then what the cause does not say of the other ranks: the wait-for chain followed
    from rank `me`'s failed wait (global ranks) until a rank that is the cause (no answer, in no step or
    another than `step`, in user code for over half the timeout) or a rank met again (a wait-for cycle:
    with `lowered`, the schedule the ranks agreed on, and `ranks`, the global rank of each of its ranks,
    what the schedule says of it). `published`: the error of its own a rank's step failed on, which it left
    in the store for its peers (Comm.publish_error: its forward's, its inputs'): the cause where the chain
    meets that rank, or ends nowhere telling, or at a rank in no step or that gave no answer (that rank
    may have left its step, or died, since); else said after the cause."""
    states = {r: _state(r, rec, timeout, step) for r, rec in records.items()}
    # a pair's other half in user code while the step's thread waits: the cause if the wait comes back round
    halves = {r: text for r, rec in records.items() if (text := _half_in_user_code(r, rec, timeout)) is not None}
    chain, r, cause = [], me, None
    while r in states and r not in chain:
        chain.append(r)
        text, is_cause, waits_for = states[r]
        if is_cause is not None:
            cause = is_cause
            break
        if waits_for is None:
            break
        r = waits_for
    else:
        if r in chain:
            cycle = chain[chain.index(r):]
            cycle = cycle[cycle.index(min(cycle)):] + cycle[:cycle.index(min(cycle))]  # (alike on every rank)
            cause = "a wait-for cycle: " + "; ".join(states[c][0] for c in cycle)
            stuck = next((halves[c] for c in cycle if c in halves), None)
            if stuck is not None:
                cause = f"{stuck} ({cause})"
            elif lowered is not None and ranks is not None:
                try:
                    cause += _against_schedule(cycle, records, lowered, ranks)
                except Exception as exc:  # noqa: BLE001 - the cycle is said anyway
                    cause += f" (comparing it with the schedule failed: {type(exc).__name__}: {exc})"
    also = []
    if published is not None:
        said = f"{published.rstrip('.')} (its own error: its step ended on it)"
        origin = re.match(r"rank (\d+)", published)
        if cause is None or _LEFT.search(cause) or (origin is not None and int(origin.group(1)) in chain):
            cause = said
        else:
            also.append(said)
    if cause is None:  # the chain ended nowhere telling: any rank that is a cause
        cause = next((s[1] for s in states.values() if s[1] is not None), next(iter(halves.values()), None))
    if cause is None:
        return "no rank is stuck in user code or missing. Every rank: " + "; ".join(s[0] for s in states.values())
    also += [states[r][0] for r in sorted(states) if states[r][0] not in cause]  # (those the cause does not say)
    return cause + (f". Also: {'; '.join(also)}" if also else "")
