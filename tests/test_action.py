import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipecore as pc
from pipecore import Action, Kind


@pytest.mark.parametrize("text, stage, kind, mb", [
    ("1F0", 1, Kind.F, 0), ("0I3", 0, Kind.I, 3), ("2W1", 2, Kind.W, 1), ("0B2", 0, Kind.B, 2),
    ("1SEND_F0", 1, Kind.SEND_F, 0), ("2RECV_B3", 2, Kind.RECV_B, 3), ("3RECV_F12", 3, Kind.RECV_F, 12),
    ("4SEND_B7", 4, Kind.SEND_B, 7), ("0UNSHARD", 0, Kind.UNSHARD, None), ("0RESHARD", 0, Kind.RESHARD, None),
    ("10REDUCE_GRAD", 10, Kind.REDUCE_GRAD, None),
])
def test_parse_and_str_round_trip(text, stage, kind, mb):
    a = Action.parse(text)
    assert (a.stage, a.kind, a.microbatch) == (stage, kind, mb)
    assert str(a) == text
    assert Action.from_code(a.code) == a


def test_overlap_container():
    a = Action.parse("(0F3;1B1)OVERLAP_F_B")
    assert a.kind is Kind.OVERLAP_F_B and a.stage == -1 and a.microbatch is None
    assert a.sub_actions == (Action(0, Kind.F, 3), Action(1, Kind.B, 1))
    assert str(a) == "(0F3;1B1)OVERLAP_F_B"
    assert Action.from_code(a.code) == a
    assert a.leaves() == a.sub_actions and a.is_compute


def test_public_contract_example():
    a = pc.Action.parse("1F0")
    assert a == Action(stage=1, kind=pc.Kind.F, microbatch=0)
    assert str(a) == "1F0"


@pytest.mark.parametrize("bad", ["", "F0", "1X0", "1F", "1FF0", "-1F0", "0REDUCE_GRAD3", "0WAIT_REDUCE_GRAD3",
                                 "1WAIT_SEND_F", "(0F1)OVERLAP_F_B", "(0F1;1WAIT_SEND_F1)OVERLAP_F_B",
                                 "(0F1;1SEND_F1)OVERLAP_F_B", "1F0 junk", "(0F1;1B0)"])
def test_bad_strings_raise_schedule_error(bad):
    with pytest.raises(pc.ScheduleError, match="cannot parse action"):
        Action.parse(bad)


def test_string_form_matches_torch():
    from torch.distributed.pipelining.schedules import _Action

    from pipecore.compat.schedules import torch_has_waits

    texts = ["1F0", "0I3", "2W1", "1SEND_F0", "2RECV_B3", "0UNSHARD", "0REDUCE_GRAD", "(0F3;1B1)OVERLAP_F_B"]
    if torch_has_waits():  # torch 2.15's
        texts += ["1WAIT_SEND_F0", "2WAIT_SEND_B3", "0WAIT_REDUCE_GRAD"]
    for text in texts:
        assert str(_Action.from_str(text)) == str(Action.parse(text))
        torchs = _Action.from_str(text)
        if torchs.sub_actions is None:
            assert torchs.computation_type.value == Action.parse(text).kind.name


_single = st.builds(
    lambda s, k, m: Action(s, k, m if k.has_microbatch else None),
    st.integers(0, 65535), st.sampled_from([k for k in Kind if k is not Kind.OVERLAP_F_B]),
    st.integers(0, 2**31))


@given(_single)
def test_round_trip_property(a):
    assert Action.parse(str(a)) == a
    assert Action.from_code(a.code) == a


@given(st.lists(_single.filter(lambda a: a.is_compute), min_size=2, max_size=3))
def test_overlap_round_trip_property(subs):
    a = Action(-1, Kind.OVERLAP_F_B, None, tuple(subs))
    assert Action.parse(str(a)) == a
    assert Action.from_code(a.code) == a


def test_schedule_layer_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, pipecore.schedule as s; s.build_schedule('zbv', 4, 8).lower().validate();"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_errors_users_catch_are_at_the_top_level_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys, pipecore as pc; from pipecore.errors import CommunicationError, InputError, PeerFailedError;"
            "assert (pc.InputError, pc.PeerFailedError, pc.CommunicationError) == (InputError, PeerFailedError, "
            "CommunicationError); assert issubclass(pc.PeerFailedError, pc.PipelineError); pc.ScheduleError;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
