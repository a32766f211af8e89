"""Render a ``Timeline``: a text grid (rank x time) and Chrome trace JSON (Perfetto, chrome://tracing).

    # r: rank

The grid gives every rank a row of ``width`` cells, each covering makespan / width
seconds.  A compute action fills its cells with its label (``F3``; ``2F3`` when a
rank runs several stages), idle cells are ``.``, and cells where a rank only
communicates are ``~``::

    rank 0 |F0 F1 F2 F3 ......B0    F4 B1    ...
    rank 1 |.. F0 F1 F2 ....B0    F3 B1    ...

Simulated and measured timelines share this format, so ``write_chrome_trace`` can
put them side by side in one file, one process per timeline and one thread per rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from pipeline.schedules.timeline import TimedAction, Timeline

__all__ = ["chrome_trace", "render_grid", "write_chrome_trace"]


def _label(e: TimedAction, multi_stage: bool) -> str:
    a = e.action
    return f"{a.stage}{a.kind.value}{a.microbatch}" if multi_stage else f"{a.kind.value}{a.microbatch}"


def render_grid(timeline: Timeline, *, width: int = 100) -> str:
    """The timeline as text: one row per rank, ``width`` cells across the makespan."""
    if width < 1:
        raise ValueError(f"width ({width}) must be >= 1 character")
    span = timeline.makespan
    t0 = min((e.start for e in timeline.events), default=0.0)
    stages: dict[int, set[int]] = {}
    for e in timeline.events:
        stages.setdefault(e.rank, set()).add(e.action.stage)
    multi_stage = any(len(s) > 1 for s in stages.values())
    rows = [["."] * width for _ in range(timeline.n_ranks)]

    def cells(e: TimedAction) -> range:
        if span <= 0:
            return range(0)
        lo = round((e.start - t0) / span * width)
        hi = round((e.end - t0) / span * width)
        return range(lo, max(hi, lo + 1) if e.end > e.start else hi)

    for e in timeline.events:  # communication first, so compute draws over it
        if not e.action.kind.is_compute:
            for c in cells(e):
                if c < width and rows[e.rank][c] == ".":
                    rows[e.rank][c] = "~"
    for e in sorted((e for e in timeline.events if e.action.kind.is_compute), key=lambda e: e.start):
        span_cells = [c for c in cells(e) if c < width]
        # Longest text that fits: "2F3 ", "2F3", "F3 ", "F3", "F" (a trailing space separates neighbours).
        labels = [_label(e, multi_stage), _label(e, False), e.action.kind.value]
        fits = [t for label in labels for t in (label + " ", label) if len(t) <= len(span_cells)]
        text = fits[0] if fits else ""
        for n, c in enumerate(span_cells):
            rows[e.rank][c] = text[n] if n < len(text) else " "
    unit = span / width if width else 0.0
    comm = any(not e.action.kind.is_compute for e in timeline.events)
    head = (
        f"makespan {span:.6g} s, bubble {timeline.bubble_fraction:.1%}, "
        f"one cell = {unit:.3g} s, '.' idle" + (", '~' communication only" if comm else "")
    )
    lines = [head] + [f"rank {r} |{''.join(row)}|" for r, row in enumerate(rows)]
    return "\n".join(lines)


def chrome_trace(timeline: Timeline, *, name: str = "pipeline", pid: int = 0) -> dict[str, Any]:
    """Chrome trace events for ``timeline``: process ``pid`` named ``name``, one thread per rank.

    Times are microseconds from the timeline's first start, so timelines recorded on
    different clocks line up at zero.
    """
    t0 = min((e.start for e in timeline.events), default=0.0)
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    for r in range(timeline.n_ranks):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r, "args": {"name": f"rank {r}"}})
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": r, "args": {"sort_index": r}}
        )
    for e in timeline.events:
        a = e.action
        events.append(
            {
                "ph": "X",
                "name": str(a),
                "cat": "compute" if a.kind.is_compute else "comm",
                "ts": (e.start - t0) * 1e6,
                "dur": (e.end - e.start) * 1e6,
                "pid": pid,
                "tid": e.rank,
                "args": {"stage": a.stage, "kind": a.kind.value, "microbatch": a.microbatch},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    path: str | os.PathLike[str], *timelines: Timeline, names: Sequence[str] | None = None
) -> None:
    """Write ``timelines`` to one JSON file, side by side as processes 0, 1, ...

    Example: ``write_chrome_trace("runs/1f1b.trace.json", sim, real, names=["simulated", "measured"])``.
    """
    if not timelines:
        raise ValueError("write_chrome_trace needs at least one timeline")
    if names is None:
        names = [f"timeline {n}" for n in range(len(timelines))]
    if len(names) != len(timelines):
        raise ValueError(f"got {len(names)} names for {len(timelines)} timelines; pass one name per timeline")
    events: list[dict[str, Any]] = []
    for pid, (tl, name) in enumerate(zip(timelines, names, strict=True)):
        events += chrome_trace(tl, name=name, pid=pid)["traceEvents"]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
