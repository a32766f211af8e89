"""zb-v at 1F1B's memory (issue 46): every p and m it takes, its peak against 1F1B's, its bubble against
the greedy order it replaced, unequal costs, and torch's ``ScheduleZBVZeroBubble`` in our simulator.

# p: ranks, m: micro-batches; a "unit" is one action at F = B = W = 1. Memory is counted in stage
# activations (a (stage, micro-batch) pair from its F's start to its W's end, ``peak_activations``): a
# V stage is half a 1F1B stage, so 1F1B at equal work costs 2 per action and its rank 0's p
# micro-batches are 2p of ours.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.schedules.peaks import StageBytes, rank_peaks
from pipeline.schedules.schedule import Schedule, schedule, unchecked
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import Timeline

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bench_schedules import GREEDY_COSTS, greedy_v_schedule, torch_v_schedule

# The bubble (the step less 6m) at F = B = W = 1 of the greedy order zb-v ran before (commit 3498704:
# ``_greedy_v(p, m, cap=2p + 1)``, which held up to 3p - 1), for m = 1 .. 4p + 3, as it printed then
# (``greedy_v_schedule`` rebuilds that order: test_the_greedy_reference_is_the_order_zb_v_ran_before).
GREEDY_BUBBLE = {
    1: (0, 0, 0, 0, 0, 0, 0),
    2: (3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1),
    3: (7, 4, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2),
    4: (11, 7, 5, 3, 4, 3, 3, 3, 4, 3, 4, 3, 4, 3, 3, 3, 3, 3, 3),
    5: (15, 11, 8, 6, 4, 6, 5, 4, 4, 4, 5, 4, 4, 4, 6, 4, 4, 4, 4, 6, 4, 5, 4),
    6: (19, 15, 11, 9, 7, 5, 8, 7, 5, 5, 5, 5, 5, 7, 5, 5, 5, 5, 6, 7, 5, 5, 6, 7, 6, 6, 8),
    7: (23, 19, 15, 12, 10, 8, 6, 10, 9, 6, 6, 6, 6, 6, 7, 9, 6, 6, 6, 7, 7, 9, 10, 8, 8, 8, 8, 8, 8, 10, 8),
    8: (27, 23, 19, 15, 13, 11, 9, 7, 12, 11, 8, 7, 7, 7, 7, 7, 9, 11, 7, 7, 7, 7, 7, 10, 8, 10, 8, 7, 7, 10,
        7, 7, 7, 8, 7),
}  # fmt: skip


def _bubble(t: Timeline, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """The step less a rank's work (two stages, m micro-batches, F + B + W each)."""
    return t.makespan - 2 * m * (f + b + w)


@functools.cache
def _order(who: str, p: int, m: int) -> Schedule:
    """``who``'s order for p and m, built once for the module (the tests below read the same orders):
    "zb-v" ours as the search builds it (``_validated`` checks it), "greedy" the order it replaced,
    "torch" torch's, validated."""
    if who == "zb-v":
        return unchecked("zb-v", p, m, 2)
    if who == "greedy":
        return greedy_v_schedule(p, m)
    assert who == "torch", who
    return torch_v_schedule("zb-v", p, m)


@functools.cache
def _validated(p: int, m: int) -> Schedule:
    """Our zb-v order as ``schedule`` builds and validates it (messages in order, no deadlock, the
    drain), once per p and m; the order ``_order("zb-v", p, m)`` simulates, action for action."""
    sched = schedule("zb-v", p, m)
    assert sched == _order("zb-v", p, m), (p, m)
    return sched


@functools.cache
def _sim(who: str, p: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> Timeline:
    """``_order(who, p, m)`` simulated at F, B, W, once for the module."""
    return simulate(_order(who, p, m), f, b, w)


@pytest.fixture(scope="module", autouse=True)
def _free_the_orders() -> Iterator[None]:
    """The caches above hold this module's orders and timelines (about 100 MB): freed after it, not
    kept in the pytest worker for the rest of the run."""
    yield
    for cached in (_order, _validated, _sim):
        cached.cache_clear()


# p = 7, 8 check what p <= 6 check, at sizes whose orders take seconds to build and validate: -m slow
_PS = [p if p <= 6 else pytest.param(p, marks=pytest.mark.slow) for p in sorted(GREEDY_BUBBLE)]


@pytest.mark.parametrize("p", _PS)
def test_holds_1f1b_peak_with_the_greedy_orders_bubble_or_less(p: int) -> None:
    """Every m from 1 to 4p + 3: the order validates; every rank holds at most 1F1B's peak (its rank
    0's, 2 min(p, m) of ours), and the partitioner's walk of the program counts the same; the bubble
    is the greedy order's or less, and from m = p on the bound p - 1 (rank p - 1's first input)."""
    ones = [StageBytes(saved=1.0, input=0.0, output=0.0)] * (2 * p)
    for m in (1, p, 4 * p + 3):  # 1F1B's peak, min(p, m) on rank 0 (test_generators.py for every m)
        assert max(simulate(schedule("1f1b", p, m), 2, 2, 2).peak_activations) == min(p, m)
    for m in range(1, 4 * p + 4):
        sched = _validated(p, m)
        t = _sim("zb-v", p, m)
        assert max(t.peak_activations) <= 2 * min(p, m), (m, t.peak_activations)
        assert rank_peaks(sched, ones, "never") == t.peak_activations, m
        assert _bubble(t, m) <= GREEDY_BUBBLE[p][m - 1], (m, _bubble(t, m), GREEDY_BUBBLE[p][m - 1])
        if m >= p:
            assert _bubble(t, m) == p - 1, m


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_unequal_costs_leave_the_bubble_as_m_grows(p: int) -> None:
    """From m = p on the bubble at unequal F, B, W does not grow with m (it drops by up to 1 where the
    paper's order takes over, at m = 2p - 1): an order tuned to equal costs only (the greedy one, and
    the list schedule zb-v ran for p <= m < 2p - 1 before) drifts, a few units more per micro-batch."""
    for f, b, w in ((1, 1.5, 0.5), (1, 0.5, 1.5), (2, 1, 1), (2, 2, 1)):
        bubbles = [_bubble(_sim("zb-v", p, m, f, b, w), m, f, b, w) for m in range(p, 4 * p + 1)]
        assert bubbles == sorted(bubbles, reverse=True), ((f, b, w), bubbles)
        assert bubbles[0] - bubbles[-1] <= 1, ((f, b, w), bubbles)


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_against_torchs_zbv_in_our_simulator(p: int) -> None:
    """torch's ZB-V order for the same p and m, its messages put in our channels' order: it holds 2p
    too; ours' bubble at F = B = W is p - 1, its 2p - 3 (p >= 2)."""
    for m in (2 * p, 3 * p):
        _validated(p, m)
        theirs, ours = _sim("torch", p, m), _sim("zb-v", p, m)
        assert max(theirs.peak_activations) == max(ours.peak_activations) == 2 * p
        assert _bubble(ours, m) == p - 1 and _bubble(theirs, m) == max(p - 1, 2 * p - 3), m


@pytest.mark.parametrize("p", _PS)
def test_the_greedy_reference_is_the_order_zb_v_ran_before(p: int) -> None:
    """``greedy_v_schedule``, what the test below compares with, has the greedy order's bubble as it was
    printed at commit 3498704, and its peak: 3p - 1 stage activations (its cap 2p + 1 at p = 1; 2m,
    1F1B's, below m = p)."""
    held = max(3 * p - 1, 2 * p + 1)
    for m in range(1, 4 * p + 4):
        t = _sim("greedy", p, m)
        assert _bubble(t, m) == GREEDY_BUBBLE[p][m - 1], m
        assert max(t.peak_activations) <= (held if m >= p else 2 * m), m
    assert max(_sim("greedy", p, 4 * p).peak_activations) == held


@pytest.mark.parametrize(
    "p", [*range(2, 9), *(pytest.param(p, marks=pytest.mark.slow) for p in range(9, 17))]
)
def test_bubble_no_longer_than_the_greedy_orders_at_unequal_costs(p: int) -> None:
    """Every m from 1 to 2p + 1 (the three orders ``_zb_v`` picks from and where it changes) and 4p, at
    F = B = W, F = 2B = 2W and F = B = 2W: the bubble is the greedy order's or less, computed here, and
    every rank holds at most 1F1B's peak. From m = p on it is the bound at F = B = W (p - 1) and at
    F = 2B = 2W (2(p - 1): rank p - 1 waits p - 1 forwards); the list schedule zb-v ran for
    p <= m < 2p - 1 before took up to 113 units at p = 16, m = 30 (the greedy order 48, ours now 30)."""
    for m in [*range(1, 2 * p + 2), 4 * p]:
        _validated(p, m)
        assert max(_sim("zb-v", p, m).peak_activations) <= 2 * min(p, m), m
        bubbles = {}
        for f, b, w in GREEDY_COSTS:
            bubbles[f, b, w] = _bubble(_sim("zb-v", p, m, f, b, w), m, f, b, w)
            assert bubbles[f, b, w] <= _bubble(_sim("greedy", p, m, f, b, w), m, f, b, w), (m, (f, b, w))
        if m >= p:
            assert (bubbles[1, 1, 1], bubbles[2, 1, 1]) == (p - 1, 2 * (p - 1)), m
