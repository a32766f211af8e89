"""``load_pretrained`` into sharded (FSDP2) and split (tensor-parallel) stages reads each rank's slices only.

    # pp: ranks per pipeline, shard: FSDP parts, tp: tensor-parallel ranks

A safetensors file of the whole model (``test_checkpoint_composed.model``) is loaded into pipelines
built from other values at (pp=2, shard=2), (pp=2, tp=2) and (pp=1, shard=2, tp=2). Every rank
counts the tensor bytes it reads (``pretrained``'s ``open``, wrapped: the header reads apart):
exactly the bytes of its local shards, where reading its stages whole would be more. The values,
made whole (``full_tensor()``), are the file's exactly.
"""

from __future__ import annotations

import builtins
import functools
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipeline.plan import Plan
from pipeline.runtime.inputs import pretrained
from pipeline.runtime.pipe import Pipeline
from tests.dist import job
from tests.test_checkpoint_composed import Layout, _parallelize, _whole, model

LAYOUTS: list[Layout] = [(2, 1, 2, 1, 2), (2, 1, 1, 2, 2), (1, 1, 2, 2, 2)]


class _Counted:
    """A file whose ``readinto`` (the tensor reads; headers use ``read``) counts its bytes."""

    def __init__(self, f: Any, counter: list[int]) -> None:
        self.f, self.counter = f, counter

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def readinto(self, buffer: Any) -> int:
        got: int = self.f.readinto(buffer)
        self.counter[0] += got
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


def _opened(*args: Any, counter: list[int], **kwargs: Any) -> _Counted:
    return _Counted(builtins.open(*args, **kwargs), counter)


def _load(path: str) -> list[dict[str, Any]]:
    out = []
    for layout in LAYOUTS:
        pp, dp, shard, tp, zero = layout
        plan = Plan(balance=[8 // pp] * pp, n_microbatches=2, dp=dp, shard=shard, tp=tp, zero=zero)
        pipe = Pipeline(
            model(1), plan, loss_fn=nn.functional.mse_loss, timeout=60.0,
            parallelize_fn=_parallelize if tp > 1 else None,
        )  # fmt: skip
        tensors = {**dict(pipe.named_parameters()), **dict(pipe.named_buffers())}
        local = sum(
            (t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors.values()
        )  # what this rank holds
        whole = sum(t.numel() * t.element_size() for t in tensors.values())  # its stages whole
        counter = [0]
        opened = functools.partial(_opened, counter=counter)
        with mock.patch.object(pretrained, "open", opened, create=True):
            pipe.load_pretrained(path)
        state = {n: _whole(t.detach()) for n, t in tensors.items()}
        dtensors = sum(isinstance(t, DTensor) for t in tensors.values())
        out.append(
            {"rank": dist.get_rank(), "read": counter[0], "local": local, "whole": whole, "state": state,
             "dtensors": dtensors}
        )  # fmt: skip
        pipe.close()
    return out


def _file(factory: pytest.TempPathFactory) -> tuple[str]:
    from safetensors.torch import save_file

    path = factory.mktemp("pretrained-composed") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model(0).state_dict().items()}, str(path))
    return (str(path),)


_LOAD = job(4, _load, make_args=_file, timeout=120.0, batch="composition")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    return _LOAD.results(tmp_path_factory)


@pytest.mark.parametrize("k", range(len(LAYOUTS)), ids=[str(layout) for layout in LAYOUTS])
def test_every_rank_reads_its_slices_only(results: list[list[dict[str, Any]]], k: int) -> None:
    for rank in results:
        got = rank[k]
        assert got["dtensors"] > 0
        assert got["read"] == got["local"], (
            f"rank {got['rank']} read {got['read']} bytes, holds {got['local']}"
        )
        assert got["read"] < got["whole"]


@pytest.mark.parametrize("k", range(len(LAYOUTS)), ids=[str(layout) for layout in LAYOUTS])
def test_the_loaded_values_are_the_files(results: list[list[dict[str, Any]]], k: int) -> None:
    want = model(0).state_dict()
    seen: set[str] = set()
    for rank in results:
        for name, value in rank[k]["state"].items():
            assert torch.equal(value, want[name]), (LAYOUTS[k], rank[k]["rank"], name)
            seen.add(name)
    assert seen == set(want)
