"""A step that hangs says why on every rank, within the timeout and a few seconds (issue 62;
pipecore/runtime/doctor.py): who is stuck, where, since when."""

import re

import pytest

from dist_pool import RankPool, fresh_pool, pool
from doctor_cases import (TIMEOUT, dead_rank, in_flight_seen, lone_collective, missing_step,
                          own_error_between_two_silent_peers, own_error_while_peer_sleeps, slow_backward_half,
                          slow_forward, wait_for_cycle)
from pipecore.runtime.doctor import ANSWER_WITHIN, diagnose

SAID_WITHIN = TIMEOUT + 5  # the bound: the timeout, then a few seconds to ask and answer


def _run(case, allow_dead=False, world=2):
    p = fresh_pool(world)
    try:
        return p.run(case, timeout=120, allow_dead=allow_dead)
    finally:
        p.close()


@pytest.mark.parametrize("world", [2, 3])
def test_a_slow_user_forward_is_named_on_every_rank(world):
    """Before: rank 0 said only that its wait for rank 1's gradients timed out; rank 1, once its forward
    returned, pasted gloo's text twice and a traceback. Now every rank says that the last rank has been in
    its forward of microbatch 2, for how long, and on which line of the user's code (on 3 ranks rank 0
    learns of it from rank 1's "aborted" messages: its PeerFailedError carries the same text)."""
    results = _run(slow_forward, world=world)
    last = world - 1
    for kind, text, seconds, cause in results:
        assert kind in ("CommunicationError", "PeerFailedError"), results
        assert f"rank {last} has been in PP:{last}F2, its forward (user code), for " in text, text
        assert "doctor_cases.py" in text and "time.sleep(2 * TIMEOUT)" in text, text
        assert f"waits in PP:{last - 1}B2 for the output gradients of microbatch 2 from rank {last}" in text, text
        # pipecore's sentences; gloo's text once, as the cause; no Python traceback inside the message
        assert "gloo" not in text and ".cc:" not in text and "At:" not in text and "GLHF" not in text, text
        assert "Traceback" not in text and "File \"" not in text, text
    waited = results[last - 1]  # (the rank whose wait timed out)
    assert waited[3].startswith("RuntimeError: [") and "Timed out waiting 3000ms for recv" in waited[3], waited
    assert all(seconds < SAID_WITHIN for _, _, seconds, _ in results[:-1]), results
    assert results[-1][2] < 3 * TIMEOUT + 5, results  # (it raises once its forward returned, a timeout later at most)


def test_a_slow_backward_in_a_pairs_other_half_is_named():
    """An OVERLAP_F_B pair's backward half runs on a thread of its own; a hook of the user's sleeps there.
    Before, the flight record saw only the step's thread (in the pair, waiting for it or for a peer) and
    the diagnosis said "no rank is stuck in user code or missing", and rank 0 pasted gloo's text of its failed release
    into its message. Now every rank names rank 0's other half, its time in the backward and the hook's
    line (that thread's Python stack)."""
    results = _run(slow_backward_half)
    for kind, text, seconds, cause in results:
        assert kind in ("CommunicationError", "PeerFailedError"), results
        assert re.search(r"rank 0 has been in PP:\(0F\d+;\d+B\d+\)OVERLAP_F_B, its other half \(on a thread of its "
                         r"own\) in a backward \(autograd, and the user's hooks\) for \d+\.\d s", text), text
        assert "doctor_cases.py" in text and "in slow_hook: time.sleep(2 * TIMEOUT)" in text, text
        # (rank 0 learns of it from an "aborted" message, and its release of rank 1 fails: gloo's text is the
        # cause, not pasted into the message)
        assert "gloo" not in text and ".cc:" not in text and "GLHF" not in text, text
    assert results[1][2] < SAID_WITHIN, results


def test_a_ranks_own_error_is_named_when_its_peer_fails_later():
    """Rank 1's forward raises; rank 0 is asleep in its forward meanwhile, so rank 1's release of it times out
    and rank 0's next send finds the connection closed. Before, rank 0 said "rank 1 is in no step of this
    Pipeline ...: every rank must call step() together" (rank 1's step had ended), and rank 1 pasted gloo's
    text of the failed release into its message. Now rank 0 names rank 1's error, which rank 1 left in the
    store; rank 1 raises with its error as the cause and gloo's text as a note."""
    (kind0, text0, _, _), (kind1, text1, notes1, cause1) = _run(own_error_while_peer_sleeps)
    assert kind0 == "CommunicationError" and text0.startswith(
        "rank 0: step 1 failed: rank 1 failed in PP:1F0: RuntimeError: boom in the user's forward (its own error"), \
        text0
    assert "room in its send budget to rank 1" in text0 or "PP:0SEND_F1" in text0, text0
    assert kind1 == "CommunicationError" and "failed on this rank (its error is the cause, above), and telling the " \
        "other ranks failed too: pipecore rank 1, action PP:1F1: waiting for activations of microbatch 1 from rank 0 " \
        "failed (timeout 3 s)" in text1, text1
    assert "gloo" not in text1 and ".cc:" not in text1 and "Timed out waiting" not in text1, text1
    assert cause1.startswith("RuntimeError(\"boom in the user's forward"), cause1
    assert any(n.startswith("what the backend said of telling the other ranks: [") and "Timed out waiting 3000ms" in n
               for n in notes1), notes1


def test_releasing_the_peers_takes_one_timeout_however_many_are_silent():
    """The middle of 3 ranks fails on its own error while rank 0 sleeps in its forward and rank 2 has not
    called step() yet: its release of them meets a wait on each. Before, each wait took a timeout of its own
    (rank 1 raised after 6.0 s, two timeouts; the aborted rest restarted the timeout per wait); now the rest
    only posts once a wait failed. Every rank names rank 1's error."""
    results = _run(own_error_between_two_silent_peers, world=3)
    for kind, text, seconds, cause in results:
        assert kind == "CommunicationError", results
    assert results[1][1].startswith("rank 1: step 1 failed on this rank (its error is the cause, above), and "
                                    "telling the other ranks failed too"), results[1]
    assert results[1][3].startswith("RuntimeError: boom in the user's forward"), results[1]
    assert results[1][2] < 2 * TIMEOUT, results[1]  # (one timeout, and what posting costs)
    for kind, text, seconds, cause in (results[0], results[2]):
        assert text.split(": ", 1)[1].startswith("step 1 failed: rank 1 failed in PP:1F0: RuntimeError: boom in the "
                                                 "user's forward (its own error"), text


def test_a_dead_rank_is_named():
    results = _run(dead_rank, allow_dead=True)
    kind, text, seconds, cause = results[0]
    assert results[1] is None and kind == "CommunicationError", results
    assert text.startswith("rank 0: step 0 failed: rank 1 gave no answer: its process died"), text
    assert seconds < ANSWER_WITHIN + 5, results


def test_a_rank_that_does_not_call_step_is_named():
    results = _run(missing_step)
    kind, text, seconds, cause = results[0]
    assert kind == "CommunicationError", results
    assert "step 1 failed: rank 1 is in no step of this Pipeline (its last was step 0): every rank must call " \
           "step() together" in text, text
    assert seconds < SAID_WITHIN, results


def test_a_collective_on_some_ranks_only_is_named():
    results = _run(lone_collective)
    kind, text, seconds, cause = results[0]
    assert kind == "CommunicationError", results
    assert "rank 1 has been in PP:1F2, its forward (user code)" in text, text
    assert "inside torch.distributed's all_reduce" in text, text
    assert seconds < SAID_WITHIN, results


def test_a_wait_for_cycle_is_named_on_every_rank():
    results = _run(wait_for_cycle)
    for kind, text, seconds, cause in results:
        assert kind == "CommunicationError", results
        assert "step 1 failed: a wait-for cycle: rank 0 waits in PP:0B0 for the output gradients of microbatch 0 " \
               "from rank 1" in text, text
        assert "; rank 1 waits in PP:1F0 for the activations of microbatch 0 from rank 0" in text, text
        # what the schedule says: where each awaited message is sent, and whose program is not the schedule's
        assert "The schedule has rank 1 send the output gradients of microbatch 0 in PP:1SEND_B0 (its action " \
            in text, text
        assert ", and rank 0 send the activations of microbatch 0 in PP:0SEND_F0 (its action 1)" in text, text
        assert "rank 0's program is not the schedule's: its action 1 is PP:0RECV_B0 where the schedule has " \
               "PP:0SEND_F0" in text, text
        assert "rank 1's program" not in text, text
        assert seconds < SAID_WITHIN, results


def test_the_flight_record_lists_the_messages_posted_and_not_seen_complete():
    """300 receives posted at once (GPipe, recv_window 300): in its forward of microbatch 1 the last rank's
    record lists the newest 256 of them, those of microbatches 44 to 299 (tickets 45 to 300 of a ring of 256),
    not microbatch 0's and 1's, waited for, and counts the 44 whose slots later ones took while they were in
    flight. After the step nothing is listed on either rank."""
    during, after = zip(*pool(2).run(in_flight_seen, 300, timeout=120))
    record = during[1]
    listed = record["in_flight"]
    assert [m["label"] for m in listed] == [f"PP:1RECV_F{k}" for k in range(44, 300)], [m["label"] for m in listed]
    assert record["in_flight_unlisted"] == 44, record["in_flight_unlisted"]
    assert all(m["peer"] == 0 and not m["send"] and not m["follow_up"] and m["bytes"] > 0 and m["seconds"] >= 0
               for m in listed), listed[:3]
    assert all(r["in_flight"] == [] and r["in_flight_unlisted"] == 0 for r in after), after


@pytest.mark.parametrize("listed, unlisted, head", [
    (3, 10, "  posted and not seen complete (3, 10 more not listed):"),
    (12, 0, "  posted and not seen complete (12, 4 more not listed):"),
    (0, 5, "  posted and not seen complete (0, 5 more not listed):"),
    (2, 0, "  posted and not seen complete (2):"),
])
def test_the_picture_counts_the_messages_it_does_not_list(listed, unlisted, head):
    from pipecore.runtime.doctor import IN_FLIGHT_SHOWN, _in_flight_lines
    messages = [{"label": f"PP:0SEND_F{k}", "peer": 1, "send": True, "follow_up": False, "bytes": 64, "seconds": 1.0}
                for k in range(listed)]
    lines = _in_flight_lines({"in_flight": messages, "in_flight_unlisted": unlisted})
    assert lines[0] == head and len(lines) == 1 + min(listed, IN_FLIGHT_SHOWN), lines
    assert _in_flight_lines({"in_flight": [], "in_flight_unlisted": 0}) == []


def test_the_flight_record_names_the_phase_of_the_step():
    """The phase as a hang would report it: a step's first run learns its messages' shapes ("discovery"), later
    runs "run"; the replicas' reduction that ends a training step is a phase of its own; between steps, "idle"."""
    from doctor_cases import phases_seen
    results = pool(4).run(phases_seen, timeout=120)
    assert all(seen == [["discovery", "data-parallel reduction", "idle"], ["run", "data-parallel reduction", "idle"]]
               for seen in results), results


def _waiting(peer, mb=0, what="activations", label="PP:0F0"):
    return {"phase": "run", "step": 3, "action": {"label": label, "seconds": 9.0, "part": "waiting"},
            "waiting": {"peer": peer, "microbatch": mb, "what": what, "send": False, "seconds": 9.0}, "stack": []}


def _failed(peer, label="PP:0F0"):  # a rank whose wait failed: its abort waits for others now
    return {"phase": "abort", "step": 3, "action": {"label": "PP:0SEND_F3", "seconds": 0.1, "part": "waiting"},
            "waiting": {"peer": 5, "microbatch": 3, "what": "activations", "send": True, "seconds": 0.1},
            "failed_wait": {"peer": peer, "microbatch": 0, "what": "activations", "send": False, "seconds": 9.0,
                            "action": label}, "stack": []}


def _pair(part, seconds):  # the action of a rank in an OVERLAP_F_B pair whose other half is in `part`
    return {"label": "PP:(1F0;2B1)OVERLAP_F_B", "seconds": seconds, "part": "executor",
            "halves": [{"part": part, "seconds": seconds, "stack": []}]}


@pytest.mark.parametrize("records, cause", [
    # the chain from rank 0 ends at a rank that is the cause
    ({0: _waiting(1), 1: _waiting(2), 2: None}, "rank 2 gave no answer"),
    # the failed wait, not the abort's, is followed
    ({0: _failed(1), 1: None, 5: _waiting(0)}, "rank 1 gave no answer"),
    ({0: _failed(1), 1: _failed(0, label="PP:1F0")}, "a wait-for cycle: rank 0 waits in PP:0F0"),
    # a rank in another step
    ({0: _waiting(1), 1: dict(_waiting(0), step=2)}, "rank 1 is in step 2 of this Pipeline, not step 3"),
    ({0: _waiting(1), 1: {"phase": "idle", "step": 2}}, "rank 1 is in no step of this Pipeline (its last was step 2)"),
    ({0: _waiting(1), 1: {"phase": "idle", "step": -1}}, "rank 1 has not called step() on this Pipeline"),
    # a cycle of three
    ({0: _waiting(1), 1: _waiting(2, label="PP:1F0"), 2: _waiting(0, label="PP:2B0")},
     "a wait-for cycle: rank 0 waits in PP:0F0 for the activations of microbatch 0 from rank 1 (9.0 s); rank 1 "
     "waits in PP:1F0"),
    # a wait at the step's end (no one peer) follows its oldest send not complete (listed oldest first)
    ({0: dict(_waiting(-1, what="the step's work on the device", label="PP:0B3"), in_flight=[
        {"label": "PP:0RECV_B3", "peer": 2, "send": False},
        {"label": "PP:0SEND_F3", "peer": 1, "send": True}, {"label": "PP:0SEND_F4", "peer": 2, "send": True}]),
      1: {"phase": "run", "step": 3, "action": {"label": "PP:1F3", "seconds": 9.0, "part": "forward"}, "stack": []}},
     "rank 1 has been in PP:1F3, its forward (user code), for 9.0 s. Also: rank 0 waits in PP:0B3 for the step's "
     "work on the device (9.0 s), the oldest not complete its PP:0SEND_F3 to rank 1"),
    ({0: _waiting(-1, what="the step's last sends", label="PP:0B3")}, "no rank is stuck in user code or missing"),
    # an OVERLAP_F_B pair's other half in user code: the cause where the step's thread does not wait, or where
    # its wait comes back round; a wait of the step's thread is followed first (rank 1 gave no answer)
    ({0: _waiting(1), 1: dict(_waiting(0, label="PP:1F0"), action=_pair("backward", 9.0))},
     "rank 1 has been in PP:(1F0;2B1)OVERLAP_F_B, its other half (on a thread of its own) in a backward (autograd, "
     "and the user's hooks) for 9.0 s (a wait-for cycle: rank 0 waits in PP:0F0"),
    ({0: dict(_waiting(1), action=_pair("backward", 9.0)), 1: None}, "rank 1 gave no answer"),
    ({0: {"phase": "run", "step": 3, "action": _pair("forward", 9.0), "waiting": None, "stack": []}},
     "rank 0 has been in PP:(1F0;2B1)OVERLAP_F_B, its other half (on a thread of its own) in its forward"),
    ({0: {"phase": "run", "step": 3, "action": _pair("backward", 1.0), "waiting": None, "stack": []}},
     "no rank is stuck in user code or missing"),
    # a rank in user code for less than half the timeout is not the cause; nothing is
    ({0: _waiting(1), 1: {"phase": "run", "step": 3, "action": {"label": "PP:1F0", "seconds": 1.0, "part": "forward"},
                          "waiting": None, "stack": []}}, "no rank is stuck in user code or missing"),
])
def test_the_diagnosis_follows_the_wait_for_chain(records, cause):
    assert diagnose(0, records, timeout=10.0, step=3).startswith(cause)


def test_an_error_a_rank_left_in_the_store_is_the_cause():
    """A rank whose step failed on its own error told its peers through the store and left its step: its error
    is the cause, not its being in no step."""
    records = {0: _waiting(1), 1: {"phase": "idle", "step": 3}}
    text = diagnose(0, records, 10.0, 3, published="rank 1 failed in PP:1F0: RuntimeError: boom")
    assert text.startswith("rank 1 failed in PP:1F0: RuntimeError: boom (its own error: its step ended on it). "
                           "Also: rank 0 waits in PP:0F0"), text
    # a chain that meets it, or ends at a rank that gave no answer: still its error first
    records = {0: _waiting(1), 1: _waiting(2, label="PP:1F0"), 2: None}
    for published in ("rank 1 failed in PP:1F0: RuntimeError: boom", "rank 2 failed in PP:2F0: RuntimeError: boom"):
        assert diagnose(0, records, 10.0, 3, published=published).startswith(published), published
    # a chain that ends at a rank in user code it does not meet: that rank first, the error after
    records = {0: _waiting(1), 1: {"phase": "run", "step": 3, "stack": [],
                                   "action": {"label": "PP:1F0", "seconds": 9.0, "part": "forward"}}, 2: None}
    text = diagnose(0, records, 10.0, 3, published="rank 2 failed in PP:2F0: RuntimeError: boom")
    assert text.startswith("rank 1 has been in PP:1F0, its forward (user code), for 9.0 s. Also: rank 2 failed in "
                           "PP:2F0: RuntimeError: boom (its own error: its step ended on it)"), text


def test_a_cycle_is_told_against_the_schedule():
    """A wait-for cycle names the ranks whose programs are not the schedule's rows (the first action that
    differs; FSDP2's UNSHARD and RESHARD, which a rank adds to its own row, do not count), and where the
    schedule has each awaited message sent."""
    import pipecore as pc
    from pipecore.executor.program import labels_of

    lowered = pc.build_schedule("1f1b", 2, 4).lower()
    rows = {r: labels_of(lowered, r) for r in (0, 1)}
    waits = {0: _waiting(1, what="output gradients", label="PP:0B0"), 1: _waiting(0, label="PP:1F0")}
    records = {r: dict(waits[r], program=rows[r]) for r in (0, 1)}
    records[0]["program"] = ["PP:0UNSHARD"] + rows[0]  # (a rank's own actions are not a difference)
    ranks = [0, 1]
    text = diagnose(0, records, 10.0, 3, lowered, ranks)
    sent = f"PP:1SEND_B0 (its action {rows[1].index('PP:1SEND_B0')})"
    assert text.startswith("a wait-for cycle: rank 0 waits in PP:0B0 for the output gradients of microbatch 0 from "
                           f"rank 1 (9.0 s); rank 1 waits in PP:1F0 for the activations of microbatch 0 from rank 0 "
                           f"(9.0 s). The schedule has rank 1 send the output gradients of microbatch 0 in {sent}, and "
                           "rank 0 send the activations of microbatch 0 in PP:0SEND_F0 (its action 1)"), text
    assert "program" not in text, text
    # a rank whose program is another: its first difference, also where its program is shorter
    records[1]["program"] = rows[1][:3] + rows[1][4:]
    text = diagnose(0, records, 10.0, 3, lowered, [0, 1])
    assert f"rank 1's program is not the schedule's: its action 3 is {rows[1][4]} where the schedule has {rows[1][3]}" \
        in text, text
    records[1]["program"] = rows[1][:-1]
    text = diagnose(0, records, 10.0, 3, lowered, [0, 1])
    assert f"its action {len(rows[1]) - 1} is the end where the schedule has {rows[1][-1]}" in text, text
    # global ranks other than the group's (a pipeline of ranks 4 and 6)
    moved = {4 + 2 * r: dict(rec, waiting=dict(rec["waiting"], peer=4 + 2 * rec["waiting"]["peer"]))
             for r, rec in records.items()}
    text = diagnose(4, moved, 10.0, 3, lowered, [4, 6])
    assert "The schedule has rank 6 send the output gradients of microbatch 0 in PP:1SEND_B0" in text, text
    assert "rank 6's program is not the schedule's" in text, text
    # a discovery's wait, on a receive's label: the same send; a wait for no one message: none
    records[1] = dict(_waiting(0, what="shapes of the activations", label="PP:1RECV_F0"), program=rows[1])
    text = diagnose(0, records, 10.0, 3, lowered, ranks)
    assert "rank 0 send the shapes of the activations of microbatch 0 in PP:0SEND_F0 (its action 1)" in text, text
    records[1] = dict(_waiting(0, what="room in its send budget", label="PP:1SEND_B0"), program=rows[1])
    text = diagnose(0, records, 10.0, 3, lowered, ranks)
    assert "The schedule has rank 1 send the output gradients" in text and "rank 0 send" not in text, text


def test_the_files_of_a_failed_step_give_the_whole_picture(tmp_path, monkeypatch):
    """With PIPECORE_FLIGHT_DIR, each rank whose step failed leaves its record and the diagnosis there;
    `python -m pipecore doctor DIR` prints them."""
    import subprocess
    import sys

    monkeypatch.setenv("PIPECORE_FLIGHT_DIR", str(tmp_path))
    p = RankPool(2, spawn=True)  # (spawned: the ranks see the variable)
    try:
        p.run(slow_forward, timeout=120)
    finally:
        p.close()
    out = subprocess.run([sys.executable, "-m", "pipecore", "doctor", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("step 0: rank 1 has been in PP:1F2, its forward (user code)"), text
    assert "rank 0 when its step failed: step 0, phase abort" in text and "failed wait: PP:0B2 for the output " \
        "gradients of microbatch 2 from rank 1 after 3." in text, text
    assert "rank 1 when asked: step 0, phase discovery, in PP:1F2 (forward) for 3." in text, text
    assert "time.sleep(2 * TIMEOUT)" in text, text  # (its stack when asked)
    longest = re.search(r"longest of its last \d+ actions: PP:1F2, (\d+\.\d{3}) ms", text)
    assert longest and float(longest.group(1)) >= 2000 * TIMEOUT, text  # (it slept 6 s)
    assert "rank 1 when its step failed: step 0, phase abort" in text, text
    # the receive whose wait timed out is still posted; those of microbatches 0 and 1 completed
    assert re.search(r"\n  posted and not seen complete \(\d+\):\n(  .*\n)*?\s+PP:0RECV_B2  from rank 1, \d+ bytes, "
                     r"posted \d+\.\d s before", text), text
    assert not re.search(r"PP:0RECV_B[01]  from", text), text
