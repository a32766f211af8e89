"""Simulate a schedule with given costs: when every action starts and ends.

    # p: ranks, s: stage, i: micro-batch, r: rank

Each rank runs its compute actions in order.  An action starts when its rank is
free and its dependencies are done, plus ``comm`` for a dependency that ran on
another rank:

    F (s, i)  after  F (s-1, i)
    B (s, i)  after  F (s, i)  and  B (s+1, i)     (B: input gradient, or the whole backward)
    W (s, i)  after  B (s, i)

The result is a ``Timeline`` (timeline.py), the same type the executor records when it
measures a real run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.schedule import Schedule
from pipeline.schedules.timeline import TimedAction, Timeline
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


def _deps(sched: Schedule, a: Action) -> list[Action]:
    s, i = a.stage, a.microbatch
    if a.kind is Kind.F:
        return [Action(s - 1, Kind.F, i)] if s > 0 else []
    if a.kind is Kind.B:
        return [Action(s, Kind.F, i)] + ([Action(s + 1, Kind.B, i)] if s < sched.n_stages - 1 else [])
    return [Action(s, Kind.B, i)]


def simulate(
    schedule: Schedule, forward: Cost, backward: Cost, weight: Cost = 0.0, comm: float = 0.0
) -> Timeline:
    """Timeline of ``schedule`` with per-action costs in seconds.

    ``backward`` is the input-gradient part and ``weight`` the weight-gradient part;
    a schedule that does not split them runs B for ``backward + weight``.  ``comm`` is
    the latency added to every dependency that crosses ranks.
    """
    n = schedule.n_stages
    f, b, w = (
        _per_stage(k, c, n) for k, c in (("forward", forward), ("backward", backward), ("weight", weight))
    )
    if isinstance(comm, bool) or not isinstance(comm, int | float) or not math.isfinite(comm) or comm < 0:
        raise ValueError(f"comm ({comm!r}) must be a finite latency in seconds >= 0")
    whole = [x + y for x, y in zip(b, w, strict=True)]
    cost = {Kind.F: f, Kind.B: b if schedule.split_backward else whole, Kind.W: w}

    end: dict[Action, float] = {}
    free = [0.0] * schedule.n_ranks
    pos = [0] * schedule.n_ranks
    events: list[TimedAction] = []
    remaining = sum(len(actions) for actions in schedule.compute)
    while remaining:
        progressed = False
        for r, actions in enumerate(schedule.compute):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                deps = _deps(schedule, a)
                if any(d not in end for d in deps):
                    break
                ready = [end[d] + (comm if schedule.rank_of(d.stage) != r else 0.0) for d in deps]
                start = max([free[r], *ready])
                end[a] = free[r] = start + cost[a.kind][a.stage]
                events.append(TimedAction(r, a, start, end[a]))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"rank {r} at {acts[pos[r]]}" for r, acts in enumerate(schedule.compute) if pos[r] < len(acts)
            )
            raise ScheduleError(
                f"schedule {schedule.name!r} cannot finish: every rank waits on a dependency ({stuck}); "
                "run pipeline.validate.validate on it for the full report"
            )
    events.sort(key=lambda e: (e.start, e.rank))
    return Timeline(events, schedule.n_ranks)
