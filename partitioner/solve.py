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
        -> backward DP over (stage, start) with numpy, min/max only (no rounding).

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


def _dp(
    prefix: list[float],
    k: int,
    cut: list[float] | None,
    speed: list[float] | None,
    rows: list[list[float]] | None,
    limits: list[float],
) -> list[int] | None:
    """Exact backward DP over (stage, start); returns the stage ends, or None if memory never fits."""
    n = len(prefix) - 1
    p = np.asarray(prefix)
    span = np.where(_empty(n), _INF, p[None, :] - p[:, None])  # (n+1, n+1): [a, b] = P[b] - P[a]
    cut_at_end = None if cut is None else np.asarray([0.0, *cut])  # [b] = cut_costs[b - 1]
    mrows = None if rows is None else [np.asarray(r) for r in rows]
    cache: dict[tuple[float, bool, int, float], np.ndarray] = {}

    def matrix(j: int) -> np.ndarray:
        last = j == k - 1
        s = 1.0 if speed is None else speed[j]
        r = 0 if mrows is None or len(mrows) == 1 else j
        key = (s, last, r, limits[j] if mrows is not None else 0.0)
        if key not in cache:
            c = span if speed is None else span / s
            if cut_at_end is not None and not last:
                c = c + cut_at_end[None, :]
            if mrows is not None:
                mp = mrows[r]
                c = np.where(mp[None, :] - mp[:, None] <= limits[j], c, _INF)
            cache[key] = c
        return cache[key]

    opt, g = _dp_core(n, k, matrix)
    if opt == _INF:
        return None
    ends, a = [], 0
    for j in range(k - 1):
        ok = (matrix(j)[a] <= opt) & (g[j + 1] <= opt)
        a = int(np.flatnonzero(ok)[-1])  # the latest boundary that still allows the optimum
        ends.append(a)
    ends.append(n)
    return ends


def _dp_core(n: int, k: int, matrix: Callable[[int], np.ndarray]) -> tuple[float, list[np.ndarray]]:
    # g[j][a] = the best bottleneck of stages j..k-1 covering layers [a, n); inf where impossible.
    #   g[k-1][a] = C_{k-1}[a, n]
    #   g[j][a]   = min over b > a of max(C_j[a, b], g[j+1][b])
    g = [np.full(n + 1, _INF) for _ in range(k)]
    g[k - 1] = matrix(k - 1)[:, n].copy()
    for j in range(k - 2, -1, -1):
        g[j] = np.maximum(matrix(j), g[j + 1][None, :]).min(axis=1)
    return float(g[0][0]), g


def _empty(n: int) -> np.ndarray:
    return np.tril(np.ones((n + 1, n + 1), dtype=bool))  # [a, b] with a >= b is no stage


def _min_max_memory(rows: list[list[float]], scale: list[float], k: int) -> float:
    """min over balances of max_j memory_j / scale_j: the same DP on memory differences."""
    n = len(rows[0]) - 1
    mats = [np.asarray(r) for r in rows]
    empty = _empty(n)

    def matrix(j: int) -> np.ndarray:
        mp = mats[j if len(mats) > 1 else 0]
        d = mp[None, :] - mp[:, None]
        return np.where(empty, _INF, d if scale[j] == 1.0 else d / scale[j])

    return _dp_core(n, k, matrix)[0]


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
