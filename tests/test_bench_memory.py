"""scripts/bench_memory.py: the predicted peak beside the measured one (a quick run: one model, 2 ranks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_memory


def test_a_quick_run_prints_every_case_within_ten_percent(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_memory.main(["--ranks", "2", "--models", "mlp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith(" 2 mlp")]
    assert len(rows) == len(bench_memory.CASES) == 27  # 9 schedules x 3 recompute modes
    assert all(line.count("/") == 2 for line in rows)  # one cell per rank
    worst = float(lines[-1].removeprefix("largest error: ").removesuffix("%"))
    assert worst < 10.0
