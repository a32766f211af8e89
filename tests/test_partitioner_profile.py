"""``partitioner.profile``: figures per layer, no side effects on the model, clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner.profile import profile
from pipeline.reference.models import gpt, resnet


def _state(model: nn.Module) -> dict[str, object]:
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        "grads": {k: None if v.grad is None else v.grad.clone() for k, v in model.named_parameters()},
        "grad_ids": {k: id(v.grad) for k, v in model.named_parameters()},
        "requires_grad": {k: v.requires_grad for k, v in model.named_parameters()},
        "modes": {k: m.training for k, m in model.named_modules()},
    }


def _same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        assert isinstance(x, dict) and isinstance(y, dict)
        assert x.keys() == y.keys(), key
        for name in x:
            u, v = x[name], y[name]
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                assert isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor), (key, name)
                assert torch.equal(u, v), (key, name)
            else:
                assert u == v, (key, name)


def test_profile_leaves_resnet_exactly_as_it_was() -> None:
    torch.manual_seed(0)
    model, sample = resnet(widths=(4, 8), blocks_per_width=1, image_size=8, batch_size=2)
    model.eval()
    model[1].train()  # mixed modes must come back as they were
    model[2].conv1.weight.requires_grad_(False)
    model(sample).sum().backward()  # some grads set, one parameter without (requires_grad False)
    model[-1].weight.grad = None
    before = _state(model)
    prof = profile(model, sample, warmup=1, repeat=2)
    _same(before, _state(model))
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert len(prof.layers) == len(model)


def test_figures_of_a_linear_layer() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    x = torch.randn(4, 16)
    prof = profile(model, x, warmup=1, repeat=3)
    lin, relu, head = prof.layers
    assert lin.flops == 2 * 4 * 16 * 32
    assert lin.param_bytes == (16 * 32 + 32) * 4
    assert lin.activation_bytes == 4 * 32 * 4
    assert lin.saved_bytes == 4 * 16 * 4  # the input, not the weight
    assert relu.saved_bytes == 4 * 32 * 4  # its output
    assert head.param_bytes == 32 * 8 * 4 and head.output_shape == (4, 8) and head.output_dtype == "float32"
    assert all(lp.forward_time > 0 and lp.backward_time > 0 for lp in prof.layers)
    assert sorted(prof.graph.nodes) == [0, 1, 2]
    assert prof.graph.edges[0, 1]["bytes"] == lin.activation_bytes
    assert prof.graph.nodes[2]["flops"] == head.flops
    assert relu.weight_time == 0.0  # no parameters: the whole backward is the input gradient
    assert all(0.0 <= lp.weight_time <= lp.backward_time for lp in prof.layers)
    assert prof.graph.nodes[0]["weight_time"] == lin.weight_time
    assert prof.input_bytes == 4 * 16 * 4


def test_weight_time_is_the_parameter_gradient_part() -> None:
    # Linear's backward is two matmuls of the same size, one for the input, one for the weight:
    # the weight part is a real share of it (measured, so only a loose bound).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(384, 384, bias=False))
    prof = profile(model, torch.randn(384, 384), warmup=2, repeat=7)
    lin = prof.layers[0]
    assert 0.2 * lin.backward_time < lin.weight_time <= lin.backward_time


def test_views_of_one_storage_count_once() -> None:
    class TwoViews(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2.0
            return y[:, :4] * y[:, 4:]  # both factors are saved: two views of y's storage

    prof = profile(nn.Sequential(TwoViews()), torch.randn(3, 8, requires_grad=True), warmup=0, repeat=1)
    assert prof.layers[0].saved_bytes == 3 * 8 * 4


def test_gpt_profiles_int_input() -> None:
    model, sample = gpt(vocab_size=11, width=16, n_layers=1, n_heads=2, max_seq_len=8, batch_size=2)
    prof = profile(model, sample, warmup=0, repeat=1)
    assert prof.layers[0].kind == "Embedding" and prof.layers[-1].output_shape == (2, 8, 11)
    assert prof.layers[1].flops > 0
    # token ids take no gradient: all of the embedding's backward is its weight gradient
    assert prof.layers[0].weight_time == prof.layers[0].backward_time > 0
    assert prof.input_bytes == 2 * 8 * 8  # int64 ids, one micro-batch


def test_bad_sample_names_layer_and_shape() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 2))
    with pytest.raises(ValueError, match=r"layer 1 \(1: Linear\) rejected its input of shape \(2, 4\)"):
        profile(model, torch.randn(2, 4))


def test_bad_models_and_counts() -> None:
    with pytest.raises(ValueError, match="empty"):
        profile(nn.Sequential(), torch.randn(1))
    with pytest.raises(ValueError, match=r"nn\.Sequential"):
        profile(nn.Linear(2, 2), torch.randn(1, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"repeat \(0\)"):
        profile(nn.Sequential(nn.ReLU()), torch.randn(2), repeat=0)
