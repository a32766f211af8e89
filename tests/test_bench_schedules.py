"""scripts/bench_schedules.py: the quick mode end to end, and its pieces (scripts/bench/) on known numbers.

Timings are not asserted beyond plausibility (performance is read from the bench's output, not tested);
the report's arithmetic is tested on hand-made measurements.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT = SCRIPTS / "bench_schedules.py"
sys.path.insert(0, str(SCRIPTS))

from bench.cases import Case, Run, all_cases  # noqa: E402
from bench.report import REAL_COLUMNS, TIMED_COLUMNS, build_report, step_times, table  # noqa: E402
from bench.results import Calibration, CaseResult, RankResult, RealRow, RunResult, Slept, TimedRow  # noqa: E402

from pipeline.schedules.schedule import schedule  # noqa: E402
from pipeline.schedules.simulate import simulate  # noqa: E402

TIMED_KEYS = {f.name for f in fields(TimedRow)}
REAL_KEYS = {f.name for f in fields(RealRow)}


@pytest.mark.slow
def test_quick_run_prints_both_tables_with_plausible_efficiencies(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    headers = ("ideal", "sim", "ours ms", "theirs ms", "eff ours", "ours/theirs", "ours/sim", "ours/ideal")
    for header in headers:
        assert header in proc.stdout, f"column {header!r} missing from:\n{proc.stdout}"

    report = json.loads(out.read_text())
    timed, real = report["timed"], report["real"]
    schedules = {row["ours"].split()[1] for row in timed}
    assert schedules == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}
    assert {row["theirs"] for row in timed} >= {"torch interleaved-zb", "torch interleaved-zb v=2"}
    assert {row["case"].split()[0] for row in real} == {"mlp", "gpt"}
    for row in timed:
        assert set(row) == TIMED_KEYS
        # sleeps only overshoot and the runtimes add overhead: nobody beats the ideal by 20%
        for key in ("eff_ours", "eff_theirs"):
            assert 0 < row[key] <= 1.2, (key, row)
        # the simulator with the measured costs predicts at least the ideal
        assert row["sim_ms"] >= row["ideal_ms"] * 0.999, row
        # both runtimes slept the same work per rank
        assert abs(row["work_ours_ms"] - row["work_theirs_ms"]) < 1e-3, row
    for row in real:
        assert set(row) == REAL_KEYS
        assert row["ideal_speedup"] == 2 * 4 / (4 + 1)
        for key in ("eff_ours", "eff_theirs"):
            assert 0 < row[key] <= 1.2, (key, row)
    assert not [n for n in report["notes"] if "loss differs" in n], report["notes"]
    # the raw measurements travel too: every rank of every rank count, every case
    assert {len(ranks) for ranks in report["results"].values()} == {2}
    assert set(report["results"]["2"][0]["cases"]) == {c.key for c in all_cases(True)}


@pytest.mark.parametrize("quick", [True, False])
def test_ideal_is_the_simulated_step_without_overhead(quick: bool) -> None:
    """The closed forms in Case.ideal agree with the simulator on nominal costs and zero latency."""
    checked = 0
    for case in all_cases(quick):
        for run in case.runs:
            if not case.timed or run.impl != "ours":
                continue
            sched = schedule(run.schedule, case.p, case.m, n_virtual=run.v)
            f, b, w = case.layer_costs(run.v)
            backward = [0.0 if s == 0 and not case.input_grad else b for s in range(sched.n_stages)]
            makespan = simulate(sched, f, backward, w).makespan
            assert case.ideal(run) == pytest.approx(makespan, rel=1e-9), (case.key, run)
            checked += 1
    assert checked == (4 if quick else 8)


def _rank(rank: int, key: str, spans: list[list[tuple[float, float]]], slept: list[float],
          losses: list[float | None]) -> RankResult:  # fmt: skip
    cal = Calibration(latency=0.0, sleep={0.001: 0.001, 0.002: 0.002})
    runs = [
        RunResult(s, cpu=0.5, nominal=Slept(F=w), loss=loss)
        for s, w, loss in zip(spans, slept, losses, strict=True)
    ]
    return RankResult(rank, 2, {key: CaseResult(runs, cal, cal)})


def test_report_times_a_step_from_the_first_start_to_the_last_end() -> None:
    case = Case("t", "timed", 2, 2, (1e-3, 2e-3, 0.0), runs=(Run("ours", "1f1b"), Run("torch", "1f1b")),
                rows=((0, 1),))  # fmt: skip
    # two steps; rank 1 starts later and ends later than rank 0
    r0 = _rank(0, "t", [[(0.0, 1.0), (10.0, 10.5)], [(0.0, 2.0), (10.0, 12.0)]], [2.0, 2.0], [None, None])
    r1 = _rank(1, "t", [[(0.5, 1.5), (10.2, 11.0)], [(0.1, 2.0), (10.0, 16.0)]], [2.0, 3.0], [1.0, 1.0])
    assert step_times([r0, r1], "t", 0) == [1.5, 1.0]
    assert step_times([r0, r1], "t", 1) == [2.0, 6.0]
    report = build_report([case], {2: [r0, r1]}, steps=2)
    (row,) = report.timed
    assert row.ours_ms == pytest.approx(1250.0) and row.theirs_ms == pytest.approx(4000.0)  # medians
    assert row.ours_over_theirs == pytest.approx(1.25 / 4.0)
    assert row.ideal_ms == pytest.approx((2 + 2 - 1) * 3.0)
    assert row.eff_ours == pytest.approx(3e-3 * 3 / 1.25)
    assert row.cpu_ours_ms == pytest.approx(250.0)  # 0.5 s over 2 steps, mean over ranks
    assert row.work_ours_ms == pytest.approx(1000.0) and row.work_theirs_ms == pytest.approx(1500.0)
    assert report.notes == [
        "t: slept work per rank differs: ours 1f1b 1000.0 ms, torch 1f1b 1500.0 ms per step"
    ]


def test_report_speedups_and_a_loss_mismatch_on_real_compute() -> None:
    runs = (Run("single", "batch"), Run("single", "micro"), Run("ours", "1f1b"), Run("torch", "1f1b"))
    case = Case("mlp", "mlp", 2, 4, runs=runs, rows=((2, 3),))
    spans = [[(0.0, 8.0)], [(0.0, 10.0)], [(0.0, 4.0)], [(0.0, 5.0)]]
    r0 = _rank(0, "mlp", spans, [0.0] * 4, [None] * 4)
    r1 = _rank(1, "mlp", spans, [0.0] * 4, [None, None, 2.0, 2.1])  # the last rank knows the losses
    report = build_report([case], {2: [r0, r1]}, steps=1)
    (row,) = report.real
    assert row.ideal_speedup == pytest.approx(8 / 5)
    assert (row.speedup_ours, row.speedup_theirs, row.speedup_mb_ours) == pytest.approx((2.0, 1.6, 2.5))
    assert row.eff_ours == pytest.approx(2.0 / 1.6)
    assert report.notes == ["mlp: loss differs: ours 1f1b 2.0, torch 1f1b 2.1"]


def test_table_aligns_columns_and_shows_missing_values_as_a_dash() -> None:
    row = TimedRow(
        case="c p=2 m=2", ours="ours 1f1b", theirs="torch 1f1b", ours_ms=1.0, theirs_ms=2.0,
        ours_over_theirs=0.5, cpu_ours_ms=0.1, cpu_theirs_ms=0.2, costs="1/2/0", ideal_ms=1.0,
        sim_ms=None, eff_ours=1.0, eff_theirs=0.5, ours_over_sim=None, work_ours_ms=3.0,  # type: ignore[arg-type]
        work_theirs_ms=3.0,
    )  # fmt: skip
    lines = table([row], TIMED_COLUMNS).splitlines()
    assert len(lines) == 3 and set(lines[1]) == {"-", " "}
    header, cells = lines[0].split(), lines[2].split()
    assert header[:2] == ["case", "F/B/W"] and "ours/sim" in lines[0]
    assert cells[cells.index("1.0") + 1] == "-"  # ideal, then sim missing
    starts = [lines[0].index(h) for h, _, _ in TIMED_COLUMNS[1:3]]
    assert [lines[2].index(v) for v in ("1/2/0", "ours 1f1b")] == starts
    assert {a for _, a, _ in REAL_COLUMNS} <= REAL_KEYS and {a for _, a, _ in TIMED_COLUMNS} <= TIMED_KEYS


def test_v_greedy_sets_ours_beside_the_greedy_order() -> None:
    """``--v-greedy``'s rows: every m from 1 to 4p + 3, each bubble the step less 2m (F + B + W); p = 3,
    m = 4 by hand: the greedy order 2, 6, 10 units at F = B = W, F = 2B = 2W, F = B = 2W, ours 2, 4, 6."""
    from bench_schedules import GREEDY_COSTS, v_greedy

    rows = v_greedy((2, 3))
    assert [(r["p"], r["m"]) for r in rows] == [(p, m) for p in (2, 3) for m in range(1, 4 * p + 4)]
    for r in rows:
        for f, b, w in GREEDY_COSTS:
            assert r[f"ours {f:g}/{b:g}/{w:g}"] <= r[f"greedy {f:g}/{b:g}/{w:g}"], r
        assert r["ours peak"] <= r["1f1b peak"] == 2 * min(r["p"], r["m"]), r
    row = next(r for r in rows if (r["p"], r["m"]) == (3, 4))
    assert [row[f"{who} {c}"] for who in ("greedy", "ours") for c in ("1/1/1", "2/1/1", "2/2/1")] == [
        2,
        6,
        10,
        2,
        4,
        6,
    ]
