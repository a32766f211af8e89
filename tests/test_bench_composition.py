"""scripts/bench_composition.py: the quick run's collective counts and losses, the report's arithmetic.

Timings are never asserted (performance is read from the bench's output); what is tested is that under
ZeRO-2 each FSDP unit of a stage is all-gathered and reduce-scattered once per step (not once per
micro-batch), that both stacks compute the same loss and gradients, and that the report takes each
step's slowest rank and the median over steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from bench_composition import QUICK, RUNS, Config, _report, main


@pytest.mark.slow  # an end-to-end script run; tests/test_composition.py covers the library
def test_the_quick_run_gathers_each_unit_once_per_step_and_both_stacks_agree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = main(["--quick"])  # 4 gloo ranks: pp=2 x dp_shard=2, 1F1B, m=4
    printed = capsys.readouterr().out
    assert "ours/torch" in printed and "after RS ms" in printed, printed
    assert QUICK.m > 1  # else "once per step" and "once per micro-batch" would be the same count
    for name in RUNS:
        for row in out["stages"][name]:
            # ours: the stage is one FSDP unit under ZeRO-2; torch (torchtitan): one per Linear layer
            assert row["units"] == (1 if name == "ours" else QUICK.layers // 2), (name, row)
            assert row["ag"] == row["units"] and row["ag_per_unit"] == 1.0, (name, row)
            assert row["rs"] == row["units"] and row["rs_per_unit"] == 1.0, (name, row)
    ours, theirs = out["stages"]["ours"], out["stages"]["torch"]
    assert [r["ag_mb"] for r in ours] == [r["ag_mb"] for r in theirs]  # the same bytes gathered
    assert out["loss_rel_diff"] < 1e-5, out["loss"]
    assert out["grad_norm_rel_diff"] < 1e-5, out["grad_norm"]


def _tally(rs_end: float) -> dict[str, float]:
    return {"ag": 2, "rs": 2, "ag_numel": 1e6, "rs_numel": 5e5, "ag_s": 0.01, "rs_s": 0.02,
            "rs_end": rs_end, "async": 0}  # fmt: skip


def _rank(rank: int, times: dict[str, list[float]], rs_end: float) -> dict[str, Any]:
    """One rank's record: step k of run ``name`` lasted ``times[name][k]`` and ended at 10 + k + it."""
    steps = {name: [{"s": t, "end": 10 + k + t, "tally": _tally(10 + k + rs_end), "units": 2, "loss": 1.0,
                     "grad_norm": 0.5} for k, t in enumerate(ts)] for name, ts in times.items()}  # fmt: skip
    return {"rank": rank, "stage": rank % 2, "steps": steps, "rs_alone": 0.004}


def test_a_step_is_its_slowest_rank_and_the_ratio_is_the_median_of_the_steps_ratios() -> None:
    cfg = Config(steps=3)
    fast = {"ours": [1.0, 1.0, 1.0], "torch": [2.0, 2.0, 2.0]}
    slow = {"ours": [1.2, 1.0, 5.0], "torch": [2.0, 2.0, 2.0]}  # one late rank per step; one bad step
    per_rank = [_rank(0, fast, 0.9), _rank(1, fast, 0.5), _rank(2, slow, 0.9), _rank(3, fast, 0.5)]
    out = _report(cfg, per_rank, "python scripts/bench_composition.py")
    assert out["steps_s"]["ours"] == [1.2, 1.0, 5.0]
    assert out["ratio"] == pytest.approx(0.6)  # median of 0.6, 0.5, 2.5
    s0, s1 = out["stages"]["ours"]
    assert s0["ag_per_unit"] == 1.0 and s0["rs_ms"] == pytest.approx(20.0)
    assert s0["rs_share"] == pytest.approx(0.02 / 1.2)
    # after RS: the step's end (its last rank's) minus the stage's last reduce-scatter end
    assert s1["after_rs_ms"] == pytest.approx((1.2 - 0.5) * 1e3)
    assert s0["after_rs_ms"] == pytest.approx((1.2 - 0.9) * 1e3)
    assert out["loss_rel_diff"] == 0.0
