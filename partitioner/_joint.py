"""The exact balance when each stage may also choose among options (its recomputation mode).

    # n: layers, k: stages, s: stage, o: option (a recomputation mode), [a, b): one stage's layers

Each option o has its own per-layer costs (prefix sums P_o) and, per stage, its own memory row
(prefix sums M_o,s) and limit L_o,s (a recomputing stage also keeps its inputs, so its limit for
the layers is lower). Stage s may use the options ``allowed[s]``. A stage's cost is that of its
cheapest option that fits::

    cost_s(a, b) = min over o in allowed[s] with M_o,s[b] - M_o,s[a] <= L_o,s of
                   (P_o[b] - P_o[a]) / speed_s  +  cuts (as in ``partitioner.solve``)

so one min-max DP over (stage, start) finds the smallest bottleneck over every balance AND every
choice of options per stage (3^k choices for three modes, never enumerated). The options of a
fixed balance are independent stage by stage, so the cheapest fitting one per stage is also what
the simulator prefers (it is monotone in every action's cost). One option allowed per stage is a
fixed per-stage recomputation; one option for all stages is ``solve`` itself.

The DP is ``partitioner._dp``'s core with this stage cost; ``fits`` and ``smallest`` are
``partitioner._fit``'s with a stage's reach the farthest of its options' reaches (each option's
fitting ends are a prefix, so their union is the longest one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from partitioner._dp import _band, _dp_core, _row, _upper_bound, _width
from partitioner._fit import _STEPS, _even_split, _most_layers, _reach, min_max_core

__all__ = ["fits_joint", "smallest_joint", "solve_joint"]

_INF = math.inf


def solve_joint(
    prefix: Sequence[list[float]],
    k: int,
    allowed: Sequence[Sequence[int]],
    *,
    cut: list[list[float]] | None = None,
    speed: list[float] | None = None,
    memory: Sequence[list[list[float]]] | None = None,
    limits: Sequence[list[float]] | None = None,
) -> tuple[list[int], list[int]] | None:
    """(stage ends, option per stage) of the smallest bottleneck, None if nothing fits.

    ``prefix[o]``: option o's cost prefix sums (n + 1); ``memory[o]``: its prefix rows, one or one
    per stage; ``limits[o][s]``: its limit on stage s. Ties: the latest boundaries (as ``solve``),
    and per stage the first allowed option of the least cost.
    """
    n = len(prefix[0]) - 1
    pre = [np.asarray(p) for p in prefix]
    smax = 1.0 if speed is None else max(speed)
    ub = _INF
    for o in range(len(prefix)):  # a real balance: one option on every stage, if one is allowed there
        if all(o in allowed[s] for s in range(k)):
            rows = None if memory is None else memory[o]
            ub = min(ub, _upper_bound(prefix[o], k, cut, speed, rows, [] if limits is None else limits[o]))
    w = max(_width(p, ub, smax) for p in pre) if math.isfinite(ub) else n
    starts = max(0, min(n - 2, (k - 2) * w) + 1)
    spans = [_band(p, w, starts) for p in pre]
    at_start = None if cut is None else [np.asarray([0.0, *row]) for row in cut]
    at_end = None if at_start is None else [_band(row, w, starts, diff=False) for row in at_start]
    mem_rows = None if memory is None else [[np.asarray(r) for r in rows] for rows in memory]
    bands: dict[tuple[int, int], np.ndarray] = {}

    def fitting(o: int, s: int, lo: int, hi: int, c: np.ndarray, last: bool) -> np.ndarray:
        if mem_rows is None or limits is None:
            return c
        row = mem_rows[o][_row(mem_rows[o], s)]
        if last:
            return np.where(row[n] - row[lo:hi] <= limits[o][s], c, _INF)
        key = (o, _row(mem_rows[o], s))
        if key not in bands:
            bands[key] = _band(row, w, starts)
        return np.where(bands[key][lo:hi] <= limits[o][s], c, _INF)

    def stage(s: int, lo: int, hi: int) -> np.ndarray:
        best = np.full((hi - lo, w), _INF)
        for o in allowed[s]:
            c = spans[o][lo:hi] if speed is None else spans[o][lo:hi] / speed[s]
            best = np.minimum(best, fitting(o, s, lo, hi, c, False))
        if at_end is not None and at_start is not None:
            best = best + at_end[_row(at_end, s)][lo:hi]
            if s > 0:
                best = best + at_start[_row(at_start, s - 1)][lo:hi, None]
        return best

    def last(lo: int, hi: int) -> np.ndarray:
        best = np.full(hi - lo, _INF)
        for o in allowed[k - 1]:
            c = pre[o][n] - pre[o][lo:hi]
            c = c if speed is None else c / speed[k - 1]
            best = np.minimum(best, fitting(o, k - 1, lo, hi, c, True))
        if at_start is not None and k > 1:
            best = best + at_start[_row(at_start, k - 2)][lo:hi]
        return best

    opt, g = _dp_core(n, k, w, stage, last)
    if opt == _INF:
        return None
    ends, a = [], 0
    for s in range(k - 1):
        ok = (stage(s, a, a + 1)[0] <= opt) & (g[s + 1][a + 1 : a + 1 + w] <= opt)
        a += 1 + int(np.flatnonzero(ok)[-1])
        ends.append(a)
    ends.append(n)
    chosen = []
    for s, (a, b) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        costs = []
        for o in allowed[s]:
            fits_here = (
                mem_rows is None
                or limits is None
                or (
                    mem_rows[o][_row(mem_rows[o], s)][b] - mem_rows[o][_row(mem_rows[o], s)][a]
                    <= limits[o][s]
                )
            )
            costs.append((pre[o][b] - pre[o][a]) if fits_here else _INF)
        chosen.append(allowed[s][int(np.argmin(costs))])
    return ends, chosen


def fits_joint(
    memory: Sequence[list[list[float]]],
    limits: Sequence[list[float]],
    allowed: Sequence[Sequence[int]],
    k: int,
) -> bool:
    """Whether some balance, each stage on one of its allowed options, fits every stage's limit."""
    n = len(memory[0][0]) - 1
    converted: dict[int, np.ndarray] = {}  # a row shared by many stages is converted once
    for rows in memory:
        for r in rows:
            if id(r) not in converted:
                converted[id(r)] = np.asarray(r, dtype=np.float64)
    arrays = [[converted[id(r)] for r in rows] for rows in memory]
    at = np.arange(n + 1)
    ends = at == 0
    reaches: dict[tuple[int, float], np.ndarray] = {}  # stages of one row and one limit reach alike

    def reach_of(row: np.ndarray, limit: float) -> np.ndarray:
        key = (id(row), limit)
        if key not in reaches:
            reaches[key] = _reach(row, limit)
        return reaches[key]

    for s in range(k):
        reach = np.max([reach_of(arrays[o][_row(arrays[o], s)], limits[o][s]) for o in allowed[s]], axis=0)
        starts = at[ends & (reach > at)]
        cover = np.bincount(starts + 1, minlength=n + 2) - np.bincount(reach[starts] + 1, minlength=n + 2)
        ends = np.cumsum(cover)[: n + 1] > 0
    return bool(ends[n])


def smallest_joint(
    memory: Sequence[list[list[float]]],
    allowed: Sequence[Sequence[int]],
    k: int,
    limits_at: Callable[[float], list[list[float]]],
    high: float,
) -> float:
    """The least x in [0, high] with ``fits_joint(memory, limits_at(x), ...)`` (inf if not even
    ``high`` fits); ``limits_at`` is linear in x and grows with it. The min-max DP of each stage's
    cheapest option, (M_o,s[a, b] - limits_at(0)[o][s]) / slope_o,s, gives x; float steps then move
    it onto the exact boundary of ``fits_joint`` (bisection if they do not reach it)."""
    if not fits_joint(memory, limits_at(high), allowed, k):
        return _INF
    if fits_joint(memory, limits_at(0.0), allowed, k):
        return 0.0
    x = min(_min_max_joint(memory, allowed, k, limits_at), high)

    def fit(y: float) -> bool:
        return fits_joint(memory, limits_at(y), allowed, k)

    for _ in range(_STEPS):  # up until it fits ...
        if fit(x):
            break
        x = math.nextafter(x, _INF)
    else:
        return _bisect(fit, 0.0, high)
    for _ in range(_STEPS):  # ... and down while it still does
        below = math.nextafter(x, 0.0)
        if not fit(below):
            return x
        x = below
    return _bisect(fit, 0.0, x)


def _min_max_joint(
    memory: Sequence[list[list[float]]],
    allowed: Sequence[Sequence[int]],
    k: int,
    limits_at: Callable[[float], list[list[float]]],
) -> float:
    """min over balances of max_s min over o in allowed[s] of the x at which stage s fits on o."""
    rows = [[np.asarray(r, dtype=np.float64) for r in option] for option in memory]
    n = len(rows[0][0]) - 1
    zero = limits_at(0.0)
    slope = _slopes(limits_at, zero, k)

    def cost(s: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        best = np.full(np.broadcast(a, b).shape, _INF)
        for o in allowed[s]:
            m = rows[o][_row(rows[o], s)]
            need = m[b] - m[a] - zero[o][s]
            best = np.minimum(best, need / slope[o][s] if slope[o][s] > 0 else np.where(need > 0, _INF, 0.0))
        return best

    ends = _even_split([r for option in rows for r in option], k)
    starts = [0, *ends[:-1]]
    ub = max(float(cost(s, np.asarray([starts[s]]), np.asarray([ends[s]]))[0]) for s in range(k))
    if math.isinf(ub):
        return _INF
    widths = [
        max(
            n if slope[o][s] <= 0 else _most_layers(rows[o][_row(rows[o], s)], ub * slope[o][s] + zero[o][s])
            for o in allowed[s]
        )
        for s in range(k)
    ]
    return min_max_core(n, k, cost, widths, ub)


def _slopes(
    limits_at: Callable[[float], list[list[float]]], zero: list[list[float]], k: int
) -> list[list[float]]:
    """Per option and stage, d limits_at(x) / dx, read where x * slope outweighs the offset: the
    difference limits_at(1) - limits_at(0) keeps only the digits of a slope below the offset's
    (1 / v beside ~1e7 bytes of buffers: ~1e-8 off), so the DP's x missed the boundary by more than
    the float steps reach and every stage-mixing group fell back to bisection (~120 fits, not 4)."""
    one = limits_at(1.0)
    rough = [abs(a - b) for row_one, row_zero in zip(one, zero, strict=True)
             for a, b in zip(row_one, row_zero, strict=True) if a != b]  # fmt: skip
    if not rough:
        return [[0.0] * k for _ in zero]
    most = max(abs(z) for row in zero for z in row)
    probe = 2.0 ** math.ceil(math.log2(max(most / min(rough), 1.0)) + 2)  # x * slope >= 4 x offset
    far = limits_at(probe)
    return [[(far[o][s] - zero[o][s]) / probe for s in range(k)] for o in range(len(zero))]


def _bisect(fit: Callable[[float], bool], lo: float, hi: float) -> float:
    """The least float in (lo, hi] that fits, ``hi`` fitting and ``lo`` not, down to adjacent floats."""
    while True:
        mid = lo + (hi - lo) / 2
        if mid <= lo or mid >= hi:
            return hi
        if fit(mid):
            hi = mid
        else:
            lo = mid
