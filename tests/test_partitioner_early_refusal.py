"""``partition`` refuses a memory limit below the model's own parameters before it profiles anything."""

from __future__ import annotations

import sys
import time

import pytest
import torch
from torch import nn

from partitioner import partition

partition_module = sys.modules["partitioner.partition"]  # the module (the package exports the function)


def _model() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # 8 x 257 KiB = 2.1 MB of fp32


def _no_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was profiled before the limit was checked")

    monkeypatch.setattr(partition_module, "_profiled", refuse)


@pytest.mark.parametrize("schedule", ["1f1b", "auto"])
def test_a_limit_below_the_weights_is_refused_before_any_profiling(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_profiling(monkeypatch)
    start = time.process_time()
    with pytest.raises(
        ValueError, match=r"too small for every configuration: the weights alone are 2\.105e\+06 bytes"
    ) as info:
        partition(_model(), 2, torch.randn(4, 256), schedule=schedule, memory_limit=0.5e6)
    assert "raise memory_limit, use more ranks" in str(info.value) and "before profiling" in str(info.value)
    assert time.process_time() - start < 0.5


def test_shards_and_tp_count_in_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_profiling(monkeypatch)
    with pytest.raises(ValueError, match=r"at most divided by shard x tp = 4"):  # 2 x 0.2 MB x 4 < 2.1 MB
        partition(_model(), 2, torch.randn(4, 256), shard=2, tp=2, memory_limit=0.2e6)
    with pytest.raises(ValueError, match=r"at most divided by shard x tp = 2"):  # world 4 / 2 ranks
        partition(_model(), 2, torch.randn(4, 256), schedule="auto", world_size=4, shard="auto",
                  memory_limit=0.4e6)  # fmt: skip


def test_a_limit_that_could_hold_the_weights_goes_on_to_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_profiling(monkeypatch)
    with pytest.raises(AssertionError, match="profiled"):  # past the bound: the profile is next
        partition(_model(), 2, torch.randn(4, 256), memory_limit=1.1e6)
