"""Profiling at scale: memory flat in the layer count, meta-device models materialised one layer at
a time, where each layer is profiled, and the run's precision (bf16 autocast)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import LiveBytes, cut_bytes, partition, plan_for, profile
from partitioner._placement import layer_device, normalize
from partitioner.memory import stage_bytes


def _equal_layers(n: int, width: int = 128) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n)])


def _layer_bytes(width: int, rows: int) -> int:
    """One layer's parameters and one micro-batch's activation, in bytes."""
    return (width * width + width) * 4 + rows * width * 4


def test_profiling_memory_is_flat_in_the_layer_count() -> None:
    # Live tensor bytes of everything profile() allocates, timed runs included, counted by a
    # dispatch mode around the call: the same for 8 and 32 layers, a few layers' worth.
    torch.manual_seed(0)
    peaks, reported = {}, {}
    for n in (8, 32):
        model, x = _equal_layers(n), torch.randn(32, 128)
        with LiveBytes() as live:
            prof = profile(model, x, warmup=0, repeat=1)
        peaks[n], reported[n] = live.most(), prof.peak_bytes
    one = _layer_bytes(128, 32)
    assert peaks[32] == peaks[8]
    assert peaks[32] <= 4 * one, (peaks, one)
    whole = sum(p.numel() * 4 for p in _equal_layers(32).parameters())
    assert peaks[32] < whole / 6  # the old profile held ~3x the model (clones, every gradient)
    assert reported[8] == reported[32] and 0 < reported[32] <= peaks[32]  # its own count, untimed parts


def test_meta_model_is_materialised_one_layer_at_a_time() -> None:
    torch.manual_seed(0)
    real = _equal_layers(16)
    with torch.device("meta"):
        meta = _equal_layers(16)
    x = torch.randn(32, 128)
    with pytest.raises(ValueError, match=r"layer 0 \(0: Sequential\) is on the meta device.*pass device="):
        profile(meta, x)
    calls: list[str] = []

    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)  # not the module: that would keep every layer alive
        for p in module.parameters():
            nn.init.normal_(p, std=0.02)

    with LiveBytes() as live:
        prof = profile(meta, x, device="cpu", init_fn=init, warmup=0, repeat=1)
    assert len(calls) == 16  # one materialised layer per call, then dropped
    assert all(p.is_meta for p in meta.parameters())  # the model itself stays on meta
    assert live.most() <= 4 * _layer_bytes(128, 32)
    fp32 = profile(real, x, warmup=0, repeat=1)
    for got, want in zip(prof.layers, fp32.layers, strict=True):  # the same figures, never zeros
        assert got.saved_bytes == want.saved_bytes > 0
        assert (got.flops, got.backward_flops, got.param_bytes) == (
            want.flops,
            want.backward_flops,
            want.param_bytes,
        )
        assert got.forward_time > 0


def test_where_each_layer_is_profiled(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.device("cuda") != torch.device("cuda:0"): "cuda" is read as the current device's index.
    assert torch.device("cuda") != torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert normalize("cuda") == torch.device("cuda", 3) and normalize("cuda:1") == torch.device("cuda", 1)
    monkeypatch.undo()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' is CUDA, which this process cannot use"):
            normalize("cuda")
    cpu = torch.device("cpu")
    assert layer_device("l", nn.ReLU(), None, torch.device("meta")) == torch.device("meta")  # its input's
    assert layer_device("l", nn.Linear(2, 2), None, torch.device("meta")) == cpu  # where it lives
    assert layer_device("l", nn.Linear(2, 2), torch.device("meta"), cpu) == torch.device("meta")  # given
    split = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"l has tensors on several devices \(cpu, meta\); pass device="):
        layer_device("l", split, None, cpu)


def test_bf16_autocast_cut_bytes_and_saved_bytes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    x = torch.randn(8, 64)
    bf16 = profile(model, x, autocast=torch.bfloat16, warmup=0, repeat=1)
    fp32 = profile(model, x, warmup=0, repeat=1)
    lin, relu = bf16.layers[1], bf16.layers[2]
    assert bf16.autocast == "bfloat16" and fp32.autocast is None
    assert lin.output_dtype == "bfloat16" and lin.activation_bytes == 8 * 64 * 2
    assert cut_bytes(bf16.graph)[1:3] == [8 * 64 * 2, 8 * 64 * 2]  # what the pipeline sends: bf16
    assert cut_bytes(fp32.graph)[1] == 8 * 64 * 4
    # per micro-batch the Linear keeps its input's bf16 copy; the weight's bf16 copy is autocast's
    # cache, made once per step and shared by every micro-batch
    assert lin.saved_bytes == 8 * 64 * 2 and lin.cache_bytes == 64 * 64 * 2
    assert fp32.layers[1].saved_bytes == 8 * 64 * 4 and fp32.layers[1].cache_bytes == 0
    assert relu.saved_bytes == 8 * 64 * 2 and relu.cache_bytes == 0
    # the memory model: the cache once per stage, activations once per micro-batch held (m = 4)
    plan = plan_for(bf16, [2, 2], schedule="gpipe", n_microbatches=4)
    for st, fig in zip(plan.stages, stage_bytes(bf16, [2, 2], 2.0), strict=True):
        lps = bf16.layers[st.start : st.stop]
        # Adam's state (2 per byte) and a 4-byte step count per parameter tensor
        assert fig.static == sum(4 * lp.param_bytes + lp.cache_bytes + lp.buffer_bytes + 4 * len(lp.params)
                                 for lp in lps)  # fmt: skip
        assert st.memory_bytes >= fig.static + 4 * fig.saved  # the solver's row bounds the walk
    assert plan.autocast == "bfloat16"


def test_the_precision_is_profile_s_to_set() -> None:
    model, x = nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(
            ValueError, match=r"profile\(\) was called inside torch.autocast on cpu.*pass autocast="
        ),
    ):
        profile(model, x)
    fp32 = profile(model, x, warmup=0, repeat=1)
    with pytest.raises(ValueError, match="autocast=bfloat16 but the profile ran under fp32"):
        partition(model, 1, x, autocast=torch.bfloat16, profile=fp32)
    plan = partition(model, 1, x, autocast=torch.bfloat16)  # profiles under bf16 itself
    assert plan.autocast == "bfloat16"
