"""``pipeline.runtime.step.live.LiveBytes``: live and peak bytes of what runs inside, until freed."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.runtime.step.live import LiveBytes


def test_counts_new_storages_once_and_frees_them() -> None:
    before = torch.randn(1000)  # made outside: never counted
    with LiveBytes() as live:
        a = torch.empty(256)  # 1 KiB
        view = a[:10]  # a view: same storage, not counted again
        b = before * 2  # a new storage
        assert live.now["cpu"] == 1024 + 4000
        del a
        assert live.now["cpu"] == 1024 + 4000  # the view keeps the storage alive
        del view, b
        assert live.now["cpu"] == 0
    assert live.peak["cpu"] == 1024 + 4000 and live.most() == 5024


def test_every_storage_is_tallied_raw_and_in_allocator_blocks() -> None:
    live = LiveBytes()
    live.block["cpu"] = 512  # a caching allocator's (partitioner.device_memory)
    with live:
        a = torch.empty(25)  # 100 B: one 512 B block
        b = torch.empty(256)  # 1 KiB: two whole blocks
        del a, b
        c = torch.empty(25, dtype=torch.uint8)  # freed storages stay in the tally
    assert (live.made["cpu"], live.rounded["cpu"]) == (100 + 1024 + 25, 512 + 1024 + 512)
    assert live.now["cpu"] == 25 and c.nelement() == 25


def test_autograd_saved_tensors_and_gradients() -> None:
    lin = nn.Linear(64, 64)
    x = torch.randn(16, 64, requires_grad=True)
    with LiveBytes() as live:
        y = torch.relu(lin(x))
        assert live.now["cpu"] == 16 * 64 * 4  # relu's output, saved for its backward
        y.sum().backward()
    grads = (64 * 64 + 64 + 16 * 64) * 4  # weight, bias and input gradients
    assert live.now["cpu"] == 16 * 64 * 4 + grads  # y still alive
    del y
    assert live.now["cpu"] == grads
    lin.weight.grad = lin.bias.grad = x.grad = None
    assert live.now["cpu"] == 0


def test_reset_peak_and_track() -> None:
    with LiveBytes() as live:
        t = torch.zeros(100)
        del t
    assert live.peak["cpu"] == 400 and live.now["cpu"] == 0
    live.reset_peak()
    assert live.peak["cpu"] == 0
    outside = torch.ones(10)
    live.track(outside)
    assert live.now["cpu"] == 40
    del outside
    assert live.now["cpu"] == 0


def test_storages_resized_in_place_are_counted() -> None:
    """FSDP2 frees a gathered parameter by resizing its storage to 0 and gathers it again into the same
    storage: no op allocates, yet the bytes are alive (the storage's resize_ is seen, not dispatched)."""
    kept = torch.empty(1024)  # 4 KB made before: not counted
    storage = kept.untyped_storage()
    storage.resize_(0)
    with LiveBytes() as live:
        storage.resize_(4096)  # grown from nothing: counted as if made here
        assert live.now["cpu"] == 4096
        storage.resize_(8192)  # a counted storage grows
        extra = torch.ones(256)  # 1 KB on top
        assert live.peak["cpu"] == 8192 + 1024
        storage.resize_(0)
        assert live.now["cpu"] == 1024
        del extra
        assert live.now["cpu"] == 0
    before = torch.empty(16).untyped_storage()
    with LiveBytes() as live:
        before.resize_(32)  # from 64 bytes: alive before, not counted (the caller's baseline)
        assert live.peak["cpu"] == 0
    storage.resize_(4096)  # outside any mode: nothing to count, nothing breaks
    assert kept.untyped_storage().nbytes() == 4096
