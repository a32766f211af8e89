"""Exact chains-on-chains: split n layer costs into k contiguous, non-empty stages so that the
largest stage cost (the bottleneck) is as small as it can be.

    # n: layers, k: stages, l: layer, s: stage, [a, b): the layers of one stage

The stage cost, shared by every function here and by the tests' brute force::

    cost_s(a, b) = (P[b] - P[a]) / speeds[s]  +  cut_s[b - 1]  +  cut_{s-1}[a - 1]
                                                 (if s < k - 1)     (if s > 0)

A cut costs both stages it separates: the sender spends that long on the transfer and so does
the receiver. ``cut_costs`` is one row for every boundary, or k - 1 rows (row s: the boundary
between stages s and s + 1, e.g. each over its own link); cut_s above is boundary s's row.

P holds the prefix sums of ``costs``, each the correctly rounded value of the exact sum (exact
integer arithmetic, then one rounding), so P is non-decreasing and cost_s is monotone in a and in
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
           looks only at ends b = a+1 .. a+w (entries past n are inf) and at starts a that s
           earlier and k-s later stages of 1..w layers allow. Every stage of an optimal balance
           costs <= opt <= UB, so it lies in the band: the answer, ties included, is unchanged.

                 b ->  1 2 3 4 5 6 7 8          # window row a: C_s[a, a+1 .. a+w], here w = 3
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
import math
from collections.abc import Sequence

from partitioner._dp import _dp
from partitioner._fit import fits, smallest
from partitioner._inputs import (
    _check_cuts,
    _check_memory,
    _check_speeds,
    _check_stages,
    _check_values,
    _is_rows,
    _prefix,
    _ranges,
)

__all__ = ["solve", "stage_costs", "stage_memory"]

_INF = math.inf


def solve(
    costs: Sequence[float],
    n_stages: int,
    *,
    cut_costs: Sequence[float] | Sequence[Sequence[float]] | None = None,
    memory: Sequence[float] | Sequence[Sequence[float]] | None = None,
    memory_limit: float | Sequence[float] | None = None,
    speeds: Sequence[float] | None = None,
) -> list[int]:
    """The balance (layers per stage) with the smallest bottleneck; see the module docstring.

    ``cut_costs`` is per layer (the cut after it), or k - 1 rows of those, one per boundary;
    ``memory`` is per layer, or one row per stage (memory of layer l when it sits on stage s);
    ``memory_limit`` is one number or one per stage. Raises ``ValueError`` for bad input and, when no
    balance fits the memory limit (found before any search, in milliseconds), one that states the
    smallest limit that would.
    """
    n = len(costs)
    _check_stages(n_stages, n)
    k = n_stages
    prefix = _prefix(_check_values("costs", costs, n))
    cut = _check_cuts(cut_costs, n, k)
    speed = None if speeds is None else _check_speeds(speeds, k)
    rows, limits = _check_memory(memory, memory_limit, n, k)
    if rows is not None and not fits(rows, limits, k):
        raise ValueError(_memory_message(rows, limits, memory_limit, k))
    uniform = (
        cut is None
        and (speed is None or len(set(speed)) == 1)
        and (rows is None or (len(rows) == 1 and len(set(limits)) == 1))
    )
    if uniform:
        one_speed = 1.0 if speed is None else speed[0]
        mem = None if rows is None else (rows[0], limits[0])
        ends = _probe_search(prefix, k, one_speed, mem)
    else:
        ends = _dp(prefix, k, cut, speed, rows, limits)
    if ends is None:  # cannot happen: memory fits (checked above), and nothing else can fail
        raise RuntimeError(f"no balance found for {n} layers into {k} stages although memory fits")
    return [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def stage_costs(
    costs: Sequence[float],
    balance: Sequence[int],
    *,
    cut_costs: Sequence[float] | Sequence[Sequence[float]] | None = None,
    speeds: Sequence[float] | None = None,
) -> list[float]:
    """cost_s of every stage of ``balance``: the definition that ``solve`` minimises the max of."""
    n, k = len(costs), len(balance)
    prefix = _prefix(_check_values("costs", costs, n))
    cut = _check_cuts(cut_costs, n, k)
    speed = None if speeds is None else _check_speeds(speeds, k)
    out = []
    for s, (a, b) in enumerate(_ranges(balance, n)):
        c = prefix[b] - prefix[a]
        if speed is not None:
            c = c / speed[s]
        if cut is not None and s < k - 1:
            c = c + cut[s if len(cut) > 1 else 0][b - 1]
        if cut is not None and s > 0:
            c = c + cut[s - 1 if len(cut) > 1 else 0][a - 1]
        out.append(c)
    return out


def stage_memory(memory: Sequence[float] | Sequence[Sequence[float]], balance: Sequence[int]) -> list[float]:
    """Summed memory of every stage of ``balance`` (``memory`` per layer or one row per stage)."""
    n = len(memory[0]) if _is_rows(memory) else len(memory)  # type: ignore[arg-type]
    rows, _ = _check_memory(memory, 0.0, n, len(balance))
    assert rows is not None
    return [
        rows[s if len(rows) > 1 else 0][b] - rows[s if len(rows) > 1 else 0][a]
        for s, (a, b) in enumerate(_ranges(balance, n))
    ]


# -- the probe search (the banded DP is in partitioner._dp) ----------------------------------------


def _probe_search(
    prefix: list[float], k: int, speed: float, mem: tuple[list[float], float] | None
) -> list[int] | None:
    """Exact search over identical stages; returns the stage ends, or None if memory never fits."""
    n = len(prefix) - 1

    def probe(t: float) -> tuple[list[int] | None, float, float]:
        # Returns (ends or None, bottleneck of the ends, smallest threshold > t that changes anything).
        ends: list[int] = []
        a, worst, nxt = 0, 0.0, _INF
        for s in range(k):
            pa = prefix[a]
            cap = n - (k - 1 - s)  # leave one layer for each later stage
            b = bisect.bisect_right(prefix, t, a + 1, cap + 1, key=lambda x: (x - pa) / speed) - 1
            if mem is not None:
                mp, lim = mem
                ma = mp[a]
                b = min(b, bisect.bisect_right(mp, lim, a + 1, cap + 1, key=lambda x: x - ma) - 1)
                grow_fits = b < cap and mp[b + 1] - ma <= lim
            else:
                grow_fits = b < cap
            if grow_fits:  # one more layer would fit in memory; it costs this much
                nxt = min(nxt, (prefix[b + 1] - pa) / speed)
            if b <= a or (s == k - 1 and b < n):
                return None, _INF, nxt
            worst = max(worst, (prefix[b] - pa) / speed)
            ends.append(b)
            a = b
        return ends, worst, nxt

    ends, hi, _ = probe(_INF)
    if ends is None:
        return None
    # opt >= the costliest single layer, since any stage holding it costs at least that much
    lo = max((prefix[layer + 1] - prefix[layer]) / speed for layer in range(n))
    guess = prefix[n] / speed / k
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


def _memory_message(
    rows: list[list[float]], limits: list[float], given: float | Sequence[float] | None, k: int
) -> str:
    least = smallest(rows, k, lambda x: [x] * k, [1.0] * k, [0.0] * k)
    if isinstance(given, (int, float)):
        return (
            f"memory_limit ({given:g}) is too small: no split into {k} stages fits it; the smallest "
            f"limit that fits is {least!r}; raise memory_limit or use more stages"
        )
    factor = smallest(rows, k, lambda x: [x * lim for lim in limits], limits, [0.0] * k)
    return (
        f"memory_limit ({list(limits)}) is too small: no split into {k} stages fits it; the limits "
        f"must grow by a factor of at least {factor!r}, or be at least {least!r} on every stage"
    )
