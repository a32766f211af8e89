"""``partition`` on every rank of a process group: rank 0 plans, every rank gets byte-identical plans."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from partitioner import partition, profile
from tests.dist import free_port, run_ranks

ROOT = Path(__file__).resolve().parent.parent


def _model() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)]
    return nn.Sequential(*layers), torch.randn(4, 32)


def _noisy_plan() -> str:
    model, sample = _model()
    figures = profile(model, sample, warmup=0, repeat=1)
    # a different profile on every rank, as measured times are: rank r's layer r runs 50x slower
    slow = dist.get_rank()
    layers = list(figures.layers)
    layers[slow] = dataclasses.replace(layers[slow], forward_time=50 * layers[slow].forward_time + 1.0)
    skewed = dataclasses.replace(figures, layers=layers)
    return partition(model, 2, sample, profile=skewed).to_json()


def _failing_plan() -> str:
    model, sample = _model()
    try:  # only rank 0's arguments are bad: every rank must still raise, naming rank 0's error
        partition(model, 2, sample, schedule="2f2b" if dist.get_rank() == 0 else "1f1b")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_every_rank_gets_rank_0s_plan(tmp_path: Path) -> None:
    plans = run_ranks(tmp_path, _noisy_plan, 2)
    assert plans[0] == plans[1]
    assert '"balance": [\n    1,' in plans[0]  # rank 0's skew (its layer 0 is slow) decided it


def test_an_error_on_rank_0_is_raised_on_every_rank(tmp_path: Path) -> None:
    errors = run_ranks(tmp_path, _failing_plan, 2)
    assert "unknown schedule '2f2b'" in errors[0]
    assert errors[1].startswith("partition failed on rank 0, which plans for every rank: ValueError: unknown")


_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from partitioner import partition
from pipeline import init_distributed
info = init_distributed("gloo")
torch.manual_seed(info.rank)  # different weights, and so different timings, on every rank
layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(12)]
plan = partition(torch.nn.Sequential(*layers), 2, torch.randn(8, 64))
open({out!r} + str(info.rank), "w").write(plan.to_json())
"""


def test_byte_identical_plans_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "plan.py"
    out = str(tmp_path / "plan.json.")
    script.write_text(textwrap.dedent(_SCRIPT.format(root=str(ROOT), out=out)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(out + "0").read_bytes() == Path(out + "1").read_bytes()
