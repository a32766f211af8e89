"""Checkpoints of replicated pipelines: dp = 2 x 2 stages resumes exactly, with AdamW and with ZeRO-1, and
re-shards to dp = 1 x 4 stages and back (4 ranks either way).

    # d: replica, r: pipeline rank; global rank g = d * p + r

Every step t draws one global batch of 16 rows; replica d of dp trains on its 16 / dp of them, so every
layout computes the same gradients (up to the order of the sums).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from pipeline import checkpointing
from pipeline.plan import Plan
from pipeline.runtime.pipe import Pipeline
from tests.dist import job

N, SAVE, ROWS = 5, 2, 16  # steps, the step saved, global batch rows


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh()) for _ in range(8)])


class Loop:
    """A training loop on ``dp`` replicas of a pipeline of 4 // dp ranks (8 layers split evenly)."""

    def __init__(self, dp: int, zero: bool, seed: int) -> None:
        p = dist.get_world_size() // dp
        self.dp, self.replica = dp, dist.get_rank() // p
        plan = Plan(balance=[8 // p] * p, n_microbatches=2, dp=dp)
        self.pipe = Pipeline(_model(seed), plan, loss_fn=nn.functional.mse_loss, timeout=60.0)
        params = list(self.pipe.parameters())
        groups = [
            {"params": [q for q in params if q.ndim > 1], "weight_decay": 0.1},
            {"params": [q for q in params if q.ndim <= 1], "weight_decay": 0.0},
        ]
        if zero:
            self.opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                groups, torch.optim.AdamW, process_group=self.pipe.dp_group, lr=0.01
            )
        else:
            self.opt = torch.optim.AdamW(groups, lr=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda t: 1.0 / (1 + t))

    def train(self, start: int, stop: int, save: str = "") -> list[float]:
        losses = []
        for t in range(start, stop):
            if save and t == SAVE:
                checkpointing.save(save, t, pipe=self.pipe, optimizer=self.opt, lr_scheduler=self.sched,
                                   extra={"step": t})  # fmt: skip
            g = torch.Generator().manual_seed(t)
            x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 6, generator=g)
            rows = slice(self.replica * ROWS // self.dp, (self.replica + 1) * ROWS // self.dp)
            losses.append(self.pipe.step(x[rows], y[rows]))
            self.opt.step()
            self.opt.zero_grad()
            self.sched.step()
        return losses

    def load(self, folder: str) -> Any:
        return checkpointing.load(folder, pipe=self.pipe, optimizer=self.opt, lr_scheduler=self.sched)


def _run(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dp, zero in ((2, False), (2, True), (1, False)):
        tag = f"dp{dp}{'-zero' if zero else ''}"
        out[tag] = Loop(dp, zero, 0).train(0, N, save=f"{root}/{tag}")
    for saved in ("dp2", "dp2-zero", "dp1"):
        for dp, zero in ((2, False), (2, True), (1, False)):
            loop = Loop(dp, zero, 1)  # other initial values: everything comes from the checkpoint
            extra = loop.load(f"{root}/{saved}")
            out[f"{saved}->dp{dp}{'-zero' if zero else ''}"] = (extra, loop.train(SAVE, N))
    return out


_RUN = job(4, _run, make_args=lambda factory: (str(factory.mktemp("ckptdp")),), timeout=240.0, batch="dp")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _RUN.results(tmp_path_factory)


def test_every_layout_trains_alike(results: list[dict[str, Any]]) -> None:
    for res in results:  # the global mean loss on every rank
        assert res["dp2"] == pytest.approx(res["dp1"], rel=1e-5)
        assert res["dp2-zero"] == pytest.approx(res["dp2"], rel=1e-5)
    assert all(r["dp2"] == results[0]["dp2"] for r in results)


@pytest.mark.parametrize("tag", ["dp2", "dp2-zero", "dp1"])
def test_a_checkpoint_resumes_exactly_in_its_own_layout(results: list[dict[str, Any]], tag: str) -> None:
    for res in results:
        extra, losses = res[f"{tag}->{tag}"]
        assert extra == {"step": SAVE}
        assert losses == res[tag][SAVE:]  # exactly


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [("dp2", "dp1"), ("dp1", "dp2"), ("dp2-zero", "dp1"), ("dp1", "dp2-zero"), ("dp2", "dp2-zero"),
     ("dp2-zero", "dp2")],
)  # fmt: skip
def test_a_checkpoint_resumes_in_another_layout(
    results: list[dict[str, Any]], saved: str, loaded: str
) -> None:
    for res in results:
        _, losses = res[f"{saved}->{loaded}"]
        assert losses == pytest.approx(res[saved][SAVE:], rel=1e-5)  # the other layout's sums
