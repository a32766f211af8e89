"""The banded backward DP of ``partitioner.solve`` (cut costs, per-stage speeds or memory).

    # n: layers, k: stages, l: layer, s: stage, w: band width, g[s][a]: best bottleneck of s..k-1 from a

The algorithm, its band and its tie rule are explained in ``partitioner.solve``'s docstring. This
module owns the DP (``_dp``, its core ``_dp_core``) and the greedy upper bound that sizes the band
(``_upper_bound``, ``_width``, ``_band``). Inputs arrive validated (``partitioner._inputs``); memory
that no balance fits is found before, by ``partitioner._fit``.

``cut`` holds cut-cost rows: one for every boundary, or k - 1 (row s: the boundary between stages
s and s + 1). The cut after layer l costs its row's entry l to both stages it separates.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["_band", "_dp", "_dp_core", "_row", "_upper_bound", "_width"]

_INF = math.inf


def _dp(
    prefix: list[float],
    k: int,
    cut: list[list[float]] | None,
    speed: list[float] | None,
    rows: list[list[float]] | None,
    limits: list[float],
    ub: float | None = None,
) -> list[int] | None:
    """Exact banded DP over (stage, start); returns the stage ends, or None if no balance costs <= ub.

    ``ub`` defaults to ``_upper_bound``, the price of a real balance (inf if that one overflows
    memory): that balance lies in the band, so None then means that memory never fits.
    """
    n = len(prefix) - 1
    if ub is None:
        ub = _upper_bound(prefix, k, cut, speed, rows, limits)
    pre = np.asarray(prefix)
    w = _width(pre, ub, 1.0 if speed is None else max(speed))
    starts = max(0, min(n - 2, (k - 2) * w) + 1)  # every stage but the last starts at a < starts
    span = _band(pre, w, starts)  # (starts, w): [a, d] = P[b] - P[a] for the stage [a, b = a+1+d)
    # per cut row: at_end[a, d] = row[b - 1] for b = a + 1 + d; at_start[a] = row[a - 1]
    at_start = None if cut is None else [np.asarray([0.0, *row]) for row in cut]
    at_end = None if at_start is None else [_band(row, w, starts, diff=False) for row in at_start]
    mrows = None if rows is None else [np.asarray(r) for r in rows]
    mem = None if mrows is None else [_band(row, w, starts) for row in mrows]

    def stage(s: int, lo: int, hi: int) -> np.ndarray:  # (hi-lo, w): C_s for starts lo .. hi-1, s < k-1
        c = span[lo:hi] if speed is None else span[lo:hi] / speed[s]
        if at_end is not None and at_start is not None:
            c = c + at_end[_row(at_end, s)][lo:hi]  # it sends the cut after its last layer
            if s > 0:  # and receives the one before its first
                c = c + at_start[_row(at_start, s - 1)][lo:hi, None]
        if mem is not None:
            c = np.where(mem[_row(mem, s)][lo:hi] <= limits[s], c, _INF)
        return c

    def last(lo: int, hi: int) -> np.ndarray:  # (hi-lo,): C_{k-1}[a, n], no cut after the last stage
        c: np.ndarray = pre[n] - pre[lo:hi] if speed is None else (pre[n] - pre[lo:hi]) / speed[k - 1]
        if at_start is not None and k > 1:
            c = c + at_start[_row(at_start, k - 2)][lo:hi]
        if mrows is not None:
            row = mrows[_row(mrows, k - 1)]
            c = np.where(row[n] - row[lo:hi] <= limits[k - 1], c, _INF)
        return c

    opt, g = _dp_core(n, k, w, stage, last)
    if opt == _INF or opt > ub:  # the banded value is never below the optimum, so that exceeds ub
        return None
    ends, a = [], 0
    for s in range(k - 1):
        ok = (stage(s, a, a + 1)[0] <= opt) & (g[s + 1][a + 1 : a + 1 + w] <= opt)
        a += 1 + int(np.flatnonzero(ok)[-1])  # the latest boundary that still allows the optimum
        ends.append(a)
    ends.append(n)
    return ends


def _dp_core(
    n: int,
    k: int,
    w: int,
    stage: Callable[[int, int, int], np.ndarray],
    last: Callable[[int, int], np.ndarray],
) -> tuple[float, list[np.ndarray]]:
    # g[s][a] = the best bottleneck of stages s..k-1 covering layers [a, n) with stages of <= w
    # layers; inf where impossible, and on a tail of w entries past n so windows need no bounds.
    #   g[k-1][a] = C_{k-1}[a, n]
    #   g[s][a]   = min over b in a+1 .. a+w of max(C_s[a, b], g[s+1][b])
    g = [np.full(n + 1 + w, _INF) for _ in range(k)]
    for s in range(k - 1, -1, -1):
        # stage s starts after s stages of 1..w layers and leaves k-s stages of 1..w layers
        lo, hi = max(s, n - (k - s) * w), min(n - (k - s), s * w) + 1
        if lo >= hi:
            break  # no start fits: g[0][0] stays inf
        if s == k - 1:
            g[s][lo:hi] = last(lo, hi)
        else:
            after = sliding_window_view(g[s + 1][1:], w)[lo:hi]  # [a, d] = g[s+1][a+1+d], no copy
            g[s][lo:hi] = np.maximum(stage(s, lo, hi), after).min(axis=1)
    return float(g[0][0]), g


def _upper_bound(
    prefix: list[float],
    k: int,
    cut: list[list[float]] | None,
    speed: list[float] | None,
    rows: list[list[float]] | None,
    limits: list[float],
) -> float:
    """The bottleneck of a good balance, priced as the DP prices it; inf if none of those tried fits.

    Greedy fill for a time threshold t (each stage takes the most layers within t and its memory),
    t bisected between the perfect split and anything-goes; the cheapest balance seen wins.
    """
    n = len(prefix) - 1
    speeds = [1.0] * k if speed is None else speed

    def greedy(t: float) -> tuple[float, bool]:  # (price of the greedy balance, whether it fit t)
        a, fits, worst = 0, True, 0.0
        for s in range(k):
            cap = n - (k - 1 - s)  # leave one layer for each later stage
            b = bisect.bisect_right(prefix, prefix[a] + t * speeds[s], a + 1, cap + 1) - 1
            if rows is not None:
                row = rows[_row(rows, s)]
                b = min(b, bisect.bisect_right(row, row[a] + limits[s], a + 1, cap + 1) - 1)
            if b <= a or (s == k - 1 and b < n):
                fits, b = False, (n if s == k - 1 else a + 1)
            c = prefix[b] - prefix[a] if speed is None else (prefix[b] - prefix[a]) / speed[s]
            if cut is not None and s < k - 1:
                c = c + cut[_row(cut, s)][b - 1]
            if cut is not None and s > 0:
                c = c + cut[_row(cut, s - 1)][a - 1]
            if rows is not None and row[b] - row[a] > limits[s]:
                c = _INF
            worst, a = max(worst, c), b
        return worst, fits

    lo, hi = prefix[n] / sum(speeds), prefix[n] / min(speeds)
    best = greedy(hi)[0]
    for _ in range(16):
        mid = lo + (hi - lo) / 2
        worst, fits = greedy(mid)
        best = min(best, worst)
        lo, hi = (lo, mid) if fits else (mid, hi)
    return best


def _width(pre: np.ndarray, ub: float, smax: float) -> int:
    """The band width w: the most layers of a stage whose summed cost at the fastest speed is <= ub."""
    n = len(pre) - 1
    a = np.arange(n + 1)
    lo, hi = a.copy(), np.full(n + 1, n + 1)  # per start a: [a, lo) fits (or lo = a), [a, hi) does not
    while np.any(hi - lo > 1):  # bisection on the exact float test, for every start at once
        mid = (lo + hi) // 2
        fits = (pre[np.minimum(mid, n)] - pre) / smax <= ub
        lo, hi = np.where(fits, mid, lo), np.where(fits, hi, mid)
    return max(1, int((lo - a).max()))


def _band(values: np.ndarray, w: int, starts: int, diff: bool = True) -> np.ndarray:
    """(starts, w) over stage ends b = a+1+d: values[b] - values[a] (or values[b]); inf past layer n."""
    n = len(values) - 1
    b = np.arange(starts)[:, None] + np.arange(1, w + 1)[None, :]
    at = values[np.minimum(b, n)]
    return np.where(b <= n, at - values[:starts, None] if diff else at, _INF)


def _row(rows: Sequence[object], s: int) -> int:
    return s if len(rows) > 1 else 0  # one row per stage (or boundary), or one for all
