"""Exact chains-on-chains: split n layer costs into k contiguous, non-empty stages so that the
largest stage cost (the bottleneck) is as small as it can be.

    # n: layers, k: stages, i: layer, j: stage, [a, b): the layers of one stage

The stage cost, shared by every function here and by the tests' brute force::

    cost_j(a, b) = (P[b] - P[a]) / speeds[j]  +  cut_costs[b - 1]   (the cut term only if j < k - 1)

P holds the prefix sums of ``costs``, each the correctly rounded value of the exact sum (exact
integer arithmetic, then one rounding), so P is non-decreasing and cost_j is monotone in a and in
the summed part; no epsilon appears anywhere and the answer is exact for float costs. A stage's
memory is the same difference over the prefix sums of ``memory`` (one row, or one row per stage).

Two exact algorithms, one answer:

    identical stages (no cut costs, one speed, one memory row and limit)
        -> probe search: greedy probe(T) takes the longest stage that fits T, again and again.
           A failed probe also returns the smallest T' > T that could change its result, so the
           search jumps between attained stage costs; ~log2(range) probes of k bisections each.
    otherwise (cut costs, per-stage speeds or limits)
        -> backward DP over (stage, start) with numpy, min/max only (no rounding), banded:

           A greedy balance priced under the full model gives UB >= opt. A stage costs at least
           (P[b] - P[a]) / max(speeds), so one with cost <= UB holds at most w layers, and the DP
           looks only at ends b = a+1 .. a+w (entries past n are inf) and at starts a that j
           earlier and k-j later stages of 1..w layers allow. Every stage of an optimal balance
           costs <= opt <= UB, so it lies in the band: the answer, ties included, is unchanged.

                 b ->  1 2 3 4 5 6 7 8          # window row a: C_j[a, a+1 .. a+w], here w = 3
            a = 0      # # #                    work per stage O(n * w), not O(n^2)
            a = 1        # # #
            a = 2          # # #

Tie rule: among balances with the minimal bottleneck, return the one whose stage boundaries all lie
as late as possible (such a balance exists, the feasible boundary vectors being closed under
element-wise max); equivalently the lexicographically largest balance: early stages take as many
layers as the optimum allows.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["solve", "stage_costs", "stage_memory"]

_INF = math.inf


def solve(
    costs: Sequence[float],
    n_stages: int,
    *,
    cut_costs: Sequence[float] | None = None,
    memory: Sequence[float] | Sequence[Sequence[float]] | None = None,
    memory_limit: float | Sequence[float] | None = None,
    speeds: Sequence[float] | None = None,
) -> list[int]:
    """The balance (layers per stage) with the smallest bottleneck; see the module docstring.

    ``memory`` is per layer, or one row per stage (memory of layer i when it sits on stage j);
    ``memory_limit`` is one number or one per stage. Raises ``ValueError`` for bad input and, when no
    balance fits the memory limit, one that states the smallest limit that would.
    """
    n = len(costs)
    _check_stages(n_stages, n)
    k = n_stages
    prefix = _prefix(_check_values("costs", costs, n))
    cut = None if cut_costs is None else _check_values("cut_costs", cut_costs, n)
    if cut is not None and not any(cut[: n - 1]):
        cut = None  # the last layer's cut is never paid; all-zero cuts change nothing
    speed = None if speeds is None else _check_speeds(speeds, k)
    rows, limits = _check_memory(memory, memory_limit, n, k)
    uniform = (
        cut is None
        and (speed is None or len(set(speed)) == 1)
        and (rows is None or (len(rows) == 1 and len(set(limits)) == 1))
    )
    if uniform:
        s = 1.0 if speed is None else speed[0]
        mem = None if rows is None else (rows[0], limits[0])
        ends = _probe_search(prefix, k, s, mem)
    else:
        ends = _dp(prefix, k, cut, speed, rows, limits)
    if ends is None:
        assert rows is not None  # only memory can make every balance infeasible
        raise ValueError(_memory_message(rows, limits, memory_limit, k))
    return [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def stage_costs(
    costs: Sequence[float],
    balance: Sequence[int],
    *,
    cut_costs: Sequence[float] | None = None,
    speeds: Sequence[float] | None = None,
) -> list[float]:
    """cost_j of every stage of ``balance``: the definition that ``solve`` minimises the max of."""
    n = len(costs)
    prefix = _prefix(_check_values("costs", costs, n))
    cut = None if cut_costs is None else _check_values("cut_costs", cut_costs, n)
    speed = None if speeds is None else _check_speeds(speeds, len(balance))
    out = []
    for j, (a, b) in enumerate(_ranges(balance, n)):
        c = prefix[b] - prefix[a]
        if speed is not None:
            c = c / speed[j]
        if cut is not None and j < len(balance) - 1:
            c = c + cut[b - 1]
        out.append(c)
    return out


def stage_memory(memory: Sequence[float] | Sequence[Sequence[float]], balance: Sequence[int]) -> list[float]:
    """Summed memory of every stage of ``balance`` (``memory`` per layer or one row per stage)."""
    n = len(memory[0]) if _is_rows(memory) else len(memory)  # type: ignore[arg-type]
    rows, _ = _check_memory(memory, 0.0, n, len(balance))
    assert rows is not None
    return [
        rows[j if len(rows) > 1 else 0][b] - rows[j if len(rows) > 1 else 0][a]
        for j, (a, b) in enumerate(_ranges(balance, n))
    ]


# -- the two searches ------------------------------------------------------------------------------


def _probe_search(
    prefix: list[float], k: int, s: float, mem: tuple[list[float], float] | None
) -> list[int] | None:
    """Exact search over identical stages; returns the stage ends, or None if memory never fits."""
    n = len(prefix) - 1

    def probe(t: float) -> tuple[list[int] | None, float, float]:
        # Returns (ends or None, bottleneck of the ends, smallest threshold > t that changes anything).
        ends: list[int] = []
        a, worst, nxt = 0, 0.0, _INF
        for j in range(k):
            pa = prefix[a]
            cap = n - (k - 1 - j)  # leave one layer for each later stage
            b = bisect.bisect_right(prefix, t, a + 1, cap + 1, key=lambda x: (x - pa) / s) - 1
            if mem is not None:
                mp, lim = mem
                ma = mp[a]
                b = min(b, bisect.bisect_right(mp, lim, a + 1, cap + 1, key=lambda x: x - ma) - 1)
                grow_fits = b < cap and mp[b + 1] - ma <= lim
            else:
                grow_fits = b < cap
            if grow_fits:  # one more layer would fit in memory; it costs this much
                nxt = min(nxt, (prefix[b + 1] - pa) / s)
            if b <= a or (j == k - 1 and b < n):
                return None, _INF, nxt
            worst = max(worst, (prefix[b] - pa) / s)
            ends.append(b)
            a = b
        return ends, worst, nxt

    ends, hi, _ = probe(_INF)
    if ends is None:
        return None
    # opt >= the costliest single layer, since any stage holding it costs at least that much
    lo = max((prefix[i + 1] - prefix[i]) / s for i in range(n))
    guess = prefix[n] / s / k
    while lo < hi:
        mid = guess if lo < guess < hi else lo + (hi - lo) / 2
        guess = _INF
        if not lo < mid < hi:
            mid = lo
        found, worst, nxt = probe(mid)
        if found is not None:
            hi = worst
        else:
            lo = nxt
    ends, _, _ = probe(hi)  # the probe at the optimum gives the latest boundaries (the tie rule)
    return ends


def _dp(prefix: list[float], k: int, cut: list[float] | None, speed: list[float] | None,
        rows: list[list[float]] | None, limits: list[float], ub: float | None = None) -> list[int] | None:
    """Exact banded DP over (stage, start); returns the stage ends, or None if no balance costs <= ub.

    ``ub`` defaults to ``_upper_bound``, the price of a real balance (inf if that one overflows
    memory): that balance lies in the band, so None then means that memory never fits.
    """
    n = len(prefix) - 1
    if ub is None:
        ub = _upper_bound(prefix, k, cut, speed, rows, limits)
    p = np.asarray(prefix)
    w = _width(p, ub, 1.0 if speed is None else max(speed))
    starts = max(0, min(n - 2, (k - 2) * w) + 1)  # every stage but the last starts at a < starts
    span = _band(p, w, starts)  # (starts, w): [a, d] = P[b] - P[a] for the stage [a, b = a+1+d)
    cut_at_end = None if cut is None else _band(np.asarray([0.0, *cut]), w, starts, diff=False)
    mrows = None if rows is None else [np.asarray(r) for r in rows]
    mem = None if mrows is None else [_band(m, w, starts) for m in mrows]

    def stage(j: int, lo: int, hi: int) -> np.ndarray:  # (hi-lo, w): C_j for starts lo .. hi-1, j < k-1
        c = span[lo:hi] if speed is None else span[lo:hi] / speed[j]
        if cut_at_end is not None:
            c = c + cut_at_end[lo:hi]  # [a, d] = cut_costs[b - 1]
        if mem is not None:
            c = np.where(mem[_row(mem, j)][lo:hi] <= limits[j], c, _INF)
        return c

    def last(lo: int, hi: int) -> np.ndarray:  # (hi-lo,): C_{k-1}[a, n], no cut after the last stage
        c: np.ndarray = p[n] - p[lo:hi] if speed is None else (p[n] - p[lo:hi]) / speed[k - 1]
        if mrows is not None:
            m = mrows[_row(mrows, k - 1)]
            c = np.where(m[n] - m[lo:hi] <= limits[k - 1], c, _INF)
        return c

    opt, g = _dp_core(n, k, w, stage, last)
    if opt == _INF or opt > ub:  # the banded value is never below the optimum, so that exceeds ub
        return None
    ends, a = [], 0
    for j in range(k - 1):
        ok = (stage(j, a, a + 1)[0] <= opt) & (g[j + 1][a + 1 : a + 1 + w] <= opt)
        a += 1 + int(np.flatnonzero(ok)[-1])  # the latest boundary that still allows the optimum
        ends.append(a)
    ends.append(n)
    return ends


def _dp_core(n: int, k: int, w: int, stage: Callable[[int, int, int], np.ndarray],
             last: Callable[[int, int], np.ndarray]) -> tuple[float, list[np.ndarray]]:
    # g[j][a] = the best bottleneck of stages j..k-1 covering layers [a, n) with stages of <= w
    # layers; inf where impossible, and on a tail of w entries past n so windows need no bounds.
    #   g[k-1][a] = C_{k-1}[a, n]
    #   g[j][a]   = min over b in a+1 .. a+w of max(C_j[a, b], g[j+1][b])
    g = [np.full(n + 1 + w, _INF) for _ in range(k)]
    for j in range(k - 1, -1, -1):
        # stage j starts after j stages of 1..w layers and leaves k-j stages of 1..w layers
        lo, hi = max(j, n - (k - j) * w), min(n - (k - j), j * w) + 1
        if lo >= hi:
            break  # no start fits: g[0][0] stays inf
        if j == k - 1:
            g[j][lo:hi] = last(lo, hi)
        else:
            after = sliding_window_view(g[j + 1][1:], w)[lo:hi]  # [a, d] = g[j+1][a+1+d], no copy
            g[j][lo:hi] = np.maximum(stage(j, lo, hi), after).min(axis=1)
    return float(g[0][0]), g


def _upper_bound(prefix: list[float], k: int, cut: list[float] | None, speed: list[float] | None,
                 rows: list[list[float]] | None, limits: list[float]) -> float:
    """The bottleneck of a good balance, priced as the DP prices it; inf if none of those tried fits.

    Greedy fill for a time threshold t (each stage takes the most layers within t and its memory),
    t bisected between the perfect split and anything-goes; the cheapest balance seen wins.
    """
    n = len(prefix) - 1
    s = [1.0] * k if speed is None else speed

    def greedy(t: float) -> tuple[float, bool]:  # (price of the greedy balance, whether it fit t)
        a, fits, worst = 0, True, 0.0
        for j in range(k):
            cap = n - (k - 1 - j)  # leave one layer for each later stage
            b = bisect.bisect_right(prefix, prefix[a] + t * s[j], a + 1, cap + 1) - 1
            if rows is not None:
                m = rows[_row(rows, j)]
                b = min(b, bisect.bisect_right(m, m[a] + limits[j], a + 1, cap + 1) - 1)
            if b <= a or (j == k - 1 and b < n):
                fits, b = False, (n if j == k - 1 else a + 1)
            c = prefix[b] - prefix[a] if speed is None else (prefix[b] - prefix[a]) / speed[j]
            if cut is not None and j < k - 1:
                c = c + cut[b - 1]
            if rows is not None and m[b] - m[a] > limits[j]:
                c = _INF
            worst, a = max(worst, c), b
        return worst, fits

    lo, hi = prefix[n] / sum(s), prefix[n] / min(s)
    best = greedy(hi)[0]
    for _ in range(16):
        mid = lo + (hi - lo) / 2
        worst, fits = greedy(mid)
        best = min(best, worst)
        lo, hi = (lo, mid) if fits else (mid, hi)
    return best


def _width(p: np.ndarray, ub: float, smax: float) -> int:
    """The band width w: the most layers of a stage whose summed cost at the fastest speed is <= ub."""
    n = len(p) - 1
    a = np.arange(n + 1)
    lo, hi = a.copy(), np.full(n + 1, n + 1)  # per start a: [a, lo) fits (or lo = a), [a, hi) does not
    while np.any(hi - lo > 1):  # bisection on the exact float test, for every start at once
        mid = (lo + hi) // 2
        fits = (p[np.minimum(mid, n)] - p) / smax <= ub
        lo, hi = np.where(fits, mid, lo), np.where(fits, hi, mid)
    return max(1, int((lo - a).max()))


def _band(values: np.ndarray, w: int, starts: int, diff: bool = True) -> np.ndarray:
    """(starts, w) over stage ends b = a+1+d: values[b] - values[a] (or values[b]); inf past layer n."""
    n = len(values) - 1
    b = np.arange(starts)[:, None] + np.arange(1, w + 1)[None, :]
    at = values[np.minimum(b, n)]
    return np.where(b <= n, at - values[:starts, None] if diff else at, _INF)


def _row(rows: Sequence[object], j: int) -> int:
    return j if len(rows) > 1 else 0  # one memory row per stage, or one for all


def _min_max_memory(rows: list[list[float]], scale: list[float], k: int) -> float:
    """min over balances of max_j memory_j / scale_j: the same DP on memory differences, unbanded."""
    n = len(rows[0]) - 1
    mats = [np.asarray(r) for r in rows]
    bands, m = [_band(r, n, n + 1) for r in mats], mats[_row(mats, k - 1)]

    def stage(j: int, lo: int, hi: int) -> np.ndarray:
        return bands[_row(bands, j)][lo:hi] / scale[j]

    return _dp_core(n, k, n, stage, lambda lo, hi: (m[n] - m[lo:hi]) / scale[k - 1])[0]


def _memory_message(
    rows: list[list[float]], limits: list[float], given: float | Sequence[float] | None, k: int
) -> str:
    smallest = _min_max_memory(rows, [1.0] * k, k)
    if isinstance(given, (int, float)):
        return (
            f"memory_limit ({given:g}) is too small: no split into {k} stages fits it; the smallest "
            f"limit that fits is {smallest!r}; raise memory_limit or use more stages"
        )
    factor = _min_max_memory(rows, limits, k)
    return (
        f"memory_limit ({list(limits)}) is too small: no split into {k} stages fits it; the limits "
        f"must grow by a factor of at least {factor!r}, or be at least {smallest!r} on every stage"
    )


# -- validation and prefix sums --------------------------------------------------------------------


def _prefix(values: list[float]) -> list[float]:
    # Exact sums in integers (floats are dyadic), each rounded once: correctly rounded and monotone.
    ratios = [v.as_integer_ratio() for v in values]
    den = max((d for _, d in ratios), default=1)
    acc, out = 0, [0.0]
    for num, d in ratios:
        acc += num * (den // d)
        out.append(acc / den)
    return out


def _check_stages(n_stages: int, n: int) -> None:
    if n == 0:
        raise ValueError("costs is empty: there are no layers to split; pass one cost per layer")
    if isinstance(n_stages, bool) or not isinstance(n_stages, (int, np.integer)) or not 1 <= n_stages <= n:
        raise ValueError(f"n_stages ({n_stages!r}) must be an integer from 1 to the number of layers ({n})")


def _check_values(name: str, values: Sequence[float], n: int) -> list[float]:
    out = [float(v) for v in values]
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries but there are {n} layers; pass one per layer")
    for i, v in enumerate(out):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}[{i}] is {v!r}; every entry must be a finite number >= 0")
    if not math.isfinite(math.fsum(out)):
        raise ValueError(f"{name} sum to more than the largest float; rescale them")
    return out


def _check_speeds(speeds: Sequence[float], k: int) -> list[float]:
    out = [float(v) for v in speeds]
    if len(out) != k:
        raise ValueError(f"speeds has {len(out)} entries but n_stages is {k}; pass one speed per stage")
    for j, v in enumerate(out):
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"speeds[{j}] is {v!r}; every speed must be a finite number > 0")
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
    for j, v in enumerate(limits):
        if math.isnan(v) or v < 0:
            raise ValueError(f"memory_limit[{j}] is {v!r}; limits must be numbers >= 0")
    return rows, limits


def _ranges(balance: Sequence[int], n: int) -> list[tuple[int, int]]:
    if any(isinstance(b, bool) or int(b) != b or b < 1 for b in balance) or sum(balance) != n:
        raise ValueError(f"balance {list(balance)} must be positive integers summing to the {n} layers")
    ends = np.cumsum([0, *balance]).tolist()
    return list(itertools.pairwise(ends))
