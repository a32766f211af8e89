"""The compute stream is the caller's current stream at each step, not the one current at construction.

A user who steps under ``torch.cuda.stream(s)`` runs the stages on s; receives and input copies
must then be ordered onto s. Under the NCCL emulation a transfer becomes visible only once ordered
onto the stream compute runs on, so ordering the construction-time stream reads poison.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pipeline.plan import Plan
from pipeline.runtime.comm import emulation
from pipeline.runtime.pipe import Pipeline
from tests.dist import run_ranks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def _rank() -> list[float]:
    model = _model()
    pipe = Pipeline(
        model, Plan(balance=[2, 3], schedule="1f1b", n_microbatches=2), loss_fn=_loss, timeout=30.0
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    with emulation.use(emulation.EmuStream("user")):  # as torch.cuda.stream(s) around the step
        loss = pipe.step(x, y)
    return [loss, *(float(p.grad.abs().sum()) for p in pipe.parameters() if p.grad is not None)]


def test_a_step_under_another_current_stream_orders_that_stream(tmp_path: Path) -> None:
    model = _model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    _loss(model(x), y).backward()
    ranks = run_ranks(tmp_path, _rank, 2, backend="nccl-emulated")
    expected = _loss(model(x), y).item()
    for values in ranks:
        assert all(v == v for v in values), "poison (NaN) read: a receive was ordered onto the wrong stream"
        assert abs(values[0] - expected) <= 1e-6 * abs(expected)
