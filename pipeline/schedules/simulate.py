"""Simulate a schedule with given costs: when every action starts and ends.

    # p: ranks, s: stage, i: micro-batch, r: rank

It times the program each rank runs (program.py), the same instructions the executor
runs: computes one after another; a ``wait`` until its message was posted by the
peer (right after the compute that made it) plus ``comm``; with replicas
(``reduce`` costs given), each stage's reduction starting at its ``reduce``, one at
a time per rank, beside the computes that follow, and the step's tail waiting for
them; a collective until the last rank of its group reaches it:

    rank 0   F0 F1 ......... B0 ...... B1 |reduce 0|     (exposed: the whole reduction)
    rank 1      F0 B0 F1 B1 |reduce 1|..........wait      (hidden behind rank 0's B1)

So a dependency that crosses ranks costs ``comm``: F(s, i) after F(s-1, i), B(s, i)
after B(s+1, i); on one rank the program's order holds them. The result is a
``Timeline`` (timeline.py), the type the executor records when it measures a real
run; its ``reductions`` are the simulated reductions over the replicas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeline.schedules.actions import Kind
from pipeline.schedules.program import play
from pipeline.schedules.schedule import Schedule
from pipeline.schedules.timeline import TimedAction, TimedReduction, Timeline
from pipeline.schedules.validate import ScheduleError

__all__ = ["Cost", "simulate"]

Cost = float | Sequence[float]  # seconds: one number for every stage, or one per stage


def _per_stage(label: str, cost: Cost, n_stages: int) -> list[float]:
    if isinstance(cost, str):
        raise ValueError(f"{label} cost {cost!r} is a string; pass seconds as a number or a sequence")
    values = [float(cost)] * n_stages if isinstance(cost, int | float) else [float(c) for c in cost]
    if len(values) != n_stages:
        raise ValueError(
            f"{label} has {len(values)} costs but the schedule has {n_stages} stages; "
            f"pass one number for every stage or a sequence of {n_stages}"
        )
    for s, c in enumerate(values):
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"{label} cost of stage {s} is {c}; costs must be finite seconds >= 0")
    return values


def _latency(label: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{label} ({value!r}) must be a finite latency in seconds >= 0")
    return float(value)


def simulate(
    schedule: Schedule,
    forward: Cost,
    backward: Cost,
    weight: Cost = 0.0,
    comm: float = 0.0,
    *,
    reduce: Cost | None = None,
    collective: float = 0.0,
) -> Timeline:
    """Timeline of ``schedule`` with per-action costs in seconds.

    ``backward`` is the input-gradient part and ``weight`` the weight-gradient part;
    a schedule that does not split them runs B for ``backward + weight``.  ``comm`` is
    the latency added to every dependency that crosses ranks. ``reduce``: per stage, the
    seconds of its gradients' reduction over replicas (None: one pipeline, no
    replicas); ``collective``: the seconds of each collective of the step's tail (the
    loss; the tied weights are the runtime's, not the schedule's).
    """
    n = schedule.n_stages
    f, b, w = (
        _per_stage(k, c, n) for k, c in (("forward", forward), ("backward", backward), ("weight", weight))
    )
    comm, collective = _latency("comm", comm), _latency("collective", collective)
    red = _per_stage("reduce", reduce, n) if reduce is not None else [0.0] * n
    whole = [x + y for x, y in zip(b, w, strict=True)]
    cost = {Kind.F: f, Kind.B: b if schedule.split_backward else whole, Kind.W: w}

    programs = schedule.programs(dp=1 if reduce is None else 2)
    played = play(
        programs, lambda a: cost[a.kind][a.stage], comm=comm, reduce=red.__getitem__, collective=collective
    )
    stuck = [f"rank {r} at {programs[r].instructions[t]}" for r, t in played.stuck(programs)]
    if stuck:
        raise ScheduleError(
            f"schedule {schedule.name!r} cannot finish: every rank waits on another ({', '.join(stuck)}); "
            "run pipeline.validate.validate on it for the full report"
        )
    events = [TimedAction(r, a, start, end) for r, a, start, end in played.computes]
    reductions = [TimedReduction(r, s, start, end) for r, s, start, end in played.reductions]
    events.sort(key=lambda e: (e.start, e.rank))
    return Timeline(events, schedule.n_ranks, reductions, ends=played.ends)
