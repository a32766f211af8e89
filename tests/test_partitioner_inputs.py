"""``partitioner._inputs``: exact prefix sums and the error for every kind of bad input."""

from __future__ import annotations

import itertools
import math
import random
import re
from fractions import Fraction

import numpy as np
import pytest

from partitioner._inputs import (
    _check_memory,
    _check_speeds,
    _check_stages,
    _check_values,
    _is_rows,
    _prefix,
    _ranges,
)


def test_prefix_is_the_correctly_rounded_exact_sum() -> None:
    # Naive accumulation of ten 0.1s ends one ulp below 1.0; the exact sum of the ten floats rounds
    # to 1.0, and so must every prefix: each is the float nearest to its exact rational sum.
    tenths = [0.1] * 10
    assert list(itertools.accumulate(tenths))[-1] == 0.9999999999999999
    p = _prefix(tenths)
    assert p[-1] == 1.0
    assert p == [float(Fraction(0.1) * i) for i in range(11)]
    assert _prefix([0.1, 0.2]) == [0.0, 0.1, 0.30000000000000004]


def test_prefix_matches_fractions_and_is_monotone() -> None:
    rng = random.Random(3)
    values = [rng.choice([1e-300, 1e300, 0.0, 3.0]) * rng.random() for _ in range(200)]
    p = _prefix(values)
    exact = [float(f) for f in itertools.accumulate(map(Fraction, values), initial=Fraction(0))]
    assert p == exact
    assert all(a <= b for a, b in itertools.pairwise(p))
    assert _prefix([1e300, 1e-300, -1e300]) == [0.0, 1e300, 1e300, 1e-300]  # naive: ends at 0.0
    assert _prefix([]) == [0.0]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1.0, math.nan], "costs[1] is nan; every entry must be a finite number >= 0"),
        ([math.inf, 1.0], "costs[0] is inf; every entry must be a finite number >= 0"),
        ([1.0, -1.0], "costs[1] is -1.0; every entry must be a finite number >= 0"),
        ([1.0], "costs has 1 entries but there are 2 layers; pass one per layer"),
        ([1.0, 2.0, 3.0], "costs has 3 entries but there are 2 layers; pass one per layer"),
    ],
)
def test_check_values_errors(values: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _check_values("costs", values, 2)


def test_check_values_sum_overflow() -> None:
    message = "costs sum to more than the largest float; rescale them"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _check_values("costs", [1e308, 1e308], 2)


def test_check_values_names_the_argument_and_converts() -> None:
    with pytest.raises(ValueError, match=re.escape("cut_costs[0] is -0.5")):
        _check_values("cut_costs", [-0.5, 1.0], 2)
    out = _check_values("costs", [1, np.float32(0.5), 0.0], 3)
    assert out == [1.0, 0.5, 0.0] and all(type(v) is float for v in out)


@pytest.mark.parametrize("k", [0, 4, True, 2.0, "2"])
def test_check_stages_rejects(k: object) -> None:
    message = f"n_stages ({k!r}) must be an integer from 1 to the number of layers (3)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _check_stages(k, 3)  # type: ignore[arg-type]


def test_check_stages_accepts_and_empty() -> None:
    _check_stages(1, 3)
    _check_stages(np.int64(3), 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^costs is empty: there are no layers to split;"):
        _check_stages(1, 0)


@pytest.mark.parametrize(
    ("speeds", "message"),
    [
        ([1.0], "speeds has 1 entries but n_stages is 2; pass one speed per stage"),
        ([1.0, 0.0], "speeds[1] is 0.0; every speed must be a finite number > 0"),
        ([-2.0, 1.0], "speeds[0] is -2.0; every speed must be a finite number > 0"),
        ([1.0, math.inf], "speeds[1] is inf; every speed must be a finite number > 0"),
        ([math.nan, 1.0], "speeds[0] is nan; every speed must be a finite number > 0"),
    ],
)
def test_check_speeds_errors(speeds: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _check_speeds(speeds, 2)
    assert _check_speeds([2, 0.5], 2) == [2.0, 0.5]


@pytest.mark.parametrize(
    ("memory", "limit", "message"),
    [
        (None, 3.0, "memory_limit is given without memory; pass memory (per layer) as well"),
        ([[1.0, 1.0]] * 3, 3.0, "memory has 3 rows but n_stages is 2; pass one row per stage"),
        ([1.0, 1.0], [3.0], "memory_limit has 1 entries but n_stages is 2; pass one or 2"),
        ([1.0, 1.0], [3.0, -1.0], "memory_limit[1] is -1.0; limits must be numbers >= 0"),
        ([1.0, 1.0], math.nan, "memory_limit[0] is nan; limits must be numbers >= 0"),
        ([1.0, -1.0], 3.0, "memory[1] is -1.0; every entry must be a finite number >= 0"),
        ([1.0], 3.0, "memory has 1 entries but there are 2 layers; pass one per layer"),
    ],
)
def test_check_memory_errors(memory: list[float] | None, limit: float | list[float], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _check_memory(memory, limit, 2, 2)


def test_check_memory_results() -> None:
    assert _check_memory(None, None, 2, 2) == (None, [])
    assert _check_memory([1.0, 2.0], None, 2, 2) == (None, [])  # no limit: nothing to fit
    assert _check_memory([1.0, 2.0], 4, 2, 2) == ([[0.0, 1.0, 3.0]], [4.0, 4.0])
    rows, limits = _check_memory([[1.0, 2.0], [0.1, 0.2]], [3.0, math.inf], 2, 2)
    assert rows == [[0.0, 1.0, 3.0], [0.0, 0.1, 0.30000000000000004]] and limits == [3.0, math.inf]
    assert _is_rows([[1.0]]) and not _is_rows([1.0]) and not _is_rows([np.float64(1.0)])
    assert not _is_rows([])


def test_ranges() -> None:
    assert _ranges([2, 1, 3], 6) == [(0, 2), (2, 3), (3, 6)]
    for bad in ([2, 2], [3, 0, 3], [True, 5], [1.5, 4.5], [7, -1]):
        message = f"balance {bad} must be positive integers summing to the 6 layers"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            _ranges(bad, 6)  # type: ignore[arg-type]
