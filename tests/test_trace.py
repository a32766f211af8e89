from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.schedules.actions import parse_action
from pipeline.schedules.schedule import schedule
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import TimedAction, Timeline
from pipeline.schedules.trace import chrome_trace, render_grid, write_chrome_trace


def test_grid_1f1b() -> None:
    # p = 2, m = 2, F = 1, B = 2: makespan 9; width 18 gives two cells per second.
    text = render_grid(simulate(schedule("1f1b", 2, 2), 1, 2), width=18)
    head, rank0, rank1 = text.splitlines()
    assert head == "makespan 9 s, bubble 33.3%, one cell = 0.5 s, '.' idle"
    assert rank0 == "rank 0 |F0F1....B0  ..B1  |"
    assert rank1 == "rank 1 |..F0B0  F1B1  ....|"
    # one cell per second: a forward has room for its kind only
    assert (
        render_grid(simulate(schedule("1f1b", 2, 2), 1, 2), width=9).splitlines()[1] == "rank 0 |FF..B0.B1|"
    )


def test_grid_width_and_stage_labels() -> None:
    timeline = simulate(schedule("interleaved-1f1b", 2, 2, n_virtual=2), 1, 1)
    text = render_grid(timeline, width=200)
    rows = text.splitlines()[1:]
    assert all(len(row) == len("rank 0 |") + 200 + 1 for row in rows)
    assert "2F0" in rows[0] and "3B1" in rows[1]  # ranks with several stages show the stage
    narrow = render_grid(timeline, width=5).splitlines()[1]
    assert len(narrow) == len("rank 0 |") + 5 + 1
    with pytest.raises(ValueError, match=r"width \(0\) must be >= 1"):
        render_grid(timeline, width=0)


def test_grid_marks_communication() -> None:
    t = Timeline(
        [
            TimedAction(0, parse_action("0F0"), 0, 1),
            TimedAction(0, parse_action("0SEND_F0"), 1, 2),
            TimedAction(1, parse_action("1RECV_F0"), 0, 2),
        ],
        n_ranks=2,
    )
    rows = render_grid(t, width=4).splitlines()
    assert "'~' communication only" in rows[0]
    assert rows[1:] == ["rank 0 |F0~~|", "rank 1 |~~~~|"]


def test_chrome_trace_structure() -> None:
    timeline = simulate(schedule("zb-h1", 2, 2), 1e-3, 1e-3, 1e-3)
    trace = chrome_trace(timeline, name="simulated", pid=3)
    events = trace["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {
        (e["name"], e.get("tid"), e["args"].get("name"))
        for e in meta
        if e["name"] != "process_sort_index" and e["name"] != "thread_sort_index"
    } == {("process_name", 0, "simulated"), ("thread_name", 0, "rank 0"), ("thread_name", 1, "rank 1")}
    assert len(spans) == len(timeline.events) == 12
    assert all(e["pid"] == 3 for e in events)
    first = next(e for e in spans if e["name"] == "1B0")
    timed = next(e for e in timeline.events if str(e.action) == "1B0")
    assert first["tid"] == 1 and first["args"] == {"stage": 1, "kind": "B", "microbatch": 0}
    assert first["ts"] == pytest.approx(timed.start * 1e6) and first["dur"] == pytest.approx(1000.0)
    json.dumps(trace)  # serialisable


def test_chrome_trace_starts_at_zero() -> None:
    t = Timeline([TimedAction(0, parse_action("0F0"), 100.0, 100.5)], n_ranks=1)
    span = next(e for e in chrome_trace(t)["traceEvents"] if e["ph"] == "X")
    assert (span["ts"], span["dur"]) == (0.0, 500000.0)


def test_write_side_by_side(tmp_path: Path) -> None:
    sim = simulate(schedule("1f1b", 2, 2), 1, 2)
    other = simulate(schedule("gpipe", 2, 2), 1, 2)
    path = tmp_path / "x.trace.json"
    write_chrome_trace(path, sim, other, names=["simulated", "measured"])
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "simulated", 1: "measured"}
    assert sum(e["ph"] == "X" for e in events) == 16
    write_chrome_trace(path, sim)
    assert json.loads(path.read_text())["traceEvents"][0]["args"]["name"] == "timeline 0"
    with pytest.raises(ValueError, match="got 1 names for 2 timelines"):
        write_chrome_trace(path, sim, other, names=["one"])
    with pytest.raises(ValueError, match="at least one timeline"):
        write_chrome_trace(path)
