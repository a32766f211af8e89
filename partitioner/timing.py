"""Predicted step time and bubble of a split under a schedule: the simulator on per-stage costs.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, s: stage

``predict`` hands the schedule and the stage costs to ``pipeline.schedules.simulate``, which
runs every rank's actions in order, each as soon as its dependencies are done. The costs are
per micro-batch; ``backward`` is the whole backward of a stage and ``weight`` the part of it
that computes parameter gradients, which a split-backward schedule (zb-h1) runs as W::

    B (input gradient) = backward - weight        W = weight

A schedule that does not split the backward runs B for the whole of it. Without ``weight``
a split schedule's W costs nothing and its B everything: no worse than 1F1B's prediction.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.schedules.schedule import Schedule
from pipeline.schedules.simulate import simulate

__all__ = ["predict"]


def predict(
    sched: Schedule,
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float] | None = None,
) -> tuple[float, float]:
    """(step time, bubble fraction) of one step of ``sched`` with these per-stage costs (seconds)."""
    whole = [float(b) for b in backward]
    parts = [0.0] * len(whole) if weight is None else [float(w) for w in weight]
    if len(parts) != len(whole):
        raise ValueError(f"weight has {len(parts)} costs but backward has {len(whole)}; pass one per stage")
    for s, (b, w) in enumerate(zip(whole, parts, strict=True)):
        if not 0.0 <= w <= b:
            raise ValueError(
                f"weight cost of stage {s} ({w!r}) must be from 0 to its whole backward ({b!r}): "
                "weight is the parameter-gradient part of backward"
            )
    line = simulate(sched, list(forward), [b - w for b, w in zip(whole, parts, strict=True)], parts)
    return float(line.makespan), float(line.bubble_fraction)
