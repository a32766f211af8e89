from __future__ import annotations

import pytest

from pipeline.schedules.actions import Action, Kind, parse_action
from pipeline.schedules.program import Collective, Program
from pipeline.schedules.registry import REGISTRY
from pipeline.schedules.schedule import Schedule, ScheduleError, schedule
from pipeline.schedules.validate import render_program, validate


def _load(text: str, **kwargs: int | bool | str) -> Schedule:
    return Schedule.from_text(text, check=False, **kwargs)  # type: ignore[arg-type]


def _error(text: str, **kwargs: int | bool | str) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(_load(text, **kwargs))
    return str(info.value)


GOOD = "0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1"


def test_good_schedule_passes() -> None:
    validate(_load(GOOD))
    validate(schedule("zb-h1", 4, 8))


def test_missing_action() -> None:
    msg = _error("0F0 0F1 0B0 0B1\n1F0 1B0 1F1")
    assert "missing action(s) 1B1" in msg


def test_duplicated_action() -> None:
    msg = _error("0F0 0F1 0B0 0B1 0F1\n1F0 1B0 1F1 1B1")
    assert "duplicated action(s) 0F1" in msg
    assert "[0F1]" in msg and msg.count("[0F1]") == 2  # both places marked


def test_broken_dependency_on_one_rank() -> None:
    msg = _error("0B0 0F0")
    assert "broken dependency: 0B0 at rank 0 step 0 runs before 0F0 (step 1)" in msg
    # neighbour stages on the same rank (p = 1): stage 1's forward needs stage 0's first
    msg = _error("1F0 0F0 1B0 0B0")
    assert "broken dependency: 1F0 at rank 0 step 0 runs before 0F0" in msg
    msg = _error("0F0 0W0 0B0")
    assert "broken dependency: 0W0" in msg


def test_broken_backward_dependency_between_local_stages() -> None:
    # One rank holds stages 0 and 1: B(0, 0) needs the gradient that B(1, 0) computes.
    # No communication is involved, so only the local-order check can see it.
    msg = _error("0F0 1F0 0B0 1B0")
    assert "broken dependency: 0B0 at rank 0 step 2 runs before 1B0 (step 3), which it needs" in msg
    assert "[0B0]" in msg and "[1B0]" in msg
    validate(_load("0F0 1F0 1B0 0B0"))  # the right order passes
    # across ranks (p = 2, v = 2) the receive of 3B0's gradient orders 2B0 after it
    validate(_load("0F0 2F0 2B0 0B0\n1F0 3F0 3B0 1B0"))


def test_deadlock() -> None:
    # Rank 0 waits for micro-batch 0's gradient before sending micro-batch 1's activation,
    # while rank 1 wants both activations before its first backward.
    msg = _error("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1")
    assert msg.startswith("schedule 'custom' (p=2, m=2): deadlock")
    assert "rank 0 is stuck at wait 0RECV_B0; rank 1 is stuck at wait 1RECV_F1" in msg
    grid = msg.splitlines()[1:]
    assert grid[0].split()[:3] == ["step", "0", "1"]
    # the grid is the programs', the stuck instruction of each rank bracketed
    assert grid[1].startswith("rank 0 post 0RECV_B0 0F0") and "[wait 0RECV_B0]" in grid[1]
    assert (
        grid[2].startswith("rank 1 post 1RECV_F0 post 1RECV_F1 wait 1RECV_F0")
        and "[wait 1RECV_F1]" in grid[2]
    )
    assert msg.count("[") == 2


def test_the_blocking_sends_model_reports_on_the_lowered_lists() -> None:
    with pytest.raises(ScheduleError) as info:
        validate(_load("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1"), blocking_sends=True)
    assert "deadlock: with blocking sends" in str(info.value) and "[0RECV_B0]" in str(info.value)


def test_deadlock_across_virtual_stages() -> None:
    # Every rank starts with the forward of its later stage, whose input never comes.
    msg = _error("3F0 0F0 3B0 0B0\n4F0 1F0 4B0 1B0\n5F0 2F0 5B0 2B0")
    assert "deadlock" in msg
    assert all(f"[wait {s}RECV_F0]" in msg for s in (3, 4, 5))


def test_order_mismatch() -> None:
    msg = _error("0F0 0F1 0B0 0B1\n1F1 1F0 1B0 1B1")
    assert (
        "order mismatch on rank 0 -> rank 1: message 0 is sent as 0SEND_F0 but received as the one of "
        "0SEND_F1" in msg
    )
    assert "[post 0SEND_F0]" in msg and "[post 1RECV_F1]" in msg


def test_wrong_rank_range_and_w_without_split() -> None:
    assert "stage 1 lives on rank 1" in _error("1F0 1B0\n0F0 0B0")
    with pytest.raises(ScheduleError, match="W but split_backward is False"):
        validate(_load("0F0 0B0 0W0", split_backward=False))
    sched = Schedule("bad", 2, 1, 1, False, ((Action(2, Kind.F, 0),),))
    with pytest.raises(ScheduleError, match=r"names stage 2, outside 0\.\.1"):
        validate(sched)
    sched = Schedule("bad", 1, 1, 1, False, ((Action(0, Kind.F, 0), Action(0, Kind.SEND_F, 0)),))
    with pytest.raises(ScheduleError, match="is a communication action"):
        validate(sched)
    with pytest.raises(ScheduleError, match=r"n_stages \(3\) must be a multiple of n_ranks \(2\)"):
        validate(Schedule("bad", 3, 2, 1, False, ((), ())))


def test_wrong_rank_under_the_v_is_refused_naming_the_placement() -> None:
    # p = 2, v = 2 in a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (the turn)
    v_order = "0F0 3F0 3B0 0B0\n1F0 2F0 2B0 1B0"
    validate(_load(v_order, placement="v"))
    msg = _error(v_order)  # the loop placement puts stage 3 on rank 1
    assert "stage 3 lives on rank 1 (placement 'loop')" in msg
    msg = _error("0F0 2F0 2B0 0B0\n1F0 3F0 3B0 1B0", placement="v")
    assert "action 2F0 at rank 0 step 1 is on rank 0 but stage 2 lives on rank 1 (placement 'v')" in msg
    with pytest.raises(ValueError, match="unknown placement 'w'; valid placements are loop, v"):
        Schedule.from_text(v_order, placement="w")


def test_error_is_value_error() -> None:
    assert issubclass(ScheduleError, ValueError)


def test_render_program_elides_wide_grids() -> None:
    program = [[parse_action(f"0F{i}") for i in range(40)]]
    text = render_program(program, {(0, 20)})
    assert "[0F20]" in text and "0F0 " not in text and "0F39" not in text
    assert text.splitlines()[1].split()[2] == "..."
    assert render_program(program).splitlines()[1].split()[-1] == "..."


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_built_ins_validate(p: int, m: int) -> None:
    for name, e in REGISTRY.items():  # every registered schedule
        if not e.m_multiple_of_p or m % p == 0:
            validate(schedule(name, p, m, n_virtual=max(2, e.min_virtual) if e.max_virtual != 1 else 1))


def test_blocking_sends_model() -> None:
    # 1F1B-style orders pair every send with a receive the peer posts in the same block...
    for name in ("gpipe", "1f1b", "zb-h1"):
        validate(schedule(name, 4, 8), blocking_sends=True)
    validate(schedule("interleaved-1f1b", 2, 2, n_virtual=2), blocking_sends=True)  # m == p
    # ...but interleaved 1F1B with m > p has two ranks sending to each other at once.
    sched = schedule("interleaved-1f1b", 2, 4, n_virtual=2)
    with pytest.raises(ScheduleError, match="deadlock: with blocking sends") as info:
        validate(sched, blocking_sends=True)
    assert "[2SEND_B0]" in str(info.value) and "[3SEND_B1]" in str(info.value)
    # The plain deadlock deadlocks in both models.
    deadlocked = _load("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1")
    for blocking in (False, True):
        with pytest.raises(ScheduleError, match="deadlock"):
            validate(deadlocked, blocking_sends=blocking)


def _with_tails(sched: Schedule, tails: dict[int, list[Collective]]) -> Schedule:
    """``sched`` whose programs end in ``tails`` (rank -> its collectives) instead of their own."""
    programs = list(sched.programs())
    for r, tail in tails.items():
        body = programs[r].instructions[: len(programs[r]) - len(programs[r].tail())]
        programs[r] = Program(r, (*body, *tail))
    object.__setattr__(sched, "programs", lambda **_: tuple(programs))  # an edited copy's programs
    return sched


TIES01, TIES012 = Collective("all_reduce", "ties", (0, 1)), Collective("all_reduce", "ties", (0, 1, 2))
LOSS = Collective("broadcast", "loss", (0, 1, 2), root=2)


def test_tied_weights_and_the_loss_are_checked_in_the_programs() -> None:
    sched = schedule("1f1b", 3, 3)
    validate(sched, dp=2, ties=[(0, 1), (0, 1, 2), (1, 0)])
    assert [str(x) for x in sched.program(1, ties=[(0, 1), (0, 1, 2)]).tail()] == [
        "all_reduce ties 0,1", "all_reduce ties 0,1,2", "broadcast loss 2 0,1,2",
    ]  # fmt: skip


def test_collectives_out_of_order_within_a_group() -> None:
    sched = _with_tails(schedule("1f1b", 3, 3), {0: [TIES012, LOSS], 1: [LOSS, TIES012], 2: [TIES012, LOSS]})
    with pytest.raises(ScheduleError) as info:
        validate(sched)
    msg = str(info.value)
    assert (
        "collective order mismatch on ranks 0,1,2: as its collective 0 on them, rank 0 runs all_reduce "
        "ties 0,1,2; rank 1 runs broadcast loss 2 0,1,2; rank 2 runs all_reduce ties 0,1,2" in msg
    )
    assert msg.count("[") == 3


def test_collectives_of_two_groups_in_crossed_orders_deadlock() -> None:
    """Each group's order agrees, but rank 0 waits in ties 0,1 for rank 1, which waits in ties 0,1,2
    for rank 0."""
    tails = {0: [TIES01, TIES012, LOSS], 1: [TIES012, TIES01, LOSS], 2: [TIES012, LOSS]}
    sched = _with_tails(schedule("1f1b", 3, 3), tails)
    with pytest.raises(ScheduleError) as info:
        validate(sched)
    msg = str(info.value)
    assert "deadlock" in msg
    assert (
        "rank 0 is stuck at all_reduce ties 0,1; rank 1 is stuck at all_reduce ties 0,1,2; rank 2 is stuck "
        "at all_reduce ties 0,1,2" in msg
    )
