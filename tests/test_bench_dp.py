"""scripts/bench_dp.py: the report's arithmetic on hand-made step times, the timed layer, a tiny run.

Performance is read from the bench's output, never asserted; what is tested is that the share hidden is
computed from the right steps (each step's slowest rank, then the median over steps) against the right
baselines.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT = SCRIPTS / "bench_dp.py"
sys.path.insert(0, str(SCRIPTS))

from bench_dp import RUNS, Config, TimedLayer, _report  # noqa: E402


def _ranks(steps: dict[str, list[list[float]]]) -> list[dict[str, list[float]]]:
    """``steps[name][k]``: the 4 ranks' times of step k -> per rank, per run, its step times."""
    return [{name: [per_step[k][r] for k in range(len(per_step))] for name, per_step in steps.items()}
            for r in range(4)]  # fmt: skip


def test_hidden_is_the_all_reduce_time_the_run_did_not_add_to_its_own_baseline() -> None:
    cfg = Config(steps=3, workload="timed")
    flat = {  # every rank the same: the slowest rank is the time
        "ours dp=1": 1.00, "(a) overlap": 1.02, "(b) after": 1.09,
        "torch dp=1": 1.10, "(c) torch+DDP": 1.15, "all-reduce": 0.10,
    }  # fmt: skip
    out = _report(cfg, _ranks({name: [[t] * 4] * 3 for name, t in flat.items()}))
    assert out["hidden"]["(a) overlap"] == pytest.approx(0.8)  # 20 ms of 100 shown
    assert out["hidden"]["(b) after"] == pytest.approx(0.1)
    assert out["hidden"]["(c) torch+DDP"] == pytest.approx(0.5)  # against torch's own dp=1, not ours
    assert set(out["steps_s"]) == set(RUNS)


def test_a_step_is_its_slowest_rank_and_the_median_takes_out_one_bad_step() -> None:
    cfg = Config(steps=3)
    steps = {name: [[1.0, 1.0, 1.0, 1.0]] * 3 for name in RUNS}
    steps["all-reduce"] = [[0.1, 0.1, 0.1, 0.1]] * 3
    # one late rank per step: the step waits for it; one step 1 s late: the median ignores it
    steps["(a) overlap"] = [[1.0, 1.03, 1.0, 1.0], [1.0, 1.0, 1.0, 1.03], [1.0, 2.0, 1.0, 1.0]]
    out = _report(cfg, _ranks(steps))
    assert out["steps_s"]["(a) overlap"] == [1.03, 1.03, 2.0]
    assert out["step_s"]["(a) overlap"] == pytest.approx(1.03)
    assert out["hidden"]["(a) overlap"] == pytest.approx(0.7)


def test_a_subset_of_methods_runs_with_its_own_baselines_and_reports_only_those() -> None:
    assert Config(methods="c").runs == ("torch dp=1", "(c) torch+DDP", "all-reduce")
    assert Config(methods="ab").runs == ("ours dp=1", "(a) overlap", "(b) after", "all-reduce")
    cfg = Config(steps=2, methods="c")
    flat = {"torch dp=1": 1.0, "(c) torch+DDP": 1.05, "all-reduce": 0.1}
    out = _report(cfg, _ranks({name: [[t] * 4] * 2 for name, t in flat.items()}))
    assert out["hidden"] == {"(c) torch+DDP": pytest.approx(0.5)}
    assert set(out["step_s"]) == set(flat)


def test_the_timed_layer_has_a_linears_parameters_and_gives_them_a_gradient() -> None:
    layer = TimedLayer(8, 0.0, 0.0)
    assert layer.weight.numel() == sum(p.numel() for p in torch.nn.Linear(8, 8).parameters())
    x = torch.randn(3, 16, requires_grad=True)
    out = layer(x)
    assert torch.equal(out, x)
    out.sum().backward()
    out = layer(x)
    out.sum().backward()
    g = layer.weight.grad
    assert g is not None and g.shape == layer.weight.shape and not g.any()
    # the backward hands out the same zeros every time: autograd must have copied them, or an in-place
    # all-reduce of .grad would write into the next step's gradients
    assert g.data_ptr() != layer.grad_w.data_ptr()
    g.add_(1.0)
    assert not layer.grad_w.any()
    assert x.grad is not None and torch.equal(x.grad, 2 * torch.ones_like(x))


@pytest.mark.slow
def test_a_tiny_run_prints_every_run_and_writes_the_numbers(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    args = ["--workload", "timed", "--width", "64", "--layers", "4", "--fwd-ms", "1", "--bwd-ms", "2",
            "--steps", "2", "--warmup", "1", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in RUNS:
        assert name in proc.stdout, f"{name!r} missing from:\n{proc.stdout}"
    report = json.loads(out.read_text())
    assert set(report["step_s"]) == set(RUNS) and all(t > 0 for t in report["step_s"].values())
    assert all(len(times) == 2 for times in report["steps_s"].values())
    assert set(report["hidden"]) == {"(a) overlap", "(b) after", "(c) torch+DDP"}
