"""scripts/profile_balance.py: the comparison table for each built-in model, --measure, bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import profile_balance


@pytest.mark.parametrize("model", ["gpt", "resnet", "mlp"])
def test_prints_the_three_plans_for_each_built_in(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert profile_balance.main(["--model", model, "--stages", "2", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "per-layer profile" in out
    for label in ("== ours (exact)", "== equal layer counts", "== torchgpipe balance_by_time"):
        assert label in out
    assert "(1.000x ours)" in out  # our own row against itself


def test_measure_runs_the_plan_and_saves_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    argv = ["--model", "mlp", "--stages", "2", "--microbatches", "2", "--measure", "--measure-steps", "1"]
    assert profile_balance.main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "== measured:" in out and "predicted busy ms" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len([r for r in rows if len(r) == 5]) == 2  # one line per rank with its measured busy time
    assert json.loads(path.read_text())["balance"] and "step time: predicted" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "0"], "--stages (0) must be >= 1"),
        (["--model", "mlp", "--stages", "9"], "must be at most the model's 8 layers"),
        (["--cost", "bogus"], "invalid choice: 'bogus'"),
        (["--model", "nowhere"], "neither a built-in"),
        (["--microbatches", "0"], "--microbatches (0) must be >= 1"),
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
