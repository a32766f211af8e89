"""``partitioner.memory``: the schedule walk against closed forms and the simulator; recomputation.

# p: ranks, v: stages per rank, m: micro-batches, s: stage, r: rank, c: chunk (s = c * p + r)

The closed forms below are oracles, not library code: the walk over the built schedule is what
``partition`` uses, and these tests check it against them and against the simulator's timed count.
"""

from __future__ import annotations

import pytest

from partitioner.memory import held, in_flight, layer_memory
from pipeline.schedules.schedule import schedule
from pipeline.schedules.simulate import simulate

PM = [(p, m) for p in range(1, 6) for m in range(1, 10)]
COSTS = [(1.0, 1.0, 0.0), (1.0, 2.0, 1.0), (3.0, 1.0, 2.0)]  # (F, B, W)


def _closed_form(name: str, p: int, m: int, v: int = 1) -> list[int]:
    """Peak micro-batches held per stage.

        gpipe              m
        1f1b               min(m, p - s)
        zb-h1              min(m, p)        (m >= p: rank r adds r pending W's to 1F1B's p - r)
        interleaved-1f1b   min(m, (v - 1 - c) * p + min(p, 2 * (p - r - 1) + 1))   an upper bound

    The interleaved form follows Megatron's warm-up: rank r runs 2 (p - r - 1) + (v - 1) p
    forwards, chunk by chunk in groups of p micro-batches, before its first backward (of its
    last chunk); each earlier chunk c has (v - 1 - c) more groups in flight.
    """
    if name == "gpipe":
        return [m] * p
    if name == "1f1b":
        return [min(m, p - s) for s in range(p)]
    if name == "zb-h1":
        return [min(m, p)] * p
    return [min(m, (v - 1 - s // p) * p + min(p, 2 * (p - s % p - 1) + 1)) for s in range(p * v)]


@pytest.mark.parametrize(("p", "m"), PM)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_walk_matches_closed_forms(name: str, p: int, m: int) -> None:
    assert in_flight(schedule(name, p, m)) == _closed_form(name, p, m)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in PM if m >= p])
def test_zb_h1_holds_activations_until_w(p: int, m: int) -> None:
    counts = in_flight(schedule("zb-h1", p, m))
    assert counts == _closed_form("zb-h1", p, m)
    if p > 1:
        assert counts != _closed_form("1f1b", p, m)  # counting to B instead of W would be too low


@pytest.mark.parametrize(("p", "m"), PM)
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_walk_matches_the_simulator(name: str, p: int, m: int) -> None:
    # one stage per rank: the simulator's timed per-rank peak is the walk's per-stage one
    sched = schedule(name, p, m)
    for f, b, w in COSTS:
        assert simulate(sched, f, b, w).peak_activations == in_flight(sched)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (2, 3, 4), (3, 2, 6), (4, 3, 8), (1, 2, 3)])
def test_interleaved_walk_within_the_closed_bound(p: int, v: int, m: int) -> None:
    sched = schedule("interleaved-1f1b", p, m, n_virtual=v)
    exact = in_flight(sched)
    bound = _closed_form("interleaved-1f1b", p, m, v)
    assert len(exact) == p * v
    assert all(e <= b for e, b in zip(exact, bound, strict=True))
    assert exact[0] == bound[0]  # stage 0 (rank 0, chunk 0) reaches the bound
    for f, b, w in COSTS:  # a rank never holds more than its stages' peaks together
        per_rank = simulate(sched, f, b, w).peak_activations
        assert all(per_rank[r] <= sum(exact[r::p]) for r in range(p))


@pytest.mark.parametrize(
    ("mode", "m", "counts", "sets", "inputs"),
    [
        ("never", 4, [3, 2, 1], [3, 2, 1], [0, 0, 0]),
        ("always", 4, [3, 2, 1], [1, 1, 1], [3, 2, 1]),
        ("except_last", 4, [3, 2, 1], [2, 2, 1], [3, 2, 1]),
        ("except_last", 1, [1, 1], [1, 1], [0, 0]),  # m = 1: the only micro-batch is the last
    ],
)
def test_held_under_recomputation(
    mode: str, m: int, counts: list[int], sets: list[int], inputs: list[int]
) -> None:
    assert held(mode, m, counts) == (sets, inputs)


def test_layer_memory_rows() -> None:
    rows = layer_memory([10, 0], [3, 5], [2, 1], optimizer_state_factor=2.0)
    assert rows == [[40.0 + 6.0, 10.0], [40.0 + 3.0, 5.0]]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="optimizer_state_factor"):
        layer_memory([1], [1], [1], optimizer_state_factor=-1.0)
    with pytest.raises(ValueError, match="'sometimes'"):
        held("sometimes", 2, [1])
