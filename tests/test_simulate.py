from __future__ import annotations

import math

import pytest

from pipeline.schedules.actions import parse_action
from pipeline.schedules.schedule import Schedule, ScheduleError, schedule
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import TimedAction, TimedReduction, Timeline


def _spans(timeline: Timeline) -> dict[str, tuple[float, float]]:
    return {str(e.action): (e.start, e.end) for e in timeline.events}


def test_exact_timeline_1f1b_two_ranks() -> None:
    t = simulate(schedule("1f1b", 2, 2), forward=1, backward=2)
    assert _spans(t) == {
        "0F0": (0, 1),
        "0F1": (1, 2),
        "1F0": (1, 2),
        "1B0": (2, 4),
        "0B0": (4, 6),
        "1F1": (4, 5),
        "1B1": (5, 7),
        "0B1": (7, 9),
    }
    assert t.makespan == 9
    assert t.busy_time == [6, 6]
    assert t.bubble_fraction == pytest.approx(1 - 12 / 18)
    assert [e.rank for e in t.of_rank(1)] == [1] * 4


def test_reductions_over_replicas_overlap_what_follows_and_the_tail_waits_for_them() -> None:
    """The 1F1B timeline above with replicas: stage 1's reduction (1 s) starts at rank 1's last B
    (7) and is hidden behind rank 0's last B (7-9); stage 0's (3 s) starts at 9, and the loss's
    broadcast waits for it, so the step ends at 12: 3 s exposed."""
    t = simulate(schedule("1f1b", 2, 2), forward=1, backward=2, reduce=[3, 1])
    assert t.reductions == [TimedReduction(1, 1, 7, 8), TimedReduction(0, 0, 9, 12)]
    assert t.makespan == 12 and t.exposed_tail == 3
    assert _spans(t) == _spans(simulate(schedule("1f1b", 2, 2), forward=1, backward=2))  # computes alike
    # the tail's collectives: the broadcast waits for the later rank, then both replicas' all-reduce
    assert t.ends == [12, 12]  # rank 1 waited in the broadcast for rank 0
    t = simulate(schedule("1f1b", 2, 2), forward=1, backward=2, reduce=[3, 1], collective=0.5)
    assert t.makespan == 12 + 0.5 + 0.5 and t.ends == [13, 13]


def test_a_reduction_hides_behind_the_computes_of_another_stage_of_its_rank() -> None:
    """Interleaved, 2 ranks x 2 stages: rank 0's stage 2 is final before stage 0's backwards
    (0B0, 0B1: 2 s each) run, so its reduction overlaps them; rank 0 reduces one stage at a time."""
    sched = schedule("interleaved-1f1b", 2, 2, n_virtual=2)
    plain = simulate(sched, forward=1, backward=2)
    last_b = {e.action.stage: e.end for e in plain.events if e.action.kind.value == "B"}
    end = plain.makespan
    hidden = simulate(sched, forward=1, backward=2, reduce=[0, 0, end - last_b[2], 0])
    assert hidden.makespan == end and hidden.exposed_tail == 0
    assert [x for x in hidden.reductions if x.stage == 2] == [TimedReduction(0, 2, last_b[2], end)]
    longer = simulate(sched, forward=1, backward=2, reduce=[0, 0, end - last_b[2] + 5, 0])
    assert longer.exposed_tail == 5
    # stage 0's reduction queues behind stage 2's on rank 0's one reducer
    both = simulate(sched, forward=1, backward=2, reduce=[1, 0, end - last_b[2] + 5, 0])
    assert [x for x in both.reductions if x.stage == 0] == [TimedReduction(0, 0, end + 5, end + 6)]
    assert both.exposed_tail == 6


def test_comm_latency_only_across_ranks() -> None:
    # p = 2, m = 1: F, hop, F, B, hop, B.
    assert simulate(schedule("1f1b", 2, 1), 1, 2, comm=0.5).makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2
    # one rank holding two stages: no hop at all
    sched = Schedule.from_text("0F0 1F0 1B0 0B0")
    assert simulate(sched, 1, 2, comm=10).makespan == 6


def test_per_stage_costs() -> None:
    t = simulate(schedule("gpipe", 3, 1), forward=[1, 2, 3], backward=[4, 5, 6])
    assert _spans(t)["2F0"] == (3, 6)
    assert _spans(t)["0B0"] == (17, 21)
    assert t.makespan == 21


def test_split_backward_costs() -> None:
    t = simulate(schedule("zb-h1", 1, 1), forward=1, backward=2, weight=3)
    assert _spans(t) == {"0F0": (0, 1), "0B0": (1, 3), "0W0": (3, 6)}
    t = simulate(schedule("1f1b", 1, 1), forward=1, backward=2, weight=3)
    assert _spans(t) == {"0F0": (0, 1), "0B0": (1, 6)}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"forward": -1.0}, "forward cost of stage 0 is -1.0; costs must be finite"),
        ({"backward": math.nan}, "backward cost of stage 0 is nan"),
        ({"weight": [1.0, math.inf]}, "weight has 2 costs but the schedule has 3 stages"),
        ({"weight": [1.0, 1.0, math.inf]}, "weight cost of stage 2 is inf"),
        ({"forward": [1.0] * 4}, "forward has 4 costs but the schedule has 3 stages"),
        ({"comm": -0.1}, r"comm \(-0.1\) must be a finite latency"),
        ({"comm": math.nan}, r"comm \(nan\) must be"),
        ({"forward": "1"}, "forward cost '1' is a string"),
        ({"reduce": [1.0, 1.0]}, "reduce has 2 costs but the schedule has 3 stages"),
        ({"reduce": -1.0}, "reduce cost of stage 0 is -1.0"),
        ({"collective": -1.0}, r"collective \(-1.0\) must be a finite latency"),
    ],
)
def test_bad_costs(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"forward": 1.0, "backward": 1.0} | kwargs
    with pytest.raises(ValueError, match=match):
        simulate(schedule("1f1b", 3, 2), **args)  # type: ignore[arg-type]


def test_unrunnable_schedule_raises() -> None:
    sched = Schedule.from_text("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1", check=False)
    with pytest.raises(ScheduleError, match="cannot finish: every rank waits"):
        simulate(sched, 1, 1)


def _event(rank: int, text: str, start: float, end: float) -> TimedAction:
    return TimedAction(rank, parse_action(text), start, end)


def test_measured_timeline_with_communication() -> None:
    # What the executor records: comm events, an offset clock, split backward.
    t = Timeline(
        [
            _event(0, "0F0", 10.0, 11.0),
            _event(0, "0SEND_F0", 11.0, 11.5),
            _event(1, "1RECV_F0", 10.0, 11.5),
            _event(1, "1F0", 11.5, 12.5),
            _event(1, "1B0", 12.5, 13.0),
            _event(1, "1SEND_B0", 13.0, 13.2),
            _event(1, "1W0", 13.2, 14.0),
            _event(0, "0RECV_B0", 11.5, 13.2),
            _event(0, "0B0", 13.2, 14.0),
        ],
        n_ranks=2,
    )
    assert t.makespan == 4.0
    assert t.busy_time == pytest.approx([1.8, 2.3])  # float sums of the durations
    assert t.bubble_fraction == pytest.approx(1 - 4.1 / 8)
    assert t.peak_activations == [1, 1]


def test_peak_activations_counts_until_last_backward() -> None:
    # The W keeps micro-batch 0 alive while micro-batch 1 starts; ends at a start do not overlap.
    t = Timeline(
        [
            _event(0, "0F0", 0, 1),
            _event(0, "0B0", 1, 2),
            _event(0, "0F1", 2, 3),
            _event(0, "0W0", 3, 4),
            _event(0, "0B1", 4, 5),
            _event(0, "0W1", 5, 6),
        ],
        1,
    )
    assert t.peak_activations == [2]
    t = Timeline(
        [_event(0, "0F0", 0, 1), _event(0, "0B0", 1, 2), _event(0, "0F1", 2, 3), _event(0, "0B1", 3, 4)], 1
    )
    assert t.peak_activations == [1]


def test_empty_timeline() -> None:
    t = Timeline([], 2)
    assert (t.makespan, t.bubble_fraction, t.busy_time, t.peak_activations) == (0.0, 0.0, [0.0, 0.0], [0, 0])
