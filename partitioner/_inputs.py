"""Input validation and exact prefix sums for ``partitioner.solve``.

    # n: layers, k: stages, l: layer, s: stage

Owns every check on what the user passes to ``solve``, ``stage_costs`` and ``stage_memory`` (layer
and stage counts, costs, cut costs, speeds, memory and its limits, balances), each raising a
``ValueError`` that names the value, what was expected and the fix, and ``_prefix``, the prefix sums
that every stage cost and stage memory is a difference of.

Why the prefix sums are exact integer sums rounded once: a float is a dyadic rational, so
``_prefix`` adds the values exactly as integers over one power-of-two denominator and rounds each
sum to a float once. P[l] is then the correctly rounded true sum of the first l values: P is
non-decreasing (rounding is monotone), stage costs P[b] - P[a] grow with b and shrink with a, and
the searches bisect on them and compare floats with no epsilon. Naive float accumulation rounds
after every addition, so its sums drift from the true ones (for [0.1] * 10 it ends at
0.9999999999999999, not 1.0) and depend on the order of the layers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "_check_cuts",
    "_check_memory",
    "_check_speeds",
    "_check_stages",
    "_check_values",
    "_is_rows",
    "_prefix",
    "_prefix_rows",
    "_ranges",
]


def _prefix(values: list[float]) -> list[float]:
    # Exact sums in integers (floats are dyadic), each rounded once: correctly rounded and monotone.
    whole = np.asarray(values, dtype=np.float64)
    if len(whole) and np.all(np.floor(whole) == whole) and math.fsum(values) < 2.0**53:
        # integers (bytes) whose sums stay below 2**53: every float sum is exact already
        return [0.0, *np.cumsum(whole).tolist()]
    ratios = [v.as_integer_ratio() for v in values]
    den = max((d for _, d in ratios), default=1)
    acc, out = 0, [0.0]
    for num, d in ratios:
        acc += num * (den // d)
        out.append(acc / den)
    return out


def _prefix_rows(rows: list[list[float]], k: int) -> list[np.ndarray]:
    """``_check_memory``'s prefix sums of k memory rows the partitioner computed, as arrays, checked
    and summed all at once (a cold plan's 64 rows of 1000 layers: numpy, not 64 Python passes):
    integer rows whose sums stay below 2**53 by one cumsum, as ``_prefix`` sums them; any other
    row by ``_prefix``; anything amiss (a negative, non-finite or ragged row) named by
    ``_check_memory``."""
    n = len(rows[0]) if rows else 0
    table = np.asarray(rows, np.float64) if all(len(row) == n for row in rows) else None
    with np.errstate(over="ignore"):  # a sum past the largest float: named below
        sane = (
            table is not None
            and table.shape == (k, n)
            and bool(np.isfinite(table).all() and (table >= 0).all() and np.isfinite(table.sum(axis=1)).all())
        )
    if not sane or table is None:
        sums, _ = _check_memory(rows, 0.0, n, k)
        assert sums is not None
        return [np.asarray(row, np.float64) for row in sums]
    # pairwise sums of integers are exact below 2**53 and never fall back below it: fsum's answer
    if np.all(np.floor(table) == table) and (table.sum(axis=1) < 2.0**53).all():
        return list(np.concatenate([np.zeros((k, 1)), np.cumsum(table, axis=1)], axis=1))
    return [np.asarray(_prefix(row), np.float64) for row in rows]


def _check_stages(n_stages: int, n: int) -> None:
    if n == 0:
        raise ValueError("costs is empty: there are no layers to split; pass one cost per layer")
    if isinstance(n_stages, bool) or not isinstance(n_stages, (int, np.integer)) or not 1 <= n_stages <= n:
        raise ValueError(f"n_stages ({n_stages!r}) must be an integer from 1 to the number of layers ({n})")


def _check_values(name: str, values: Sequence[float], n: int) -> list[float]:
    arr = np.asarray([float(v) for v in values] if not isinstance(values, np.ndarray) else values, np.float64)
    if arr.ndim != 1 or len(arr) != n:
        raise ValueError(f"{name} has {len(arr)} entries but there are {n} layers; pass one per layer")
    bad = np.flatnonzero(~(np.isfinite(arr) & (arr >= 0)))
    if len(bad):
        layer = int(bad[0])
        value = float(arr[layer])
        raise ValueError(f"{name}[{layer}] is {value!r}; every entry must be a finite number >= 0")
    out: list[float] = arr.tolist()
    try:
        total = math.fsum(out)
    except OverflowError:  # fsum raises instead of returning inf
        total = math.inf
    if not math.isfinite(total):
        raise ValueError(f"{name} sum to more than the largest float; rescale them")
    return out


def _check_cuts(
    cut_costs: Sequence[float] | Sequence[Sequence[float]] | None, n: int, k: int
) -> list[list[float]] | None:
    """Cut-cost rows (one, or one per boundary: k - 1); None when no cut would cost anything."""
    if cut_costs is None:
        return None
    if _is_rows(cut_costs):
        rows = [_check_values("cut_costs", r, n) for r in cut_costs]  # type: ignore[arg-type]
        if len(rows) != max(1, k - 1):
            raise ValueError(
                f"cut_costs has {len(rows)} rows but {k} stages have {k - 1} boundaries; "
                "pass one row per boundary, or one row (per layer) for all"
            )
    else:
        rows = [_check_values("cut_costs", cut_costs, n)]  # type: ignore[arg-type]
    if not any(any(row[: n - 1]) for row in rows):
        return None  # the last layer's cut is never paid; all-zero cuts change nothing
    return rows


def _check_speeds(speeds: Sequence[float], k: int) -> list[float]:
    out = [float(v) for v in speeds]
    if len(out) != k:
        raise ValueError(f"speeds has {len(out)} entries but n_stages is {k}; pass one speed per stage")
    for s, value in enumerate(out):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"speeds[{s}] is {value!r}; every speed must be a finite number > 0")
    return out


def _is_rows(memory: Sequence[float] | Sequence[Sequence[float]]) -> bool:
    return len(memory) > 0 and not isinstance(memory[0], (int, float, np.number))


def _check_memory(
    memory: Sequence[float] | Sequence[Sequence[float]] | None,
    memory_limit: float | Sequence[float] | None,
    n: int,
    k: int,
) -> tuple[list[list[float]] | None, list[float]]:
    if memory is None:
        if memory_limit is not None:
            raise ValueError("memory_limit is given without memory; pass memory (per layer) as well")
        return None, []
    if memory_limit is None:
        return None, []  # nothing to fit
    if _is_rows(memory):
        table = [list(r) for r in memory]  # type: ignore[arg-type]
        if len(table) != k:
            raise ValueError(f"memory has {len(table)} rows but n_stages is {k}; pass one row per stage")
    else:
        table = [list(memory)]  # type: ignore[arg-type]
    rows = [_prefix(_check_values("memory", r, n)) for r in table]
    if isinstance(memory_limit, (int, float, np.number)):
        limits = [float(memory_limit)] * k
    else:
        limits = [float(v) for v in memory_limit]
        if len(limits) != k:
            raise ValueError(f"memory_limit has {len(limits)} entries but n_stages is {k}; pass one or {k}")
    for s, value in enumerate(limits):
        if math.isnan(value) or value < 0:
            raise ValueError(f"memory_limit[{s}] is {value!r}; limits must be numbers >= 0")
    return rows, limits


def _ranges(balance: Sequence[int], n: int) -> list[tuple[int, int]]:
    if any(isinstance(b, bool) or int(b) != b or b < 1 for b in balance) or sum(balance) != n:
        raise ValueError(f"balance {list(balance)} must be positive integers summing to the {n} layers")
    ends = np.cumsum([0, *balance]).tolist()
    return list(itertools.pairwise(ends))
