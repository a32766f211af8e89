"""``--trace DIR``: one recorded step of ours per run as a Chrome trace, and where its time went.

    # p: ranks, s: stage

For a timed case the trace shows the measured step next to the simulated one
(measured sleeps and latency), and a summary line says, per rank, how long a
compute action lasted beyond its sleep (runtime overhead plus sleep overshoot),
how long the rank was blocked on receives, and the step's span.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from bench.cases import Case, Run
from bench.report import simulated
from bench.results import RankResult
from pipeline.schedules.actions import Kind, parse_action
from pipeline.schedules.timeline import TimedAction, Timeline
from pipeline.schedules.trace import write_chrome_trace

__all__ = ["Overheads", "overheads", "write_traces"]

_RankEvent = tuple[int, str, float, float]  # (rank, action, start, end)


@dataclass(frozen=True)
class Overheads:
    """Per rank, for one recorded step."""

    over_us: list[float]  # median compute action beyond its sleep
    recv_ms: list[float]  # time blocked on receives
    span_ms: list[float]  # first start to last end


def overheads(case: Case, run: Run, events: list[_RankEvent]) -> Overheads:
    """Where one recorded step of ours went, per rank: compute actions' time beyond their sleeps
    (a receive overlapping an action is waiting, not computing) and time blocked on receives."""
    nominal = dict(zip("FBW", case.layer_costs(run.v), strict=True))
    if run.schedule != "zb-h1":
        nominal["B"] += nominal["W"]  # an unsplit backward runs both parts
    out = Overheads([], [], [])
    for r in range(case.p):
        mine = [e for e in events if e[0] == r]
        recvs = [(a, b) for _, name, a, b in mine if "RECV" in name]
        over = []
        for _, name, a, b in mine:
            act = parse_action(name)
            if not act.kind.is_compute:
                continue
            waited = sum(min(b, rb) - max(a, ra) for ra, rb in recvs if ra < b and rb > a)
            free = act.stage == 0 and act.kind is Kind.B and not case.input_grad
            cost = 0.0 if free else nominal[act.kind.value]
            over.append(b - a - waited - cost)
        out.over_us.append(statistics.median(over) * 1e6)
        out.recv_ms.append(sum(b - a for a, b in recvs) * 1e3)
        out.span_ms.append((max(e[3] for e in mine) - min(e[2] for e in mine)) * 1e3)
    return out


def write_traces(cases: list[Case], results: dict[int, list[RankResult]], folder: str) -> list[str]:
    """Chrome traces of ours, measured next to simulated (measured costs); one summary line per run."""
    os.makedirs(folder, exist_ok=True)
    lines = []
    for case in cases:
        per_rank = results[case.p]
        for j, run in enumerate(case.runs):
            traces = [res.cases[case.key].runs[j].trace for res in per_rank]
            if traces[0] is None:
                continue
            events = [(r, *e) for r, trace in enumerate(traces) for e in trace or []]
            t0 = min(e[2] for e in events)
            measured = Timeline(
                [TimedAction(r, parse_action(a), b - t0, c - t0) for r, a, b, c in events], case.p
            )
            path = os.path.join(folder, f"{case.key}-{run.name}.json")
            if not case.timed:
                write_chrome_trace(path, measured, names=["measured"])
                continue
            sim = simulated(case, run, per_rank)
            write_chrome_trace(path, sim, measured, names=["simulated", "measured"])
            o = overheads(case, run, events)
            lines.append(
                f"{case.key}-{run.name}: per rank, median compute action beyond its sleep "
                f"{' '.join(f'{v:.0f}' for v in o.over_us)} us; blocked on receives "
                f"{' '.join(f'{v:.1f}' for v in o.recv_ms)} ms; span "
                f"{' '.join(f'{v:.1f}' for v in o.span_ms)} ms "
                f"(simulated {sim.makespan * 1e3:.1f})"
            )
    return lines
