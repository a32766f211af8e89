from __future__ import annotations

import pytest

from pipeline.schedules.actions import Action, Kind, parse_action
from pipeline.schedules.schedule import (
    SCHEDULES,
    Schedule,
    ScheduleError,
    default_n_virtual,
    forward_only,
    rank_of,
    schedule,
    schedule_options,
)

# p: ranks, v: virtual stages per rank, m: micro-batches

BUILT_IN = [  # (name, p, m, v): p ranks, each holding v stages, so p * v stages in all
    ("gpipe", 4, 6, 1),
    ("1f1b", 4, 3, 1),
    ("zb-h1", 3, 5, 1),
    ("interleaved-1f1b", 3, 6, 2),
    ("interleaved-1f1b", 2, 2, 2),
    ("interleaved-1f1b", 2, 4, 3),
]


def _lowered_text(sched: Schedule) -> list[str]:
    return [" ".join(str(a) for a in actions) for actions in sched.lowered()]


def test_every_name_is_available() -> None:
    assert SCHEDULES == (
        "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb", "zb-v", "dualpipe-v", "v-half",
        "v-min",
    )  # fmt: skip
    for name in SCHEDULES:
        sched = schedule(name, 4, 4, n_virtual=default_n_virtual(name))
        assert sched.name == name


@pytest.mark.parametrize(("name", "p", "m", "v"), BUILT_IN)
def test_counts_mean_ranks(name: str, p: int, m: int, v: int) -> None:
    sched = schedule(name, p, m, n_virtual=v)
    assert (sched.n_ranks, sched.n_virtual, sched.n_stages, sched.n_microbatches) == (p, v, p * v, m)
    assert len(sched.compute) == p
    for r in range(p):
        assert sched.stages_of(r) == [r + c * p for c in range(v)]
        assert {a.stage for a in sched.compute[r]} == set(sched.stages_of(r))


@pytest.mark.parametrize(("name", "p", "m", "v"), BUILT_IN)
def test_text_round_trip(name: str, p: int, m: int, v: int) -> None:
    sched = schedule(name, p, m, n_virtual=v)
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


def test_v_placement() -> None:
    """zb-v's V: rank r holds stages r and 2p - 1 - r; the turn (p - 1, p) sends nothing."""
    assert [rank_of("v", 3, s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [rank_of("loop", 3, s) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [rank_of("v", 2, s) for s in range(4)] == [0, 1, 1, 0]
    with pytest.raises(ValueError, match="unknown placement 'zigzag'; valid placements are loop, v"):
        rank_of("zigzag", 2, 0)
    sched = schedule("zb-v", 3, 4)
    assert sched.placement == "v" and sched.n_virtual == 2
    assert [sched.stages_of(r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    lowered = sched.lowered()[2]
    assert not [a for a in lowered if not a.kind.is_compute and a.stage in (2, 3) and a.peer_stage in (2, 3)]
    assert "3RECV_F0" not in map(str, lowered) and "2SEND_F0" not in map(str, lowered)
    loaded = Schedule.from_text(sched.to_text(), name="zb-v", placement="v")
    assert loaded == sched
    assert Schedule.from_text(sched.to_text(), name="zb-v", placement="v", check=False) == sched
    assert forward_only(sched).placement == "v"
    assert forward_only(sched).to_text().splitlines()[0].split()[-1] == "5F3"


def test_from_text_explicit_n_stages_and_split() -> None:
    with pytest.raises(ScheduleError, match="missing action"):
        Schedule.from_text("0F0 0B0\n1F0 1B0", n_stages=4)  # stages 2 and 3 never run
    with pytest.raises(ScheduleError, match=r"missing action.*0W0"):
        Schedule.from_text("0F0 0B0", split_backward=True)
    unchecked = Schedule.from_text("0F0 0B0", split_backward=True, check=False)
    assert unchecked.split_backward


def test_from_text_validates_by_default() -> None:
    # B(1, 0) must run before B(0, 0) on a rank that holds both stages
    with pytest.raises(ScheduleError, match="broken dependency: 0B0 at rank 0 step 2 runs before 1B0"):
        Schedule.from_text("0F0 1F0 0B0 1B0")
    assert Schedule.from_text("0F0 1F0 0B0 1B0", check=False).n_stages == 2


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
    sched = schedule("interleaved-1f1b", 1, 2, n_virtual=2)
    assert sched.n_ranks == 1 and sched.n_stages == 2
    assert sched.lowered() == sched.compute
    # p = 2, v = 2: 1 -> 2 crosses ranks, 3 -> 2 as well; stage 0's backward sends nothing.
    sched = schedule("interleaved-1f1b", 2, 2, n_virtual=2)
    lowered = _lowered_text(sched)
    assert "2RECV_F0 2F0 2SEND_F0" in lowered[0]
    assert "0RECV_B0 0B0 " in lowered[0] + " " and "0SEND_B" not in lowered[0]
    assert "3RECV_F0 3F0 3B0 3SEND_B0" in lowered[1]


@pytest.mark.parametrize(("name", "p", "m", "v"), BUILT_IN)
def test_lowering_blocks_are_sends_then_receives(name: str, p: int, m: int, v: int) -> None:
    sched = schedule(name, p, m, n_virtual=v)
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


@pytest.mark.parametrize(("name", "p", "m", "v"), BUILT_IN)
def test_no_w_unless_split(name: str, p: int, m: int, v: int) -> None:
    sched = schedule(name, p, m, n_virtual=v)
    ws = [a for actions in sched.compute for a in actions if a.kind is Kind.W]
    assert sched.split_backward == (name == "zb-h1")
    assert len(ws) == (p * v * m if sched.split_backward else 0)


UNKNOWN = "unknown schedule 'pipedream'; valid schedules are gpipe, 1f1b, interleaved-1f1b, zb-h1"
BAD_OPTIONS = [  # (name, n_ranks, n_microbatches, n_virtual), the message schedule_options gives
    (("pipedream", 4, 4, None), UNKNOWN),
    (("1f1b", 0, 4, None), r"n_ranks \(0\) must be an integer >= 1: the pipeline's ranks \(devices\)"),
    (("1f1b", -2, 4, None), r"n_ranks \(-2\) must be an integer >= 1"),
    (("1f1b", True, 4, None), r"n_ranks \(True\) must be an integer >= 1"),
    (("1f1b", 2.0, 4, None), r"n_ranks \(2\.0\) must be an integer >= 1"),
    (("1f1b", "2", 4, None), r"n_ranks \('2'\) must be an integer >= 1"),
    (("gpipe", 4, 0, None), r"n_microbatches \(0\) must be an integer >= 1"),
    (("gpipe", 4, True, None), r"n_microbatches \(True\) must be an integer >= 1"),
    (("gpipe", 4, 2.0, None), r"n_microbatches \(2\.0\) must be an integer >= 1"),
    (("zb-h1", 4, 4, 0), r"n_virtual \(0\) must be an integer >= 1"),
    (("interleaved-1f1b", 4, 4, 1.5), r"n_virtual \(1\.5\) must be an integer >= 1"),
    (
        ("interleaved-1f1b", 4, 4, 1),
        r"n_virtual \(1\) must be >= 2 for interleaved-1f1b \(stages per rank\); "
        r"pass n_virtual=2 or more, or use schedule='1f1b'",
    ),
    (
        ("1f1b", 4, 4, 2),
        r"n_virtual \(2\) must be 1 for '1f1b', which runs one stage per rank; "
        r"use schedule='interleaved-1f1b' for several stages per rank",
    ),
    (("zb-h1", 4, 4, 3), r"n_virtual \(3\) must be 1 for 'zb-h1'"),
    (("gpipe", 2, 4, 2), r"n_virtual \(2\) must be 1 for 'gpipe'"),
    (
        ("interleaved-1f1b", 4, 6, 2),
        r"n_microbatches \(6\) must be a multiple of the number of ranks \(4\) for interleaved-1f1b; "
        r"use 4 or 8 micro-batches, or schedule='1f1b'",
    ),
    (
        ("interleaved-zb", 4, 6, 2),  # interleaved-1f1b's constraint, with zb-h1's split backward
        r"n_microbatches \(6\) must be a multiple of the number of ranks \(4\) for interleaved-zb; "
        r"use 4 or 8 micro-batches, or schedule='1f1b'",
    ),
    (("interleaved-zb", 2, 3, 3), r"n_microbatches \(3\) must be a multiple of the number of ranks \(2\)"),
    (("interleaved-1f1b", 4, 2, None), r"n_microbatches \(2\).*; use 4 micro-batches, or schedule='1f1b'"),
    (("interleaved-1f1b", 3, 7, 3), r"n_microbatches \(7\).*ranks \(3\).*; use 6 or 9 micro-batches"),
]


@pytest.mark.parametrize(("args", "match"), BAD_OPTIONS)
def test_schedule_options_rejects(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        schedule_options(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("args", "match"), BAD_OPTIONS)
def test_schedule_refuses_what_schedule_options_refuses(args: tuple[object, ...], match: str) -> None:
    name, p, m, v = args
    with pytest.raises(ValueError, match=match):
        schedule(name, p, m, n_virtual=v)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("1f1b", 4), (1, 4)),  # m = p
        (("gpipe", 3), (1, 3)),
        (("zb-h1", 5, 7), (1, 7)),
        (("interleaved-1f1b", 3), (2, 3)),  # v = 2 for interleaved, m = p
        (("interleaved-1f1b", 2, 6), (2, 6)),
        (("interleaved-1f1b", 2, None, 4), (4, 2)),
        (("interleaved-zb", 2), (2, 2)),
        (("zb-v", 3), (2, 3)),
        (("zb-v", 2, 5), (2, 5)),  # any m: no multiple of p needed
        (("1f1b", 2, None, 1), (1, 2)),
    ],
)
def test_schedule_options_defaults(args: tuple[object, ...], expected: tuple[int, int]) -> None:
    assert schedule_options(*args) == expected  # type: ignore[arg-type]
    assert [default_n_virtual(name) for name in SCHEDULES] == [1, 1, 2, 1, 2, 2, 2, 2, 2]
    name, p, *rest = args
    m = rest[0] if rest else None
    v = rest[1] if len(rest) > 1 else None
    sched = schedule(name, p, m, n_virtual=v)  # type: ignore[arg-type]
    assert (sched.n_virtual, sched.n_microbatches) == expected and sched.n_ranks == p


def test_schedule_is_plain_data() -> None:
    sched = schedule("1f1b", 3, 4)
    assert sched.compute[0][0] == parse_action("0F0")
    with pytest.raises(AttributeError):
        sched.name = "other"  # type: ignore[misc]
    assert hash(sched) == hash(Schedule.from_text(sched.to_text(), name="1f1b"))


def test_forward_only_keeps_the_forwards_in_stage_order() -> None:
    from pipeline.schedules.schedule import forward_only

    fwd = forward_only(schedule("interleaved-1f1b", 2, 2, n_virtual=2))
    assert fwd.to_text() == "0F0 0F1 2F0 2F1\n1F0 1F1 3F0 3F1"
    assert not fwd.split_backward and fwd.n_microbatches == 2
    assert [str(a) for a in fwd.lowered()[1]] == [
        "1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1", "1SEND_F1",
        "3RECV_F0", "3F0", "3RECV_F1", "3F1",
    ]  # fmt: skip
