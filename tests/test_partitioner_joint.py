"""The joint fit (each stage on one of its options): its smallest limit against brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from partitioner import _joint

Problem = tuple[list[list[list[float]]], list[list[int]], int, list[float], list[list[float]]]


def _problem(seed: int) -> Problem:
    """(memory prefix rows per option, allowed options per stage, k, per-stage slope, offsets)."""
    rng = random.Random(seed)
    n, n_opt = rng.randint(2, 9), rng.randint(1, 3)
    k = rng.randint(1, min(n, 4))
    memory = []
    for _ in range(n_opt):
        rows = []
        for _ in range(k if rng.random() < 0.5 else 1):  # one row, or one per stage
            prefix = [0.0]
            for _ in range(n):
                prefix.append(prefix[-1] + rng.choice([0.0, float(rng.randint(1, 5)), rng.random() * 10]))
            rows.append(prefix)
        memory.append(rows)
    allowed = [sorted(rng.sample(range(n_opt), rng.randint(1, n_opt))) for _ in range(k)]
    slope = [rng.choice([1.0, 0.5, 2.0, 0.7]) for _ in range(k)]
    offset = [[rng.random() * 3 for _ in range(k)] for _ in range(n_opt)]
    return memory, allowed, k, slope, offset


def _brute(memory: list[list[list[float]]], allowed: list[list[int]], k: int, slope: list[float],
           offset: list[list[float]]) -> float:  # fmt: skip
    """min over balances of max over stages of min over its options of the x at which it fits."""
    n = len(memory[0][0]) - 1
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        ends = [0, *cuts, n]
        worst = 0.0
        for s in range(k):
            a, b = ends[s], ends[s + 1]
            need = min(
                (memory[o][s if len(memory[o]) > 1 else 0][b] - memory[o][s if len(memory[o]) > 1 else 0][a]
                 + offset[o][s]) / slope[s]
                for o in allowed[s]
            )  # fmt: skip
            worst = max(worst, need)
        best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_the_smallest_joint_limit_is_the_brute_force_min_max(seed: int) -> None:
    memory, allowed, k, slope, offset = _problem(seed)

    def limits_at(x: float) -> list[list[float]]:
        return [[x * slope[s] - offset[o][s] for s in range(k)] for o in range(len(memory))]

    brute = _brute(memory, allowed, k, slope, offset)
    # the DP alone (what makes it fast), then the exact float boundary of fits_joint
    assert _joint._min_max_joint(memory, allowed, k, limits_at) == pytest.approx(brute, rel=1e-12, abs=1e-12)
    least = _joint.smallest_joint(memory, allowed, k, limits_at, 1e6)
    assert least == pytest.approx(brute, rel=1e-12, abs=1e-12)
    assert _joint.fits_joint(memory, limits_at(least), allowed, k)
    if least > 0:
        assert not _joint.fits_joint(memory, limits_at(math.nextafter(least, 0.0)), allowed, k)


@pytest.mark.parametrize("off_by", [0.5, 2.0, 1e-300])
def test_the_smallest_joint_limit_is_exact_whatever_the_dp_guessed(
    monkeypatch: pytest.MonkeyPatch, off_by: float
) -> None:
    # the DP's x only saves time: a guess far below or above the boundary still ends on it exactly
    memory, allowed, k, slope, offset = _problem(3)

    def limits_at(x: float) -> list[list[float]]:
        return [[x * slope[s] - offset[o][s] for s in range(k)] for o in range(len(memory))]

    exact = _joint.smallest_joint(memory, allowed, k, limits_at, 1e6)
    monkeypatch.setattr(_joint, "_min_max_joint", lambda *args: exact * off_by)
    assert _joint.smallest_joint(memory, allowed, k, limits_at, 1e6) == exact


@pytest.mark.parametrize("v", [3, 7, 15])
def test_the_dp_lands_on_the_boundary_when_offsets_dwarf_the_slope(
    monkeypatch: pytest.MonkeyPatch, v: int
) -> None:
    # Each stage's limit is x / v less ~1e7 bytes of buffers (a rank's share over v stages, as the
    # auto search's groups have it): a slope read as limits_at(1) - limits_at(0) keeps ~8 digits,
    # the DP's x then lands ~1e-8 off and the float steps fell back to bisection (~120 fits a call).
    rng = random.Random(v)
    k, n = 4, 40
    prefix = [0.0]
    for _ in range(n):
        prefix.append(prefix[-1] + float(rng.randint(1 << 20, 1 << 24)))
    memory = [[prefix], [[x * 0.6 for x in prefix]]]
    offset = [[1.2e7 + 1e5 * s for s in range(k)], [3.1e7 + 1e5 * s for s in range(k)]]

    def limits_at(x: float) -> list[list[float]]:
        return [[x / v - offset[o][s] for s in range(k)] for o in range(2)]

    calls = [0]
    fits = _joint.fits_joint

    def counted(*args: object) -> bool:
        calls[0] += 1
        return fits(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_joint, "fits_joint", counted)
    allowed = [[0, 1]] * k
    least = _joint.smallest_joint(memory, allowed, k, limits_at, 1e13)
    assert calls[0] <= 6, calls[0]  # high, 0, then the DP's x and the float below it: no bisection
    assert fits(memory, limits_at(least), allowed, k)
    assert not fits(memory, limits_at(math.nextafter(least, 0.0)), allowed, k)
