"""Exact orders of the built-in schedules and the makespan / memory properties they must have.

# p: ranks, v: stages per rank, m: micro-batches, r: rank (letters: pipeline/__init__.py)
"""

from __future__ import annotations

import itertools

import pytest

from pipeline.schedules.actions import Kind
from pipeline.schedules.schedule import schedule, unchecked
from pipeline.schedules.simulate import simulate

PM = [(p, m) for p in range(1, 7) for m in range(1, 13)]
COSTS = [(1, 1), (1, 2), (2, 1), (3, 5)]  # (F, B)


def _rank_text(name: str, p: int, m: int, r: int, v: int = 1) -> str:
    return " ".join(str(a) for a in schedule(name, p, m, n_virtual=v).compute[r])


def test_exact_orders() -> None:
    assert _rank_text("gpipe", 2, 3, 1) == "1F0 1F1 1F2 1B0 1B1 1B2"
    assert _rank_text("1f1b", 4, 8, 0) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    assert _rank_text("1f1b", 4, 8, 2) == "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7"
    assert _rank_text("1f1b", 4, 2, 0) == "0F0 0F1 0B0 0B1"  # m < p: warm-up capped at m
    # ZB-H1: rank r delays its first r W's; rank 0 runs W right after B.
    assert (
        _rank_text("zb-h1", 4, 6, 0)
        == "0F0 0F1 0F2 0F3 0B0 0W0 0F4 0B1 0W1 0F5 0B2 0W2 0B3 0W3 0B4 0W4 0B5 0W5"
    )
    assert (
        _rank_text("zb-h1", 4, 6, 3)
        == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 3B4 3W1 3F5 3B5 3W2 3W3 3W4 3W5"
    )
    # Megatron's interleaved order, p = 2, v = 2, m = 4: groups of p micro-batches per stage;
    # rank 0 warms up with 2(p - r - 1) + (v - 1)p = 4 forwards.
    assert _rank_text("interleaved-1f1b", 2, 4, 0, v=2) == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    )
    assert _rank_text("interleaved-1f1b", 2, 4, 1, v=2) == (
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )


@pytest.mark.parametrize(("p", "m"), PM)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_1f1b_makespan_and_memory(name: str, p: int, m: int) -> None:
    sched = schedule(name, p, m)
    for f, b in COSTS:
        timeline = simulate(sched, f, b)
        assert timeline.makespan == (m + p - 1) * (f + b)
        expected = [m] * p if name == "gpipe" else [min(m, p - r) for r in range(p)]
        assert timeline.peak_activations == expected


@pytest.mark.parametrize(("p", "m"), PM)
def test_non_split_weight_folds_into_backward(p: int, m: int) -> None:
    # B of a non-split schedule costs backward + weight.
    assert simulate(schedule("1f1b", p, m), 1, 2, weight=3).makespan == (m + p - 1) * 6


@pytest.mark.parametrize(("p", "v", "groups"), list(itertools.product(range(1, 6), range(2, 5), range(1, 4))))
def test_interleaved_makespan(p: int, v: int, groups: int) -> None:
    m = groups * p
    sched = schedule("interleaved-1f1b", p, m, n_virtual=v)
    assert sched.n_ranks == p and sched.n_virtual == v and sched.n_stages == p * v
    for f, b in COSTS:
        assert simulate(sched, f, b).makespan == (m * v + p - 1) * (f + b)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in PM if m >= p])
def test_zb_h1_makespan_and_memory(p: int, m: int) -> None:
    f = b = w = 1.0
    zb = simulate(schedule("zb-h1", p, m), f, b, w)
    assert zb.makespan == m * (f + b + w) + (p - 1) * (f + b - w)
    assert simulate(schedule("1f1b", p, m), f, b, w).makespan == (m + p - 1) * (f + b + w)
    assert max(zb.peak_activations) <= p
    assert zb.peak_activations == [min(m, p)] * p  # rank r: p - r in flight for 1F1B, plus r pending W's


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in PM if m < p])
def test_zb_h1_few_microbatches(p: int, m: int) -> None:
    zb = simulate(schedule("zb-h1", p, m), 1, 1, 1)
    assert max(zb.peak_activations) <= m
    assert zb.makespan < (m + p - 1) * 3  # still beats 1F1B
    if m == 1:
        assert zb.makespan == 2 * p + 1  # the critical path: p forwards, p backwards, one W


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_every_rank_runs_only_its_stage(name: str) -> None:
    sched = schedule(name, 5, 7)
    for r, actions in enumerate(sched.compute):
        assert {a.stage for a in actions} == {r}
        assert [a.microbatch for a in actions if a.kind is Kind.F] == list(range(7))


@pytest.mark.parametrize(("p", "v", "groups"), list(itertools.product(range(2, 6), (2, 3), (1, 2, 3))))
def test_interleaved_zb_makespan_and_memory(p: int, v: int, groups: int) -> None:
    """Interleaved 1F1B with zb-h1's split: with F = B = W the bubble shrinks from 3 (p - 1) to p - 1
    (m >= 2p); rank r holds at most r micro-batches more than interleaved 1F1B (its pending W's)."""
    m = groups * p
    zb = simulate(schedule("interleaved-zb", p, m, n_virtual=v), 1, 1, 1)
    interleaved = simulate(schedule("interleaved-1f1b", p, m, n_virtual=v), 1, 2)
    assert interleaved.makespan == (m * v + p - 1) * 3
    assert zb.makespan < interleaved.makespan
    if groups >= 2:
        assert zb.makespan == 3 * m * v + p - 1
    extra = [z - i for z, i in zip(zb.peak_activations, interleaved.peak_activations, strict=True)]
    assert all(0 <= e <= r for r, e in enumerate(extra)), extra


@pytest.mark.parametrize("p", range(1, 7))
def test_zb_v_beats_interleaved_1f1b_and_zb_h1(p: int) -> None:
    """zb-v at F = B = W = 1, every m from 1 to 3p (validated, and its memory and bubble bounded, in
    test_zb_v.py): at equal work (zb-h1's one stage per rank is two of zb-v's, so it costs 2 per
    action) its step is shorter than zb-h1's and interleaved-1f1b's."""
    for m in range(1, 3 * p + 1):
        zbv = simulate(unchecked("zb-v", p, m, 2), 1, 1, 1)
        zbh1 = simulate(schedule("zb-h1", p, m), 2, 2, 2)
        assert zbv.makespan <= zbh1.makespan and (p == 1 or zbv.makespan < zbh1.makespan)
        if m % p == 0:
            inter = simulate(schedule("interleaved-1f1b", p, m, n_virtual=2), 1, 2)
            assert zbv.makespan <= inter.makespan and (p == 1 or zbv.makespan < inter.makespan)


def test_zb_v_numbers() -> None:
    """p = 4, m = 8 at F = B = W = 1: 51 units (ideal 48); interleaved-1f1b 57, zb-h1 54."""
    assert simulate(schedule("zb-v", 4, 8), 1, 1, 1).makespan == 51
    assert simulate(schedule("interleaved-1f1b", 4, 8, n_virtual=2), 1, 2).makespan == 57
    assert simulate(schedule("zb-h1", 4, 8), 2, 2, 2).makespan == 54


def test_zb_v_takes_two_stages_per_rank() -> None:
    from pipeline.schedules.generators import zb_v

    with pytest.raises(ValueError, match="zb-v places exactly 2 stages per rank, got n_virtual=3"):
        zb_v(2, 3, 2)
    with pytest.raises(ValueError, match=r"n_virtual \(3\) must be at most 2 for 'zb-v'"):
        schedule("zb-v", 2, 2, n_virtual=3)
