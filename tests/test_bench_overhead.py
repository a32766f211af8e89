"""scripts/bench_overhead.py: the quick mode end to end, and its split's arithmetic (scripts/bench/tally.py).

Timings are not asserted beyond plausibility (the figures are read from the bench's output); the split's
exclusive-time accounting is tested on functions of known cost.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT = SCRIPTS / "bench_overhead.py"
sys.path.insert(0, str(SCRIPTS))

from bench.cases import Case, Run  # noqa: E402
from bench.tally import CATEGORIES, RUNTIME, Tally  # noqa: E402
from bench_overhead import _Measured, report  # noqa: E402


@pytest.mark.slow
def test_quick_run_prints_both_tables(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--repeats", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    columns = (
        "ours/rival",
        "q1",
        "q3",
        "repeats",
        "cpu ours",
        "header",
        "meter",
        "clock",
        "post/take",
        "runtime %",
    )
    for column in columns:
        assert column in proc.stdout, f"column {column!r} missing from:\n{proc.stdout}"
    report = json.loads(out.read_text())
    rivals = {(row["case"].split()[1], row["rival"]) for row in report["steps"]}
    assert rivals == {
        ("p=1", "1 proc micro"), ("p=1", "torch 1f1b"), ("p=1", "torch gpipe"),
        ("p=2", "torch 1f1b"), ("p=2", "torch gpipe"), ("p=2", "torch interleaved-1f1b v=2"),
    }  # fmt: skip
    for row in report["steps"]:
        assert row["ours_ms"] > 0 and row["rival_ms"] > 0
        assert row["ratio_q1"] <= row["ratio"] <= row["ratio_q3"] and len(row["repeats"]) == 2
    # per case, per repeat, per run: the 3 steps
    assert all(len(reps) == 2 and all(len(t) == 3 for t in reps[0]) for reps in report["times"].values())
    assert len(report["split"]) == 5  # every run of ours: 1F1B and GPipe at p = 1, three schedules at p = 2
    for row in report["split"]:
        interleaved = "interleaved" in row["ours"]
        assert row["actions"] == 8 * (2 if interleaved else 1)  # F and B of m = 4 per stage held
        assert all(row["us"][c] >= 0 for c in (*RUNTIME, "runtime", "compute", "wait"))
        assert 0 < row["runtime_share"] < 1


class _Clock:
    """A clock that moves only when told: the split's arithmetic without the machine's noise."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_split_counts_each_function_s_own_time_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """An outer function of 3 ms that calls an inner one of 2 ms, twice: 3 ms is the outer's own time, 4 the
    inner's; the wrappers' own cost (here 1 and 2 µs a call, inside and outside the window it times) taken
    off; functions this version lacks are named, not timed."""
    clock = _Clock()
    module = types.ModuleType("fake_runtime")

    class Runtime:
        def inner(self) -> None:
            clock.now += 2e-3

        def outer(self) -> None:
            clock.now += 1.5e-3
            self.inner()
            clock.now += 1.5e-3
            self.inner()

    module.Runtime = Runtime  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_runtime", module)
    original = Runtime.outer
    tally = Tally({"a": ("fake_runtime:Runtime.outer",), "b": ("fake_runtime:Runtime.inner",),
                   "c": ("fake_runtime:Runtime.gone", "nowhere:X.y")}, clock)  # fmt: skip
    assert tally.missing == ["fake_runtime:Runtime.gone", "nowhere:X.y"]
    tally.calibrate(100)
    assert tally.cost_in == tally.cost_out == 0.0  # the clock did not move
    tally.cost_in, tally.cost_out = 1e-6, 2e-6
    for _ in range(3):
        Runtime().outer()
    per_step = tally.per_step(3, ("a", "b", "c"))
    assert per_step["a"] == pytest.approx(3e-3 - 1e-6 - 2 * 2e-6)  # its own call's cost, its 2 calls'
    assert per_step["b"] == pytest.approx(4e-3 - 2 * 1e-6)
    assert per_step["c"] == 0.0 and tally.calls["b"] == 6 and tally.inner_calls["a"] == 6
    tally.reset()
    assert tally.per_step(1, ("a",)) == {"a": 0.0}
    tally.restore()
    assert Runtime.outer is original


def test_the_split_names_functions_the_runtime_has() -> None:
    tally = Tally()
    try:
        # the runtime's own functions, and the backend's posting, all found here
        assert tally.missing == []
        assert set(RUNTIME) < set(CATEGORIES)
    finally:
        tally.restore()


def _rank(spans: list[list[tuple[float, float]]], cpu: float) -> dict[str, _Measured]:
    """One rank's steps per run: (start, end) each, and its CPU seconds."""
    return {"t p=2": _Measured([[(a, b, cpu) for a, b in run] for run in spans])}


def test_the_report_pools_every_repeat_s_paired_steps() -> None:
    case = Case("t p=2", "mlp", 2, 4, runs=(Run("ours", "1f1b"), Run("torch", "1f1b")), rows=((0, 1),))
    # repeat 1: steps of 1.0 and 2.0 s against 2.0 and 2.0 (rank 1 ends last); repeat 2: 3.0 against 2.0
    first = [_rank([[(0, 0.5), (10, 11.5)], [(20, 21), (30, 31)]], 0.1),
             _rank([[(0, 1.0), (10, 12.0)], [(20, 22), (30, 32)]], 0.3)]  # fmt: skip
    second = [_rank([[(0, 3.0)], [(5, 7)]], 0.2), _rank([[(0.5, 2.0)], [(5, 6)]], 0.2)]
    (row,), split = report([case], {2: [first, second]})
    assert split == []
    assert row.repeats == [0.75, 1.5]  # each repeat's median of the paired ratios 0.5, 1.0 | 1.5
    assert row.ratio == 1.0 and row.ours_ms == 2000.0 and row.rival_ms == 2000.0  # pooled medians
    assert row.cpu_ours_ms == pytest.approx(200.0)  # per rank the median over all steps, then the mean
    assert row.spread == "0.750-1.500"
