"""Smoke test of scripts/bench_schedules.py: the quick mode runs end to end and its tables are sane.

Timings are not asserted beyond plausibility (performance is read from the bench's output, not tested).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_schedules.py"

TIMED_KEYS = {
    "case", "costs", "ours", "theirs", "ideal_ms", "sim_ms", "ours_ms", "theirs_ms",
    "eff_ours", "eff_theirs", "ours/theirs", "ours/sim", "work_ours_ms", "work_theirs_ms",
    "cpu_ours_ms", "cpu_theirs_ms",
}  # fmt: skip
REAL_KEYS = {
    "case", "ours", "theirs", "single_ms", "single_mb_ms", "speedup_mb_ours", "ours_ms", "theirs_ms",
    "ideal_speedup",
    "speedup_ours", "speedup_theirs", "eff_ours", "eff_theirs", "ours/theirs", "cpu_ours_ms", "cpu_theirs_ms",
}  # fmt: skip


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
