from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.schedules.actions import Action, Kind, format_action, parse_action


@given(st.integers(0, 999), st.sampled_from(list(Kind)), st.integers(0, 999))
def test_text_round_trip(stage: int, kind: Kind, microbatch: int) -> None:
    a = Action(stage, kind, microbatch)
    assert parse_action(format_action(a)) == a
    assert str(a) == f"{stage}{kind.value}{microbatch}"


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("2F0", Action(2, Kind.F, 0)),
        ("0B3", Action(0, Kind.B, 3)),
        ("1W5", Action(1, Kind.W, 5)),
        ("0SEND_B3", Action(0, Kind.SEND_B, 3)),
        ("12RECV_F10", Action(12, Kind.RECV_F, 10)),
        (" 3SEND_F1 ", Action(3, Kind.SEND_F, 1)),
    ],
)
def test_parse(text: str, action: Action) -> None:
    assert parse_action(text) == action


@pytest.mark.parametrize("text", ["", "F0", "2F", "2X0", "2f0", "-1F0", "2F0 1B0", "2SEND0"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse action"):
        parse_action(text)


def test_kind_classes() -> None:
    assert {k for k in Kind if k.is_compute} == {Kind.F, Kind.B, Kind.W}
    assert {k for k in Kind if k.is_send} == {Kind.SEND_F, Kind.SEND_B}
    assert {k for k in Kind if k.is_recv} == {Kind.RECV_F, Kind.RECV_B}


def test_peer_stage() -> None:
    assert parse_action("1SEND_F2").peer_stage == 2
    assert parse_action("2RECV_F2").peer_stage == 1
    assert parse_action("2SEND_B2").peer_stage == 1
    assert parse_action("1RECV_B2").peer_stage == 2
    with pytest.raises(ValueError, match="compute action"):
        _ = parse_action("1F0").peer_stage


def test_an_action_from_another_process_finds_its_equal() -> None:
    # an action hashes once, with its kind's identity: an unpickled one must hash anew in this
    # process, or a dict keyed by actions would miss it (planning and ranks exchange schedules)
    code = (
        "import pickle, sys; from pipeline.schedules.actions import parse_action; "
        "sys.stdout.buffer.write(pickle.dumps([parse_action(t) for t in ('3B7', '0SEND_F2')]))"
    )
    sent = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, timeout=60).stdout
    table = {parse_action("3B7"): "b", parse_action("0SEND_F2"): "send"}
    assert [table.get(a) for a in pickle.loads(sent)] == ["b", "send"]
    assert pickle.loads(pickle.dumps(Kind.W)) is Kind.W


def test_a_compute_action_needs_its_inputs_producers_and_a_message_needs_none() -> None:
    assert parse_action("2F1").needs == (parse_action("1F1"),)
    assert parse_action("2B1").needs == (parse_action("2F1"), parse_action("3B1"))
    assert parse_action("2W1").needs == (parse_action("2B1"),)
    with pytest.raises(ValueError, match=r"2SEND_F1 is a send or receive"):
        _ = parse_action("2SEND_F1").needs
