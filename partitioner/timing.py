"""Predicted step time and bubble of a split under a schedule.

    # p: ranks, v: stages per rank, m: micro-batches, s: stage, r: rank

With ``pipeline.simulate`` importable the prediction is the simulator's makespan and bubble for the
named schedule and these per-stage costs. Otherwise closed forms (work t_s = f_s + b_s)::

    gpipe, 1f1b, zb-h1    T = sum_s t_s + (m - 1) * max_s t_s
    interleaved-1f1b      T = m * max_r sum_{s on r} t_s + (p - 1) * max_s t_s
    bubble                1 - m * sum_s t_s / (p * T)

For equal stages of work t these give (m + p - 1) t and (m v + p - 1) t; the first is exact when the
slowest stage never waits, the second is the usual interleaved estimate.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["predict"]


def predict(
    schedule: str,
    forward: Sequence[float],
    backward: Sequence[float],
    n_microbatches: int,
    *,
    n_virtual: int = 1,
) -> tuple[float, float, str]:
    """(step time, bubble fraction, source) where source is "simulator" or "closed form"."""
    n_stages = len(forward)
    try:
        from pipeline.schedules.schedule import schedule as build
        from pipeline.schedules.simulate import simulate
    except ImportError:
        return (*_closed_form(schedule, forward, backward, n_microbatches, n_virtual), "closed form")
    sched = build(schedule, n_stages // n_virtual, n_microbatches, n_virtual=n_virtual)
    line = simulate(sched, list(forward), list(backward))
    return float(line.makespan), float(line.bubble_fraction), "simulator"


def _closed_form(
    schedule: str, forward: Sequence[float], backward: Sequence[float], m: int, v: int
) -> tuple[float, float]:
    work = [f + b for f, b in zip(forward, backward, strict=True)]
    p = len(work) // v
    if schedule == "interleaved-1f1b":
        per_rank = [sum(work[r::p]) for r in range(p)]
        step = m * max(per_rank) + (p - 1) * max(work)
    else:
        step = sum(work) + (m - 1) * max(work)
    bubble = 1.0 - m * sum(work) / (p * step) if step > 0 else 0.0
    return step, bubble
