"""Checkpoints of a ZeRO-1 optimizer (torch's ZeroRedundancyOptimizer): each rank saves its shard, and
the checkpoint resumes exactly into ZeRO or a plain optimizer, and the reverse.

Two data-parallel ranks, each a whole model (``pipe`` may be an nn.Module), gradients averaged by hand:
what a Pipeline with dp = 2 and one stage does, without the pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.optim import ZeroRedundancyOptimizer

from pipeline import checkpointing
from tests.dist import job

N, SAVE = 5, 3  # steps, the step saved


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 3))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return [
        {"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0, "lr": 0.02},
    ]


def _optimizer(model: nn.Module, zero: bool) -> torch.optim.Optimizer:
    if zero:
        return ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW, lr=0.01)
    return torch.optim.AdamW(_groups(model), lr=0.01)


def _step(model: nn.Module, opt: torch.optim.Optimizer, t: int) -> None:
    g = torch.Generator().manual_seed(10 * t + dist.get_rank())  # each replica its own batch
    model(torch.randn(8, 6, generator=g)).square().mean().backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    if t == 1:  # a changed learning rate must come back from the checkpoint
        opt.param_groups[0]["lr"] = 0.005
    opt.step()
    opt.zero_grad()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for zero in (True, False):
        model = _model(0)
        opt = _optimizer(model, zero)
        for t in range(N):
            if t == SAVE:
                checkpointing.save(f"{root}/{'zero' if zero else 'plain'}", t, pipe=model, optimizer=opt)
            _step(model, opt, t)
        out[f"straight/{zero}"] = _params(model)
    for saved in (True, False):
        for zero in (True, False):  # resume into the other kind of optimizer too
            model = _model(1)  # other initial values: all must come from the checkpoint
            opt = _optimizer(model, zero)
            checkpointing.load(f"{root}/{'zero' if saved else 'plain'}", pipe=model, optimizer=opt)
            lrs = [g["lr"] for g in opt.param_groups]
            local = (
                [g["lr"] for g in opt.optim.param_groups] if isinstance(opt, ZeroRedundancyOptimizer) else lrs
            )
            for t in range(SAVE, N):
                _step(model, opt, t)
            out[f"resumed/{saved}/{zero}"] = (_params(model), lrs, local)
    return out


_RUN = job(2, _run, make_args=lambda factory: (str(factory.mktemp("zero")),), timeout=90.0, batch="b")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _RUN.results(tmp_path_factory)


@pytest.fixture(scope="module")
def folder(results: list[dict[str, Any]]) -> Path:
    return Path(_RUN.args[0])  # where the job that made the results saved


def test_zero_and_plain_optimizers_train_alike(results: list[dict[str, Any]]) -> None:
    for res in results:
        for k, v in res["straight/True"].items():
            assert torch.allclose(v, res["straight/False"][k], rtol=1e-6, atol=1e-7), k


@pytest.mark.parametrize("saved", [True, False], ids=["saved-zero", "saved-plain"])
@pytest.mark.parametrize("zero", [True, False], ids=["into-zero", "into-plain"])
def test_a_checkpoint_resumes_exactly_into_zero_or_plain(
    results: list[dict[str, Any]], saved: bool, zero: bool
) -> None:
    for res in results:
        params, lrs, local = res[f"resumed/{saved}/{zero}"]
        assert lrs == [0.005, 0.02] and local == lrs  # the changed lr, in ZeRO's local optimizer too
        want = res[f"straight/{saved}"]
        for k, v in params.items():
            assert torch.equal(v, want[k]), (k, float((v - want[k]).abs().max()))


def test_each_zero_rank_saves_only_its_shard(folder: Path, results: list[dict[str, Any]]) -> None:
    path = checkpointing.latest(folder / "zero")
    assert path is not None
    meta = FileSystemReader(str(path)).read_metadata()
    writer: dict[str, set[str]] = {}  # parameter -> the files (one per rank) holding its optimizer state
    for index, info in meta.storage_data.items():
        if index.fqn.startswith("optim/"):
            writer.setdefault(index.fqn.split("/")[1], set()).add(info.relative_path.split("_")[2])
    assert set(writer) == set(results[0]["straight/True"])  # every parameter's state
    assert all(len(ranks) == 1 for ranks in writer.values())  # by one rank: its owner
    assert set().union(*writer.values()) == {"0", "1"}  # both ranks own a shard
