"""scripts/bench_compile.py: the report's arithmetic on hand-made times, and a tiny run (slow).

Performance is read from the bench's output, never asserted; what is tested is that a step is its
slowest rank, the ratio is the median of the rounds' ratios and compile time the first steps'
difference, and that a run prints both runs with the compiled run's errors against eager.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT = SCRIPTS / "bench_compile.py"
sys.path.insert(0, str(SCRIPTS))

from bench_compile import RUNS, Config, _report  # noqa: E402


def _rank(eager: list[float], compiled: list[float], first: tuple[float, float]) -> dict[str, object]:
    return {
        "zb-h1": {
            "first_s": {"eager": first[0], "compiled": first[1]},
            "steps_s": {"eager": eager, "compiled": compiled},
            "kinds_s": {
                name: [{"F": 0.1, "B": 0.2, "W": 0.3 if name == "eager" else 0.01}] * len(eager)
                for name in RUNS
            },
            "loss": (2.0, 2.0 + 2e-7),
            "grad_rel_err": 3e-7,
            "frames": 4,
        }
    }


def test_a_step_is_its_slowest_rank_and_the_ratio_the_median_of_the_rounds() -> None:
    cfg = Config(schedules=("zb-h1",), steps=3)
    # rank 1 is late in round 0; round 2 runs under a load spike that hits both runs alike
    ranks = [
        _rank([1.0, 1.0, 3.0], [0.8, 0.8, 2.4], (1.0, 31.0)),
        _rank([1.2, 1.0, 3.0], [0.8, 0.9, 2.4], (1.1, 30.0)),
    ]
    out = _report(cfg, ranks)["schedules"]["zb-h1"]
    assert out["step_s"] == {"eager": pytest.approx(1.2), "compiled": pytest.approx(0.9)}
    assert out["ratios"] == pytest.approx([0.8 / 1.2, 0.9, 0.8])
    assert out["ratio"] == pytest.approx(0.8)
    assert out["compile_s"] == pytest.approx(31.0 - 1.1)  # first steps: the slowest rank of each
    assert out["loss_rel_err"] == pytest.approx(1e-7) and out["grad_rel_err"] == pytest.approx(3e-7)
    assert out["frames"] == 8  # both ranks'
    assert out["kinds_s"]["compiled"] == {
        "F": pytest.approx(0.2),
        "B": pytest.approx(0.4),
        "W": pytest.approx(0.02),
    }


@pytest.mark.slow
def test_a_quick_run_prints_both_runs_equal_to_eager(tmp_path: Path) -> None:
    out = tmp_path / "compile.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in RUNS:
        assert f"zb-h1     {name}" in proc.stdout, proc.stdout
    report = json.loads(out.read_text())["schedules"]["zb-h1"]
    assert report["loss_rel_err"] < 1e-5 and report["grad_rel_err"] < 1e-5
    assert report["frames"] > 0 and report["compile_s"] > 0
    assert all(t > 0 for t in report["step_s"].values())
