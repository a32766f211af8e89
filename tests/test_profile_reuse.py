"""Layers of one structure are profiled once (``partitioner._reuse``), so identical layers cost the same
and a busy machine cannot tell them apart: six identical blocks and a 10-layer MLP plan evenly while
other processes burn the cores. Reuse changes nothing but the times: every other figure is the one
each layer gets when measured itself."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import subprocess
import sys
from collections.abc import Hashable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import _reuse
from partitioner._measure import Run
from partitioner.costs import layer_costs
from partitioner.partition import partition
from partitioner.profile import Profile, profile
from pipeline.reference.graph_models import gpt_tied
from pipeline.reference.models import gpt, mlp
from pipeline.runtime.step.live import LiveBytes

_TIMES = {"forward_time", "backward_time", "input_time", "weight_time", "samples", "spread", "error", "noisy",
          "timing", "same_as"}  # fmt: skip


def _measured_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on no two layers share a structure: each is measured itself."""
    fresh = itertools.count()
    real = _reuse.structure

    def unique(*args: Any) -> tuple[Hashable, Any]:
        _, out = real(*args)
        return next(fresh), out

    monkeypatch.setattr(_reuse, "structure", unique)


def _figures(prof: Profile) -> list[dict[str, Any]]:
    """Every layer's figures but its times (and ``same_as``)."""
    return [{k: v for k, v in dataclasses.asdict(lp).items() if k not in _TIMES} for lp in prof.layers]


@pytest.mark.parametrize("built", ["sequential", "traced"])
def test_reuse_changes_nothing_but_the_times(built: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, sample = (gpt if built == "sequential" else gpt_tied)(
        vocab_size=16, width=8, n_layers=2, n_heads=2, max_seq_len=4, batch_size=1
    )
    once = profile(model, sample, warmup=0, repeat=1)
    blocks = [lp.index for lp in once.layers if "Block" in lp.kind]
    assert len(blocks) == 2
    # the first block is measured, the second takes its figures, keeping its own name and parameters
    assert [once.layers[b].same_as for b in blocks] == [None, blocks[0]]
    for b in blocks[1:]:
        lp, first = once.layers[b], once.layers[blocks[0]]
        assert (lp.forward_time, lp.backward_time, lp.timing) == (
            first.forward_time,
            first.backward_time,
            first.timing,
        )
        assert lp.params and all(p.startswith(f"{lp.name}.") for p in lp.params)  # its own, not the first's
    _measured_alone(monkeypatch)
    alone = profile(model, sample, warmup=0, repeat=1)
    assert all(lp.same_as is None for lp in alone.layers)
    assert _figures(once) == _figures(alone)
    if built == "sequential":  # the length probe's figures too (a copy takes its structure's)
        assert once.probe is not None and alone.probe is not None
        assert [dataclasses.asdict(lp) for lp in once.probe.layers] == [
            dataclasses.asdict(lp) for lp in alone.probe.layers
        ]
    assert once.device_memory == alone.device_memory  # (peak_bytes: when the collector frees a working copy)


def test_the_last_layer_measures_its_own_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # the last of three identical layers runs under the loss: its closing transients are its own
    model, sample = mlp(width=16, depth=3, batch_size=4)
    once = profile(model, sample, warmup=0, repeat=1)
    assert [lp.same_as for lp in once.layers] == [None, None, 1]
    last, middle = once.layers[2], once.layers[1]
    assert last.forward_time == middle.forward_time and last.timing == middle.timing
    assert last.closing_backward_transient_bytes != middle.closing_backward_transient_bytes
    _measured_alone(monkeypatch)
    assert _figures(once) == _figures(profile(model, sample, warmup=0, repeat=1))


def _key(module: nn.Module, x: torch.Tensor, first: bool = False) -> Hashable:
    run = Run(torch.device("cpu"), None, 0, 1, LiveBytes())
    return _reuse.structure(type(module).__name__, module, module, x, run, first)[0]


def test_what_makes_another_structure() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    block = lambda *tail: nn.Sequential(nn.Linear(16, 16), *tail)  # noqa: E731
    base = _key(block(nn.Dropout(0.1)), x)
    assert _key(block(nn.Dropout(0.1)), x) == base  # other weights, the same structure
    others = {
        "a longer input": _key(block(nn.Dropout(0.1)), torch.randn(8, 16)),
        "another input dtype": _key(block(nn.Dropout(0.1)).double(), x.double()),
        "the first layer (no input gradient)": _key(block(nn.Dropout(0.1)), x, first=True),
        "another dropout probability": _key(block(nn.Dropout(0.2)), x),
        "dropout off (eval)": _key(block(nn.Dropout(0.1)).eval(), x),
        "another op": _key(block(nn.GELU()), x),
        "a frozen weight": _key(block(nn.Dropout(0.1)).requires_grad_(False), x),
        "another module class": _key(nn.Sequential(nn.Linear(16, 16), nn.Identity(), nn.Dropout(0.1)), x),
    }
    for what, key in others.items():
        assert key != base, what
    image = torch.randn(2, 3, 8, 8)
    conv = _key(nn.Conv2d(3, 3, 3, stride=1), image)
    assert _key(nn.Conv2d(3, 3, 3, stride=1), image) == conv
    assert _key(nn.Conv2d(3, 3, 3, stride=2), image) != conv  # the same weight's shape, another stride
    norm = _key(nn.LayerNorm(16, eps=1e-5), x)
    assert _key(nn.LayerNorm(16, eps=1e-6), x) != norm  # an argument's value
    wide = _key(nn.Linear(16, 32), x)
    assert _key(nn.Linear(16, 24), x) != wide  # a parameter's shape
    lin = nn.Linear(16, 16)
    contiguous, strided = torch.randn(4, 16), torch.randn(16, 4).t()
    assert _key(lin, contiguous) != _key(lin, strided)  # the input's layout


@contextlib.contextmanager
def _busy(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` processes spinning on a core each until the block ends; none is left behind."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=30)


class _Stack(nn.Module):
    """Token ids -> an embedding -> six identical blocks (traced: one layer each)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
            )
            for _ in range(6)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return x


def test_identical_layers_plan_the_same_under_a_busy_loop() -> None:
    torch.manual_seed(0)
    stack, ids = _Stack(), torch.randint(0, 32, (8, 16))
    deep, x = mlp(width=64, depth=10, batch_size=32)
    with _busy(max(2, min(4, torch.get_num_threads()))) as procs:
        stacked, layered = (
            profile(model, sample, warmup=1, repeat=5) for model, sample in ((stack, ids), (deep, x))
        )
        assert all(proc.poll() is None for proc in procs)  # they burned throughout
    assert all(proc.poll() is not None for proc in procs)  # and are gone
    blocks = [k for k, lp in enumerate(stacked.layers) if lp.name.startswith("blocks.")]
    assert len(blocks) == 6
    for prof, same in ((stacked, blocks), (layered, range(1, 10))):
        costs = layer_costs(prof, "time")
        assert len({costs[k] for k in same}) == 1, costs  # identical layers, one cost
    # two blocks a rank (the embedding and the residual adds are cheap: they go either way); the MLP's
    # first layer (no input gradient) costs at most what the others do
    balance = partition(stack, 3, ids, profile=stacked).balance
    ends = list(itertools.accumulate(balance))
    assert [sum(1 for b in blocks if end - n <= b < end) for n, end in zip(balance, ends, strict=True)] == [
        2,
        2,
        2,
    ]
    assert partition(deep, 2, x, profile=layered).balance == [5, 5]
