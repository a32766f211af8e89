"""scripts/bench_autoplan.py: the quick mode end to end, and its pieces on hand-made numbers.

Timings are not asserted (performance is read from the bench's output, not tested); what is tested
is that the grid is the one the search considers, that every plan measured for a limit fits it as
predicted, and that the report's arithmetic (step times, finalists, the best, the ratios) is right.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT = SCRIPTS / "bench_autoplan.py"
sys.path.insert(0, str(SCRIPTS))

from bench_autoplan import (  # noqa: E402
    Case,
    Config,
    Measured,
    Result,
    build_row,
    choose_limits,
    collate,
    finalists,
    grid,
    microbatch_counts,
    plan_key,
    rank_peaks,
    recompute_choices,
    smallest_fit,
    step_times,
)

from pipeline.plan import Plan, StagePlan  # noqa: E402
from pipeline.runtime.step.recompute import RECOMPUTE_MODES  # noqa: E402


@pytest.mark.slow
def test_quick_run_measures_every_fitting_plan_and_reports_both_limits(tmp_path: Path) -> None:
    out = tmp_path / "autoplan.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--models", "heavy", "--warmup", "0", "--steps", "1",
         "--final", "2", "--top", "1", "--detail", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for header in ("auto plan", "auto ms", "best ms", "auto/best", "default/auto", "peak/limit", "search s",
                   "pred/grid", "heavy: plan"):  # fmt: skip
        assert header in proc.stdout, f"column {header!r} missing from:\n{proc.stdout}"
    report = json.loads(out.read_text())
    loose, tight = report["rows"]
    assert (loose["limit"], tight["limit"]) == ("loose", "tight") and tight["limit_mb"] < loose["limit_mb"]
    assert 1 <= tight["fit"] < loose["fit"] <= loose["grid"] == tight["grid"]
    assert loose["default_fits"] and not tight["default_fits"]  # the tight limit forces another choice
    plans = {p["plan"]: p for p in report["plans"]["heavy"]}
    for row in (loose, tight):
        case = f"heavy {row['limit']}"
        fitting = [p for p in plans.values() if case in p["fits"]]
        assert len(fitting) == row["fit"]
        for p in fitting:  # predicted to fit on every rank
            assert max(p["predicted_peaks"]) <= row["limit_mb"] * 1e6
        assert row["auto_pred_mb"] <= row["limit_mb"]
        # the search predicts no slower than the fastest grid plan that fits: it searches them all
        assert row["pred_over_grid"] <= 1.0 + 1e-9
        assert row["auto_peak_mb"] is not None  # measured (memory_stats)
        assert row["best"] in {p["plan"] for p in fitting}
        # the best is the fastest finalist of the limit, and the ratios are of the medians shown
        finals = {
            name: _median(p["final_ms"]) for name, p in plans.items() if p["final_ms"] and case in p["fits"]
        }
        assert row["best_ms"] == pytest.approx(min(finals.values()))
        assert row["auto_over_best"] == pytest.approx(row["auto_ms"] / row["best_ms"])
        assert row["default_over_auto"] == pytest.approx(row["default_ms"] / row["auto_ms"])
        assert plans[row["auto"]]["final_ms"] and plans[row["default"]]["final_ms"]
    for p in plans.values():  # every plan screened, each step timed
        assert len(p["screen_ms"]) == report["steps"] and all(t > 0 for t in p["screen_ms"])
        assert len(p["final_ms"]) in (0, report["final"])


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def test_grid_is_every_schedule_microbatch_count_and_recompute_mode_that_can_run() -> None:
    configs = grid(2, 8, 7)  # p = 2, B = 8, n = 7: interleaving with v = 2 or 3 (6 of the 7 layers)
    expected = set()
    schedules = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)]
    schedules += [(name, v) for name in ("interleaved-1f1b", "interleaved-zb") for v in (2, 3)]
    schedules += [(name, 2) for name in ("zb-v", "dualpipe-v", "v-half", "v-min")]  # in a V, any m
    for (name, v), m, mode in itertools.product(schedules, range(1, 9), RECOMPUTE_MODES):
        if 8 % m or (name.startswith("interleaved") and m % 2) or (mode == "except_last" and m == 1):
            continue
        expected.add(Config(name, m, v, mode))
    assert set(configs) == expected and len(configs) == len(expected)
    for c in configs:  # each one is a valid plan shape
        Plan(balance=[1] * (2 * c.v), schedule=c.schedule, n_microbatches=c.m, n_virtual=c.v)
    assert {c.v for c in grid(2, 8, 7, max_virtual=2)} == {1, 2}
    # a model with fewer layers than interleaving's stages: no interleaved configurations
    assert {c.schedule for c in grid(2, 8, 3)} == {"gpipe", "1f1b", "zb-h1"}
    assert microbatch_counts(12) == [1, 2, 3, 4, 6, 12]


def test_per_stage_recompute_adds_every_mixed_tuple_once() -> None:
    assert recompute_choices(2, 4, per_stage=False) == list(RECOMPUTE_MODES)
    mixed = recompute_choices(3, 4, per_stage=True)
    assert len(mixed) == len(set(mixed)) == 3**3
    at_one = recompute_choices(2, 1, per_stage=True)  # except_last at m = 1 is never: left out
    assert set(at_one) == {"never", "always", ("never", "always"), ("always", "never")}


def test_step_time_runs_from_the_earliest_start_to_the_last_end() -> None:
    rank0 = [(0.0, 1.0), (10.0, 10.5)]
    rank1 = [(0.2, 1.5), (9.5, 10.2)]
    assert step_times([rank0, rank1]) == [1.5, 1.0]


def test_finalists_are_auto_default_and_each_limits_fastest() -> None:
    medians = [5.0, 1.0, 3.0, 2.0, 4.0, 0.5]
    groups = [[0, 1, 2, 3], [2, 4, 5]]
    assert finalists(medians, groups, always=[4], top=2) == [1, 2, 3, 4, 5]
    assert finalists(medians, groups, always=[0], top=1) == [0, 1, 5]


def test_smallest_fit_bisects_to_the_threshold() -> None:
    found = smallest_fit(lambda limit: limit >= 3.7, 100.0, rel=1e-4)
    assert 3.7 <= found <= 3.7 * (1 + 1e-3)
    with pytest.raises(ValueError, match="nothing fits"):
        smallest_fit(lambda limit: False, 1.0)


def test_limits_loose_fits_every_plan_and_tight_excludes_the_default() -> None:
    loose, tight = choose_limits([[4.0, 6.0], [3.0, 9.0]], [7.0, 8.0], least=2.0)
    assert loose == pytest.approx(2 * 9.0)
    assert 2.0 < tight < 8.0 and tight == pytest.approx(2.0 + 0.3 * 6.0)


def _plan(balance: list[int], memory: list[float], step: float, **options: object) -> Plan:
    stages = [StagePlan(0, 1, ["x"], 1.0, 1.0, 1.0, mem, 0) for mem in memory]
    return Plan(balance=balance, stages=stages, step_time=step, prediction="simulator", **options)  # type: ignore[arg-type]


def test_rank_peaks_add_the_stages_of_each_rank() -> None:
    plan = _plan([1, 1, 1, 1], [1.0, 2.0, 4.0, 8.0], 1.0, schedule="interleaved-1f1b", n_virtual=2)
    assert rank_peaks(plan) == [5.0, 10.0]  # stage s on rank s % p


def test_row_takes_the_best_among_finalists_and_its_ratios() -> None:
    auto = _plan([2, 3], [3.0, 4.0], 0.010, schedule="zb-h1", n_microbatches=4)
    best = _plan([3, 2], [4.0, 5.0], 0.012, n_microbatches=4)
    lucky = _plan([1, 4], [2.0, 5.0], 0.011, schedule="gpipe", n_microbatches=2)  # screened only
    default = _plan([3, 2], [6.0, 9.0], 0.020)
    case = Case("m", "tight", 8.0, 10, [auto, best, lucky], auto, 0.25, default)
    results = {
        plan_key(auto): Result([0.030], [0.012, 0.011, 0.013], [7e6, 6e6]),
        plan_key(best): Result([0.030], [0.010, 0.010, 0.011], [7.5e6, 5e6]),
        plan_key(lucky): Result([0.001], [], [1e6, 1e6]),  # fastest screen, but not a finalist
        plan_key(default): Result([0.030], [0.022, 0.020, 0.024], [9e6, 9e6]),
    }
    row = build_row(case, results)
    assert row.best == "1f1b m4 rc:n [3,2]" and row.best_ms == pytest.approx(10.0)
    assert row.auto == "zbh1 m4 rc:n [2,3]" and row.auto_ms == pytest.approx(12.0)
    assert row.auto_over_best == pytest.approx(1.2)
    assert row.default_ms == pytest.approx(22.0) and row.default_over_auto == pytest.approx(22 / 12)
    assert not row.default_fits  # rank 1's predicted 9 bytes > the limit of 8
    assert row.auto_peak_mb == pytest.approx(7.0) and row.peak_over_limit == pytest.approx(7e6 / 8.0)
    assert row.auto_pred_mb == pytest.approx(4e-6) and row.fit == 3 and row.grid == 10
    assert row.pred_over_grid == pytest.approx(1.0)  # auto is the fastest predicted of the three
    unmeasured = dict(results, **{plan_key(auto): Result([0.03], [0.012], [7e6, None])})
    assert build_row(case, unmeasured).peak_over_limit is None
    assert row.search_s == 0.25


def test_collate_keeps_each_models_measurements_of_the_same_plan_apart() -> None:
    same = Plan(balance=[2, 1])  # the default of two 3-layer models: one key, two measurements
    other = Plan(balance=[1, 2], recompute="always")

    def ranks(start: float, peak: float) -> tuple[list[Measured], list[Measured]]:
        screen = [Measured([(start, start + 1.0)], peak), Measured([(start, start + 3.0)], peak)]
        final = [Measured([(start, start + 2.0), (start, start + 4.0)], peak + 1), Measured()]
        return screen, final

    per_rank = [[ranks(0.0, 10.0), ranks(100.0, 50.0)], [ranks(0.5, 20.0), ranks(100.5, 60.0)]]
    results = collate({"a": [same, other], "b": [same, other]}, per_rank)
    assert results["a"][plan_key(same)].screen == [1.5] and results["b"][plan_key(same)].screen == [1.5]
    assert results["a"][plan_key(same)].peaks == [11.0, 21.0]  # the larger of both phases, per rank
    assert results["b"][plan_key(same)].peaks == [51.0, 61.0]
    assert results["a"][plan_key(same)].final == [2.5, 4.5]
    assert results["a"][plan_key(other)].screen == [3.5] and results["a"][plan_key(other)].final == []
