"""``partitioner.device_memory``: what a device holds beyond the tensors the plan counts, measured
once by the profile (workspaces, the allocator's block and rounding; a CPU's: nothing).

The CUDA path runs here on CPU with fake readings: the same function reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from partitioner import device_memory, profile
from partitioner.device_memory import DEFAULT_HEADROOM, Meter, Readers, measure_device_memory, with_headroom
from partitioner.figures import Profile
from pipeline.plan import DeviceMemory
from pipeline.runtime.step.live import LiveBytes

MIB = 2**20


class _Readings:
    """An allocator's readings, in the order the measurement takes them, and what it did besides."""

    def __init__(self, values: list[int]) -> None:
        self.values, self.taken, self.streams, self.released = list(values), 0, 0, 0

    def allocated(self) -> int:
        self.taken += 1
        return self.values.pop(0)

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        self.streams += 1
        yield

    def release(self) -> None:
        self.released += 1

    def readers(self) -> Readers:
        return Readers(self.allocated, self.stream, release=self.release)


def test_cpu_measures_nothing_beyond_the_tensors() -> None:
    """The CPU's figures are read by LiveBytes, what memory_stats counts there: 0 and 1 byte."""
    found = measure_device_memory("cpu")
    assert found == DeviceMemory() and not found.reserves


def test_workspaces_and_block_are_the_allocators_growth() -> None:
    # before / after a 1-byte tensor, then before / after the products on a fresh stream: two 32 MiB
    # workspaces (the forward's thread, autograd's), as on an H100 or H200
    seen = _Readings([1000, 1512, 1000, 1000 + 64 * MIB])
    found = measure_device_memory("cpu", seen.readers(), headroom=0.1)
    assert found == DeviceMemory(device="cpu", workspace_bytes=64 * MIB, block_bytes=512, headroom=0.1)
    assert (seen.taken, seen.streams, seen.released) == (4, 1, 1)  # on a fresh stream; freed after
    assert measure_device_memory("cpu", _Readings([0, 512, 0, 0]).readers()).headroom == 0.0  # CPU's default
    assert DEFAULT_HEADROOM == {"cuda": 0.1}
    with pytest.raises(ValueError, match=r"memory_headroom \(1.5\) must be a fraction in \[0, 1\)"):
        measure_device_memory("cpu", _Readings([0, 512, 0, 0]).readers(), headroom=1.5)


def test_the_workspaces_are_released_when_the_products_fail() -> None:
    seen = _Readings([0, 512, 0])

    def broken() -> contextlib.AbstractContextManager[None]:
        raise RuntimeError("no stream")

    with pytest.raises(RuntimeError, match="no stream"):
        measure_device_memory("cpu", Readers(seen.allocated, broken, release=seen.release))
    assert seen.released == 1


def test_headroom_given_replaces_the_devices() -> None:
    found = DeviceMemory(device="cuda:0", workspace_bytes=MIB, block_bytes=512, headroom=0.1)
    assert with_headroom(found, None) is found
    assert with_headroom(found, 0.02) == dataclasses.replace(found, headroom=0.02)


def test_rounding_is_the_worst_layers_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        device_memory, "measure_device_memory", lambda dev: DeviceMemory(device=str(dev), block_bytes=512)
    )
    live = LiveBytes()
    meter = Meter(live)
    meter.on(torch.device("cpu"))
    assert live.block == {"cpu": 512}
    with meter.layer(), live:  # 100 B and 1 KiB: 1536 bytes in 512 B blocks for 1124
        a, b = torch.empty(100, dtype=torch.uint8), torch.empty(1024, dtype=torch.uint8)
    with meter.layer(), live:  # whole blocks: nothing added
        c = torch.empty(4096, dtype=torch.uint8)
    del a, b, c
    assert meter.rounding == pytest.approx(412 / 1124)
    assert meter.result() == DeviceMemory(device="cpu", block_bytes=512, rounding=meter.rounding)
    assert Meter(LiveBytes()).result() == DeviceMemory()  # nothing measured: nothing reserved


def _h200(dev: torch.device) -> DeviceMemory:
    return DeviceMemory(device=str(dev), workspace_bytes=64 * MIB, block_bytes=512, headroom=0.1)


def _profiled(width: int, rows: int) -> Profile:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    return profile(model, torch.randn(rows, width), warmup=0, repeat=1)


def test_the_profile_measures_its_device_once_and_rounds_each_layers_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _profiled(8, 2).device_memory == DeviceMemory()  # CPU: the plan is as without the term
    calls: list[str] = []

    def fake(dev: torch.device) -> DeviceMemory:
        calls.append(str(dev))
        return _h200(dev)

    monkeypatch.setattr(device_memory, "measure_device_memory", fake)
    tiny, wide = _profiled(8, 2), _profiled(250, 64)  # tensors of 32-256 B; of 1000 B to 250 kB
    assert calls == ["cpu", "cpu"]  # once per profile and device
    for prof in (tiny, wide):
        assert dataclasses.replace(prof.device_memory, rounding=0.0) == _h200(torch.device("cpu"))
    assert tiny.device_memory.rounding > 3.0  # a 32 B tensor takes a 512 B block
    assert 0.0 < wide.device_memory.rounding < 0.01  # 1000 B biases in 1024 B, 250 kB weights nearly whole
