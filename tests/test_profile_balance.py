"""scripts/profile_balance.py: the comparison table for each built-in model, --stages as ranks,
--measure running the plan itself where the profile ran, precision, links and limits passed to the
library, torchgpipe optional, bad flags answered with the library's message and the flag."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.plan import Plan
from pipeline.reference.models import mlp
from scripts import profile_balance

FAST = ["--repeat", "1"]
SMALL = "tests.test_profile_balance:small_mlp"  # --model as module:function, quick in bf16 on CPU


def small_mlp() -> tuple[object, object]:
    return mlp(width=64, depth=6, batch_size=8)


@pytest.mark.parametrize("model", ["gpt", "resnet", "mlp"])
def test_prints_the_three_plans_for_each_built_in(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert profile_balance.main(["--model", model, "--stages", "2", "--microbatches", "2", *FAST]) == 0
    out = capsys.readouterr().out
    assert "per-layer profile" in out
    for label in ("== ours (exact)", "== equal layer counts", "== torchgpipe balance_by_time"):
        assert label in out
    assert "(1.000x ours)" in out  # our own row against itself


def test_stages_counts_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    argv = ["--model", "mlp", "--stages", "2", "--schedule", "interleaved-1f1b", "--json", str(path), *FAST]
    assert profile_balance.main(argv) == 0
    plan = Plan.from_json(path.read_text())
    assert (plan.n_ranks, plan.n_virtual, plan.n_stages, plan.n_microbatches) == (2, 2, 4, 2)
    out = capsys.readouterr().out
    assert out.count("[interleaved-1f1b, m=2, v=2, recompute never]") == 3  # ours and both baselines
    assert "balance [2, 2, 2, 2]" in out  # equal counts over the 4 stages of 2 ranks


def test_measure_runs_the_plan_and_saves_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    argv = ["--model", SMALL, "--stages", "2", "--microbatches", "2", "--measure", "--measure-steps", "1"]
    assert profile_balance.main([*argv, "--json", str(path), *FAST]) == 0
    out = capsys.readouterr().out
    assert "== measured:" in out and "predicted busy ms" in out
    # where it ran, said as it is: the profile was on CPU, so gloo processes with one thread each
    assert "2 processes on gloo (cpu, 1 thread(s) per rank), fp32, ran [1f1b, m=2, v=1]" in out
    assert "NOT the plan's" not in out  # the pipeline ran the plan
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
        (["--repeat", "0"], "--repeat (0) must be >= 1"),
        (["--dtype", "fp64"], "invalid choice: 'fp64'"),
        (["--memory-limit", "lots"], "--memory-limit 'lots' must be a number or comma-separated numbers"),
        (
            ["--model", "mlp", "--stages", "2", "--bandwidth", "1e9,1e9", *FAST],
            "bandwidth has 2 entries but 2 ranks with n_virtual=1 have 1 links",
        ),
        (
            ["--model", "mlp", "--stages", "2", "--latency", "-1", *FAST],
            "latency[0] is -1.0; each must be a finite number of seconds per message >= 0",
        ),
        (
            ["--model", "mlp", "--stages", "2", "--memory-limit", "1", *FAST],
            # below the static bytes: refused before any schedule is built, naming their floor
            "memory_limit (1) is too small: no split into 2 stages fits even the weights, gradients, "
            "optimizer state and buffers alone, before any activation: they need a limit of at least",
        ),
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "mlp", "--stages", "2", "--recompute", "sometimes"],
            "unknown recompute mode 'sometimes'",
        ),
        (["--model", "mlp", "--stages", "9"], "n_ranks (9) x n_virtual (1) is 9 stages but the model has 8"),
    ],
)
def test_a_bad_recompute_mode_or_stage_count_fails_before_the_profile(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def slow(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled before the flags were checked")

    monkeypatch.setattr(profile_balance, "profile", slow)
    with pytest.raises(SystemExit) as info:
        profile_balance.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_precision_links_and_limits_reach_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    argv = ["--model", SMALL, "--stages", "2", "--dtype", "bf16", "--bandwidth", "1e8", "--latency", "1e-4"]
    assert profile_balance.main([*argv, "--memory-limit", "1e7,2e7", "--json", str(path), *FAST]) == 0
    out = capsys.readouterr().out
    assert "per-layer profile on cpu, autocast bfloat16" in out and "bfloat16" in out.split("== ours")[0]
    plan = Plan.from_json(path.read_text())
    assert (plan.autocast, plan.loss_profiled) == ("bfloat16", True)  # the loss --measure trains with
    assert len(plan.rank_peaks) == plan.n_ranks  # each rank's peak, the schedule walked
    sent = plan.stages[0].sent_bytes
    assert sent > 0 and plan.stages[1].forward_time > 1e-4 + sent / 1e8  # the receiver pays too


def test_torchgpipe_is_optional(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torchgpipe", None)  # import torchgpipe now raises ImportError
    monkeypatch.setitem(sys.modules, "torchgpipe.balance", None)
    assert profile_balance.main(["--model", "mlp", "--stages", "2", *FAST]) == 0
    out = capsys.readouterr().out
    assert (
        "== torchgpipe balance_by_time\nskipped: torchgpipe is not installed (pip install torchgpipe)" in out
    )
    assert "== equal layer counts" in out


def test_an_empty_baseline_stage_is_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(profile_balance, "torchgpipe_balance", lambda costs, k: [0, *([1] * (k - 2)), 9])
    assert profile_balance.main(["--model", SMALL, "--stages", "2", *FAST]) == 0
    out = capsys.readouterr().out
    assert "balance [0, 9] leaves a stage empty: no pipeline can run it" in out


def test_bandwidth_measured_by_ping_pong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    argv = ["--model", SMALL, "--stages", "2", "--bandwidth", "measure", "--json", str(path), *FAST]
    assert profile_balance.main(argv) == 0
    out = capsys.readouterr().out
    assert "measured links on gloo (ping-pong): latency " in out and " GB/s" in out
    plan = Plan.from_json(path.read_text())
    first = plan.stages[0]
    assert first.forward_time > 0 and first.sent_bytes > 0


@pytest.mark.parametrize("threads", [None, 2])
def test_threads_reach_the_profile(threads: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """--threads times each layer with that many intra-op threads (default 1, a launched rank's)."""
    import torch

    seen: list[int] = []
    profiled = profile_balance.profile

    def recorded(*args: object, **kwargs: object) -> object:
        seen.append(kwargs["threads"])  # type: ignore[arg-type]
        return profiled(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(profile_balance, "profile", recorded)
    before = torch.get_num_threads()
    flag = [] if threads is None else ["--threads", str(threads)]
    assert profile_balance.main(["--model", SMALL, "--stages", "2", *flag, *FAST]) == 0
    assert seen == [1 if threads is None else threads]
    assert torch.get_num_threads() == before  # the caller's own count is left alone
