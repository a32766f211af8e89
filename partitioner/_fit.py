"""Does any balance fit the memory limits, and what is the smallest limit that does? In milliseconds.

    # n: layers, k: stages, s: stage, [a, b): the layers of one stage, M_s: stage s's memory row

``fits``: the ends that s stages can reach, E_s, stage after stage (no search over times)::

    E_0 = {0}
    E_s+1 = union over a in E_s of [a + 1, R_s(a)]     R_s(a): the last b with M_s[a, b] <= limit_s
    fits  iff  n in E_k

M_s[a, b] = P_s[b] - P_s[a] grows with b, so R_s comes from one ``searchsorted`` per stage, made
exact for the solver's own test (the float difference <= the limit) by moving each guess across
whole runs of equal prefix sums. Each stage is a handful of numpy operations: O(k n), a few ms at
n = 1000, k = 64, where the time DP would span every layer (no bound narrows its band when nothing
fits) before it could tell.

``smallest``: the least x for which ``limits_at(x)`` fit, the limits being about x * scale_s -
offset_s. The min-max DP of (M_s + offset_s) / scale_s over balances gives x; each stage s only
looks at stages of at most w_s layers, those within the peak of a real balance (the better of an
even split and a greedy one), so every optimal balance lies in the band. A few float steps then
move x onto the exact boundary of ``fits``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import numpy as np

from partitioner._dp import _row

__all__ = ["fits", "smallest"]

_STEPS = 64  # float steps to settle on the boundary of ``fits`` (rounding moves it by an ulp or two)


def fits(rows: list[list[float]] | list[np.ndarray], limits: list[float], k: int) -> bool:
    """Whether some balance into k stages keeps M_s (row s, or the one row) <= limits[s] on every stage."""
    n = len(rows[0]) - 1
    arrays = [np.asarray(r, dtype=np.float64) for r in rows]
    at = np.arange(n + 1)
    ends = at == 0  # E_0
    for s in range(k):
        reach = _reach(arrays[_row(arrays, s)], limits[s])
        starts = at[ends & (reach > at)]  # a stage starting there holds at least one layer
        cover = np.bincount(starts + 1, minlength=n + 2) - np.bincount(reach[starts] + 1, minlength=n + 2)
        ends = np.cumsum(cover)[: n + 1] > 0
        if not ends.any():  # no stage ends anywhere: nor will any later one (a refusal's limit)
            return False
    return bool(ends[n])


def _reach(row: np.ndarray, limit: float) -> np.ndarray:
    """R[a]: the last b >= a with row[b] - row[a] <= limit (a - 1 when even b = a does not fit)."""
    n = len(row) - 1
    at = np.arange(n + 1)
    if not limit >= 0:
        return at - 1
    guess = np.searchsorted(row, row + limit, side="right") - 1
    for _ in range(_STEPS):
        over = row[guess] - row > limit  # too far: back before the run of equal sums at guess
        if not over.any():  # nothing too far: is any start short of a next layer that fits?
            nxt = np.minimum(guess + 1, n)
            if not ((guess < n) & (row[nxt] - row <= limit)).any():
                break  # every guess exact: what the steps below would settle on at once
        back = np.where(over, np.searchsorted(row, row[guess], side="left") - 1, guess)
        nxt = np.minimum(back + 1, n)
        more = (back < n) & (row[nxt] - row <= limit)  # the next fits too: to the end of its run
        fixed = np.where(more, np.searchsorted(row, row[nxt], side="right") - 1, back)
        if np.array_equal(fixed, guess):
            break
        guess = fixed
    return np.maximum(guess, at - 1)


def smallest(
    rows: list[list[float]] | list[np.ndarray],
    k: int,
    limits_at: Callable[[float], list[float]],
    scale: list[float],
    offset: list[float],
) -> float:
    """The least x >= 0 with ``fits(rows, limits_at(x), k)``; limits_at(x)[s] ~ x * scale[s] - offset[s]."""
    arrays = [np.asarray(r, dtype=np.float64) for r in rows]
    x = _min_max(arrays, k, scale, offset)
    if math.isinf(x):
        return x
    for _ in range(_STEPS):  # up until it fits ...
        if fits(arrays, limits_at(x), k):
            break
        x = math.nextafter(x, math.inf)
    for _ in range(_STEPS):  # ... and down while it still does
        below = math.nextafter(x, 0.0)
        if x == 0.0 or not fits(arrays, limits_at(below), k):
            break
        x = below
    return x


def _min_max(mats: list[np.ndarray], k: int, scale: list[float], offset: list[float]) -> float:
    """min over balances of max_s (M_s[a, b] + offset_s) / scale_s (see ``min_max_core``)."""
    n = len(mats[0]) - 1

    def cost(s: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        m = mats[_row(mats, s)]
        need = m[b] - m[a] + offset[s]  # >= 0: memory and offsets are
        return need / scale[s] if scale[s] > 0 else np.where(need > 0, math.inf, 0.0)

    ub = min(
        _peak(mats, k, cost, ends) for ends in (_even_split(mats, k), _greedy_split(mats, k, scale, offset))
    )
    if math.isinf(ub):
        return ub
    widths = [
        n if scale[s] <= 0 else _most_layers(mats[_row(mats, s)], ub * scale[s] - offset[s]) for s in range(k)
    ]
    return min_max_core(n, k, cost, widths, ub)


def min_max_core(
    n: int, k: int, cost: Callable[[int, np.ndarray, np.ndarray], np.ndarray], widths: list[int], ub: float
) -> float:
    """min over balances of max_s cost(s, a, b): a backward DP over (stage, start), stage s looking
    only at stages of at most ``widths[s]`` layers, those within ``ub``, the peak of a real balance
    (so every optimal balance lies inside)."""
    before = np.cumsum([0, *widths])  # the most layers stages 0..s-1 can hold
    after = np.cumsum([0, *widths[::-1]])[::-1]  # ... and stages s..k-1
    pad = max(widths)
    g = np.full(n + 1 + pad, math.inf)  # g[b]: best bottleneck of stages s+1..k-1 covering [b, n)
    lo, hi = max(k - 1, n - widths[k - 1]), n - 1 + 1
    a = np.arange(lo, hi)
    g[lo:hi] = cost(k - 1, a, np.full_like(a, n))
    for s in range(k - 2, -1, -1):
        lo, hi = max(s, n - int(after[s])), min(n - (k - s), int(before[s])) + 1
        new = np.full(n + 1 + pad, math.inf)
        if lo < hi:
            a = np.arange(lo, hi)[:, None]
            b = a + np.arange(1, widths[s] + 1)[None, :]
            c = np.where(b <= n, cost(s, a, np.minimum(b, n)), math.inf)
            new[lo:hi] = np.maximum(c, g[np.minimum(b, n + pad)]).min(axis=1)
        g = new
    return min(float(g[0]), ub)


def _most_layers(row: np.ndarray, limit: float) -> int:
    """The most layers any stage can hold with M[a, b] <= limit, plus a little room for rounding."""
    limit = limit + abs(limit) * 1e-12 + 1e-300
    at = np.arange(len(row))
    return max(1, int((_reach(row, limit) - at).max()))


def _peak(mats: list[np.ndarray], k: int, cost: Callable[..., np.ndarray], ends: list[int] | None) -> float:
    if ends is None:
        return math.inf
    starts = [0, *ends[:-1]]
    return max(float(cost(s, np.asarray([starts[s]]), np.asarray([ends[s]]))[0]) for s in range(k))


def _even_split(mats: list[np.ndarray], k: int) -> list[int]:
    """Stage ends of a real balance: the smallest row's total split evenly (one layer at least each)."""
    n = len(mats[0]) - 1
    low = np.minimum.reduce(mats)
    targets = np.searchsorted(low, low[n] * np.arange(1, k) / k, side="left")
    ends, prev = [], 0
    for s in range(k - 1):
        prev = min(max(int(targets[s]), prev + 1), n - (k - 1 - s))
        ends.append(prev)
    ends.append(n)
    return ends


def _greedy_split(
    mats: list[np.ndarray], k: int, scale: list[float], offset: list[float]
) -> list[int] | None:
    """Stage ends of a good balance, if found: each stage takes the most layers within a peak t of
    its own row, t bisected (a heuristic: it only has to be real, and near the optimum)."""
    n = len(mats[0]) - 1

    lists = [m.tolist() for m in mats]  # bisect on lists: searchsorted's answer, without its call cost

    def fill(t: float) -> list[int] | None:
        ends, a = [], 0
        for s in range(k):
            m = lists[_row(mats, s)]
            room = t * scale[s] - offset[s] if scale[s] > 0 else 0.0
            b = min(bisect.bisect_right(m, m[a] + room) - 1, n - (k - 1 - s))
            if b <= a:
                return None
            ends.append(b)
            a = b
        return ends if a == n else None

    lo, hi = 0.0, max(float(m[n]) for m in mats) / max(min(scale), 1e-300) + max(offset)
    best = fill(hi)
    for _ in range(30):
        mid = lo + (hi - lo) / 2
        found = fill(mid)
        lo, hi, best = (lo, mid, found) if found is not None else (mid, hi, best)
    return best
