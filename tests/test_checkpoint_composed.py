"""Checkpoints of composed pipelines (FSDP2 shards, tensor parallelism) load exactly at any (pp, shard, tp).

    # pp: ranks per pipeline, shard: FSDP parts ("dp_shard"), tp: tensor-parallel ranks, dp: replicas

Every layout runs on 4 ranks. A chain of layouts passes one training state along: the first trains
and saves; each next one builds the model from other initial values, loads the last checkpoint,
checks it holds exactly the first state (parameters, buffers, AdamW's state, each compared whole:
``DTensor.full_tensor()``, and the LambdaLR's), laid out as its parameters (a sharded parameter's
state is a DTensor of the same placements, so training goes on), trains on from there as the first
did (two steps: the scheduler's own count matters at the second), having first saved what it
loaded, for the next::

    chain "shard":  (pp=2, shard=2) -> (pp=4) -> (pp=1, dp=2, shard=2: HSDP) -> (pp=2, shard=2, ZeRO-3)
    chain "tp":     (pp=2, shard=2) -> (pp=2, tp=2) -> (pp=1, shard=2, tp=2) -> (pp=4) -> (pp=2, tp=2)

``gather_state_dict`` of every layout is the whole state, on pipeline rank 0 of each replica's
first (shard 0, tp 0) pipeline only.

The model: blocks of Linear(6, 12) - ReLU - Linear(12, 6), split column-wise then row-wise over
"tp" by ``_parallelize`` (the Megatron pair), each followed by a ``Shift`` (a parameter and a
random persistent buffer), and a head Linear(6, 3), whose 3 rows shard unevenly over 2 ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from pipeline import checkpointing
from pipeline.plan import Plan
from pipeline.runtime.pipe import Pipeline
from tests.dist import job

W, ROWS, N, SAVE = 6, 16, 4, 2  # width, global batch rows, steps, the step saved

Layout = tuple[int, int, int, int, int]  # (pp, dp, shard, tp, zero)


def model(seed: int) -> nn.Sequential:
    """8 layers: 4 MLP blocks, 3 Shifts, a head."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for k in range(4):
        layers.append(nn.Sequential(nn.Linear(W, 2 * W), nn.ReLU(), nn.Linear(2 * W, W)))
        if k < 3:
            layers.append(Shift())
    layers.append(nn.Linear(W, 3))
    return nn.Sequential(*layers)


class Shift(nn.Module):
    """x * weight + shift: a parameter and a persistent buffer (random, never trained)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(W))
        self.register_buffer("shift", torch.randn(W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.shift


def _parallelize(stage: nn.Module, tp_mesh: Any) -> None:
    """Each MLP block's first Linear column-wise, its second row-wise."""
    plan: dict[str, Any] = {}
    for name, mod in stage.named_modules():
        if isinstance(mod, nn.Sequential) and len(mod) == 3 and isinstance(mod[0], nn.Linear):
            plan[f"{name}.0"], plan[f"{name}.2"] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(stage, tp_mesh, plan)


def _whole(t: Any) -> Any:
    """A copy of ``t``, whole (a replicated DTensor's full tensor is its live local one: copied too)."""
    if isinstance(t, DTensor):
        return t.full_tensor().clone()
    return t.clone() if isinstance(t, torch.Tensor) else t


class Loop:
    def __init__(self, layout: Layout, seed: int) -> None:
        pp, dp, shard, tp, zero = layout
        plan = Plan(balance=[8 // pp] * pp, n_microbatches=2, dp=dp, shard=shard, tp=tp, zero=zero)
        self.pipe = Pipeline(
            model(seed), plan, loss_fn=nn.functional.mse_loss, timeout=60.0,
            parallelize_fn=_parallelize if tp > 1 else None,
        )  # fmt: skip
        params = list(self.pipe.parameters())
        groups = [
            {"params": [q for q in params if q.ndim > 1], "weight_decay": 0.1},
            {"params": [q for q in params if q.ndim <= 1], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda t: 1.0 / (1 + t))

    def train(self, start: int, stop: int) -> list[float]:
        losses = []
        data, n = self.pipe.replica, self.pipe.dp  # the rows of this (replica, shard) cell
        for t in range(start, stop):
            g = torch.Generator().manual_seed(t)
            x, y = torch.randn(ROWS, W, generator=g), torch.randn(ROWS, 3, generator=g)
            rows = slice(data * ROWS // n, (data + 1) * ROWS // n)
            losses.append(self.pipe.step(x[rows], y[rows]))
            self.opt.step()
            self.opt.zero_grad()
            self.sched.step()
        return losses

    def state(self) -> dict[str, Any]:
        """This rank's parameters, buffers and optimizer state, whole; every collective in the same
        order on every rank of a shard / tp group (they hold the same stages)."""
        out: dict[str, Any] = {}
        for name, p in self.pipe.named_parameters():
            out[name] = _whole(p.detach())
            for key, value in self.opt.state.get(p, {}).items():
                out[f"{name}/{key}"] = _whole(value)
        for name, b in self.pipe.named_buffers():
            out[name] = _whole(b)
        return out

    def laid_out_as_params(self) -> list[str]:
        """Each optimizer state tensor of a parameter's shape that is not laid out as the parameter."""
        bad = []
        for name, p in self.pipe.named_parameters():
            for key, value in self.opt.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(p.shape):
                    continue
                if isinstance(p, DTensor) != isinstance(value, DTensor) or (
                    isinstance(p, DTensor)
                    and isinstance(value, DTensor)
                    and (p.placements != value.placements or p.device_mesh != value.device_mesh)
                ):
                    bad.append(f"{name}/{key}")
        return bad

    def save(self, folder: str, step: int) -> None:
        checkpointing.save(folder, step, pipe=self.pipe, optimizer=self.opt, lr_scheduler=self.sched,
                           extra={"step": step})  # fmt: skip

    def load(self, folder: str) -> Any:
        return checkpointing.load(folder, pipe=self.pipe, optimizer=self.opt, lr_scheduler=self.sched)


def _chain(root: str, layouts: list[Layout]) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": dist.get_rank()}
    first = Loop(layouts[0], 0)
    first.train(0, SAVE)
    first.save(f"{root}/0", SAVE)
    out["saved"] = first.state()
    out["scheduler/0"] = (first.sched.last_epoch, first.sched.get_last_lr())
    out["gathered/0"] = first.pipe.gather_state_dict()
    out["losses/0"] = first.train(SAVE, N)
    first.pipe.close()
    for i, layout in enumerate(layouts[1:], 1):
        loop = Loop(layout, i)  # other initial values: all of it must come from the checkpoint
        before = loop.state()
        out[f"extra/{i}"] = loop.load(f"{root}/{i - 1}")
        out[f"loaded/{i}"] = loop.state()
        out[f"changed/{i}"] = sorted(k for k, v in before.items() if not _same(v, out[f"loaded/{i}"].get(k)))
        out[f"layout/{i}"] = loop.laid_out_as_params()
        out[f"scheduler/{i}"] = (loop.sched.last_epoch, loop.sched.get_last_lr())
        out[f"gathered/{i}"] = loop.pipe.gather_state_dict()
        loop.save(f"{root}/{i}", SAVE)  # what it loaded, for the next layout
        out[f"losses/{i}"] = loop.train(SAVE, N)
        loop.pipe.close()
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)


SHARD: list[Layout] = [(2, 1, 2, 1, 2), (4, 1, 1, 1, 2), (1, 2, 2, 1, 2), (2, 1, 2, 1, 3)]
TP: list[Layout] = [(2, 1, 2, 1, 2), (2, 1, 1, 2, 2), (1, 1, 2, 2, 2), (4, 1, 1, 1, 2), (2, 1, 1, 2, 2)]
CHAINS = {"shard": SHARD, "tp": TP}


def _chain_job(name: str, chain: list[Layout]) -> Any:
    def make_args(factory: pytest.TempPathFactory) -> tuple[str, list[Layout]]:
        return str(factory.mktemp("ckcomp")), chain

    return job(4, _chain, make_args=make_args, timeout=120.0, batch="composition")


_JOBS = {name: _chain_job(name, chain) for name, chain in CHAINS.items()}


@pytest.fixture(scope="module", params=sorted(CHAINS))
def chain(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Any]]:
    return request.param, _JOBS[request.param].results(tmp_path_factory)


def _union(results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The entries of every rank's ``key``, each the same wherever two ranks hold it."""
    merged: dict[str, Any] = {}
    for res in results:
        for name, value in res[key].items():
            if name in merged:
                assert _same(merged[name], value), f"{key}: ranks hold different {name}"
            merged[name] = value
    return merged


def test_every_layout_loads_the_saved_state_exactly(chain: tuple[str, list[dict[str, Any]]]) -> None:
    name, results = chain
    saved = _union(results, "saved")
    assert any(k.endswith("/exp_avg_sq") for k in saved) and any(k.endswith(".shift") for k in saved)
    assert sum(k.endswith("/exp_avg") for k in saved) == sum("/" not in k and "shift" not in k for k in saved)
    for i, layout in enumerate(CHAINS[name][1:], 1):
        loaded = _union(results, f"loaded/{i}")
        assert sorted(loaded) == sorted(saved), layout
        differ = [k for k in saved if not _same(saved[k], loaded[k])]
        assert not differ, f"{layout} loaded {differ[:5]} other than saved"
        for res in results:
            assert res[f"extra/{i}"] == {"step": SAVE}
            assert res[f"scheduler/{i}"] == res["scheduler/0"], layout
            # every parameter and buffer of the fresh model took a value from the checkpoint
            kept = [k for k in res[f"loaded/{i}"] if "/" not in k and k not in res[f"changed/{i}"]]
            assert kept == [], f"{layout} kept its own {kept[:5]}"


def test_a_sharded_parameters_state_is_laid_out_as_the_parameter(
    chain: tuple[str, list[dict[str, Any]]],
) -> None:
    name, results = chain
    for i, layout in enumerate(CHAINS[name][1:], 1):
        for res in results:
            assert res[f"layout/{i}"] == [], f"{layout} rank {res['rank']}"


def test_every_layout_trains_on_as_the_first(chain: tuple[str, list[dict[str, Any]]]) -> None:
    name, results = chain
    for res in results:
        for i in range(1, len(CHAINS[name])):
            assert res[f"losses/{i}"] == pytest.approx(res["losses/0"], rel=1e-5), CHAINS[name][i]


def test_gather_state_dict_is_whole_on_each_replicas_first_pipeline(
    chain: tuple[str, list[dict[str, Any]]],
) -> None:
    name, results = chain
    saved = _union(results, "saved")
    whole = {k: v for k, v in saved.items() if "/" not in k}
    for i, layout in enumerate(CHAINS[name]):
        pp, dp, shard, tp, _ = layout
        got = [res for res in results if res[f"gathered/{i}"] is not None]
        # global rank ((d * shard + h) * pp + r) * tp + t: pipeline rank 0 of (d, h=0, t=0)
        assert [res["rank"] for res in got] == [d * shard * pp * tp for d in range(dp)], layout
        for res in got:
            state = res[f"gathered/{i}"]
            assert sorted(state) == sorted(whole), layout
            for k, v in state.items():
                assert type(v) is torch.Tensor and _same(v, whole[k]), (layout, k)
