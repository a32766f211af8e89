from __future__ import annotations

import pytest

from pipeline.schedules.actions import Action, Kind, parse_action
from pipeline.schedules.schedule import SCHEDULES, Schedule, ScheduleError, schedule

# p: ranks, v: virtual stages per rank, m: micro-batches

BUILT_IN = [
    ("gpipe", 4, 6, 1),
    ("1f1b", 4, 3, 1),
    ("zb-h1", 3, 5, 1),
    ("interleaved-1f1b", 6, 6, 2),
    ("interleaved-1f1b", 4, 2, 2),
]


def _lowered_text(sched: Schedule) -> list[str]:
    return [" ".join(str(a) for a in actions) for actions in sched.lowered()]


def test_every_name_is_available() -> None:
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
    for name in SCHEDULES:
        sched = schedule(name, 4, 4, n_virtual=2 if name == "interleaved-1f1b" else 1)
        assert sched.name == name


@pytest.mark.parametrize(("name", "n_stages", "m", "v"), BUILT_IN)
def test_text_round_trip(name: str, n_stages: int, m: int, v: int) -> None:
    sched = schedule(name, n_stages, m, n_virtual=v)
    loaded = Schedule.from_text(sched.to_text(), name=name)
    assert loaded == sched
    assert loaded.to_text() == sched.to_text()
    assert len(sched.to_text().splitlines()) == sched.n_ranks


def test_from_text_infers_shape() -> None:
    sched = Schedule.from_text("0F0 2F0 2B0 0B0\n1F0 3F0 3B0 1B0\n")
    assert (sched.name, sched.n_ranks, sched.n_stages, sched.n_microbatches) == ("custom", 2, 4, 1)
    assert sched.n_virtual == 2 and not sched.split_backward
    assert sched.stages_of(1) == [1, 3] and sched.rank_of(2) == 0
    split = Schedule.from_text("0F0 0B0 0W0", name="mine")
    assert split.split_backward and split.name == "mine" and split.n_ranks == 1


def test_from_text_explicit_n_stages_and_split() -> None:
    with pytest.raises(ScheduleError, match="missing action"):
        Schedule.from_text("0F0 0B0\n1F0 1B0", n_stages=4)  # stages 2 and 3 never run
    with pytest.raises(ScheduleError, match=r"missing action.*0W0"):
        Schedule.from_text("0F0 0B0", split_backward=True)
    unchecked = Schedule.from_text("0F0 0B0", split_backward=True, check=False)
    assert unchecked.split_backward


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty schedule text"),
        ("0F0 0SEND_F0", "communication action 0SEND_F0"),
        ("0F0 0Q0", "cannot parse action '0Q0'"),
    ],
)
def test_from_text_rejects(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Schedule.from_text(text)


def test_lowering_1f1b_two_ranks() -> None:
    sched = schedule("1f1b", 2, 2)
    assert sched.to_text() == "0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1"
    assert _lowered_text(sched) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    ]
    assert sched.lowered() is sched.lowered()  # cached


def test_lowering_middle_stage_and_split() -> None:
    sched = schedule("zb-h1", 3, 1)
    assert _lowered_text(sched)[1] == "1RECV_F0 1F0 1SEND_F0 1RECV_B0 1B0 1SEND_B0 1W0"


def test_lowering_skips_local_neighbours() -> None:
    # One rank holding every stage: nothing to send.
    sched = schedule("interleaved-1f1b", 2, 2, n_virtual=2)
    assert sched.n_ranks == 1
    assert sched.lowered() == sched.compute
    # p = 2, v = 2: 1 -> 2 crosses ranks, 3 -> 2 as well; stage 0's backward sends nothing.
    sched = schedule("interleaved-1f1b", 4, 2, n_virtual=2)
    lowered = _lowered_text(sched)
    assert "2RECV_F0 2F0 2SEND_F0" in lowered[0]
    assert "0RECV_B0 0B0 " in lowered[0] + " " and "0SEND_B" not in lowered[0]
    assert "3RECV_F0 3F0 3B0 3SEND_B0" in lowered[1]


@pytest.mark.parametrize(("name", "n_stages", "m", "v"), BUILT_IN)
def test_lowering_blocks_are_sends_then_receives(name: str, n_stages: int, m: int, v: int) -> None:
    sched = schedule(name, n_stages, m, n_virtual=v)
    for compute, lowered in zip(sched.compute, sched.lowered(), strict=True):
        assert tuple(a for a in lowered if a.kind.is_compute) == compute
        block: list[Action] = []
        for a in [*lowered, Action(0, Kind.F, 0)]:
            if not a.kind.is_compute:
                block.append(a)
                continue
            kinds = [b.kind.is_send for b in block]
            assert kinds == sorted(kinds, reverse=True), block  # sends first
            assert len([b for b in block if b.kind.is_recv]) <= 1
            block = []


@pytest.mark.parametrize(("name", "n_stages", "m", "v"), BUILT_IN)
def test_no_w_unless_split(name: str, n_stages: int, m: int, v: int) -> None:
    sched = schedule(name, n_stages, m, n_virtual=v)
    ws = [a for actions in sched.compute for a in actions if a.kind is Kind.W]
    assert sched.split_backward == (name == "zb-h1")
    assert len(ws) == (n_stages * m if sched.split_backward else 0)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (
            ("pipedream", 4, 4),
            {},
            "unknown schedule 'pipedream'; valid schedules are gpipe, 1f1b, interleaved-1f1b, zb-h1",
        ),
        (("1f1b", 0, 4), {}, r"n_stages \(0\) must be an integer >= 1"),
        (("gpipe", 4, 0), {}, r"n_microbatches \(0\) must be an integer >= 1"),
        (("interleaved-1f1b", 4, 4), {}, r"n_virtual \(1\) must be >= 2 for interleaved-1f1b"),
        (
            ("interleaved-1f1b", 6, 4),
            {"n_virtual": 4},
            r"n_stages \(6\) must be a multiple of n_virtual \(4\)",
        ),
        (
            ("interleaved-1f1b", 8, 6),
            {"n_virtual": 2},
            r"n_microbatches \(6\) must be a multiple of the number "
            r"of ranks \(4\) for interleaved-1f1b; use 4 or 8 micro-batches",
        ),
        (("interleaved-1f1b", 8, 2), {"n_virtual": 2}, "use 4 micro-batches, or schedule='1f1b'"),
        (("1f1b", 4, 4), {"n_virtual": 2}, r"n_virtual \(2\) must be 1 for '1f1b'"),
        (("zb-h1", 4, 4), {"n_virtual": 0}, r"n_virtual \(0\) must be 1 for 'zb-h1'"),
    ],
)
def test_bad_input(args: tuple[str, int, int], kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        schedule(*args, **kwargs)


def test_schedule_is_plain_data() -> None:
    sched = schedule("1f1b", 3, 4)
    assert sched.compute[0][0] == parse_action("0F0")
    with pytest.raises(AttributeError):
        sched.name = "other"  # type: ignore[misc]
    assert hash(sched) == hash(Schedule.from_text(sched.to_text(), name="1f1b"))


def test_forward_only_keeps_the_forwards_in_stage_order() -> None:
    from pipeline.schedules.schedule import forward_only

    fwd = forward_only(schedule("interleaved-1f1b", 4, 2, n_virtual=2))
    assert fwd.to_text() == "0F0 0F1 2F0 2F1\n1F0 1F1 3F0 3F1"
    assert not fwd.split_backward and fwd.n_microbatches == 2
    assert [str(a) for a in fwd.lowered()[1]] == [
        "1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1", "1SEND_F1",
        "3RECV_F0", "3F0", "3RECV_F1", "3F1",
    ]  # fmt: skip
