"""scripts/profile_balance.py: the comparison table for each built-in model, --stages as ranks,
--measure running the plan itself, bad flags answered with the library's message and the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.plan import Plan
from scripts import profile_balance


@pytest.mark.parametrize("model", ["gpt", "resnet", "mlp"])
def test_prints_the_three_plans_for_each_built_in(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert profile_balance.main(["--model", model, "--stages", "2", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "per-layer profile" in out
    for label in ("== ours (exact)", "== equal layer counts", "== torchgpipe balance_by_time"):
        assert label in out
    assert "(1.000x ours)" in out  # our own row against itself


def test_stages_counts_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    argv = ["--model", "mlp", "--stages", "2", "--schedule", "interleaved-1f1b", "--json", str(path)]
    assert profile_balance.main(argv) == 0
    plan = Plan.from_json(path.read_text())
    assert (plan.n_ranks, plan.n_virtual, plan.n_stages, plan.n_microbatches) == (2, 2, 4, 2)
    out = capsys.readouterr().out
    assert out.count("[interleaved-1f1b, m=2, v=2, recompute never]") == 3  # ours and both baselines
    assert "balance [2, 2, 2, 2]" in out  # equal counts over the 4 stages of 2 ranks


def test_measure_runs_the_plan_and_saves_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    argv = ["--model", "mlp", "--stages", "2", "--microbatches", "2", "--measure", "--measure-steps", "1"]
    assert profile_balance.main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "== measured:" in out and "predicted busy ms" in out
    assert "ran [1f1b, m=2, v=1]" in out and "NOT the plan's" not in out  # the pipeline ran the plan
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len([r for r in rows if len(r) == 5]) == 2  # one line per rank with its measured busy time
    assert json.loads(path.read_text())["balance"] and "step time: predicted" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--stages", "0"],
            "n_ranks (0) must be an integer >= 1: the pipeline's ranks (devices) (--stages sets",
        ),
        (
            ["--model", "mlp", "--stages", "9"],
            "n_ranks (9) x n_virtual (1) is 9 stages but the model has 8 layers",
        ),
        (
            ["--model", "mlp", "--stages", "3", "--schedule", "interleaved-1f1b", "--microbatches", "4"],
            "n_microbatches (4) must be a multiple of the number of ranks (3)",
        ),
        (["--schedule", "gpipe", "--virtual", "2"], "n_virtual (2) must be 1 for 'gpipe'"),
        (["--model", "mlp", "--stages", "2", "--recompute", "sometimes"], "'sometimes'"),
        (["--cost", "bogus"], "invalid choice: 'bogus'"),
        (["--model", "nowhere"], "neither a built-in"),
        (
            ["--microbatches", "0"],
            "n_microbatches (0) must be an integer >= 1 (--microbatches sets n_microbatches)",
        ),
        (["--measure-steps", "0"], "--measure-steps (0) must be >= 1"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        profile_balance.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
