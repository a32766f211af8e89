"""``partitioner.profile``: figures per layer as the pipeline runs them, the model and the process left
exactly as they were, in-place and dict layers, the loss, meta models, clear errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from partitioner.profile import profile
from pipeline.reference.models import gpt, gpt_loss, resnet


def _state(model: nn.Module) -> dict[str, object]:
    """Everything profile() must leave as it was, by value and by identity."""
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "param_ids": {k: (id(v), v.data_ptr()) for k, v in model.named_parameters()},
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        "grads": {k: None if v.grad is None else v.grad.clone() for k, v in model.named_parameters()},
        "grad_ids": {k: id(v.grad) for k, v in model.named_parameters()},
        "requires_grad": {k: v.requires_grad for k, v in model.named_parameters()},
        "modes": {k: m.training for k, m in model.named_modules()},
        "cpu_rng": {"state": torch.get_rng_state()},
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
                bits = (u.flatten().view(torch.uint8), v.flatten().view(torch.uint8))
                assert u.dtype == v.dtype and u.shape == v.shape and torch.equal(*bits), (key, name)
            else:
                assert u == v, (key, name)


def test_profile_leaves_the_model_and_generators_bitwise_as_they_were() -> None:
    torch.manual_seed(0)
    model, sample = resnet(widths=(4, 8), blocks_per_width=1, image_size=8, batch_size=2)
    model.insert(2, nn.Dropout(0.5))  # draws from the CPU generator in training mode
    model.eval()
    model[1].train()  # mixed modes must come back as they were
    model[3].conv1.weight.requires_grad_(False)
    model(sample).sum().backward()  # some grads set, one parameter without (requires_grad False)
    model[-1].weight.grad = None
    torch.manual_seed(123)
    before = _state(model)
    prof = profile(model, sample, warmup=1, repeat=2)
    _same(before, _state(model))
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert len(prof.layers) == len(model)
    assert prof.layers[2].kind == "Dropout" and prof.layers[2].saved_bytes > 0


def test_figures_of_linear_layers() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    x = torch.randn(4, 16)
    prof = profile(model, x, warmup=1, repeat=3)
    lin, relu, head = prof.layers
    assert lin.flops == 2 * 4 * 16 * 32  # addmm: torch's formula counts its matmul
    # backward: the weight's gradient (a matmul), the bias's (a sum), both added into the gradients
    # already there (as micro-batches accumulate); layer 0 computes no input gradient
    assert lin.backward_flops == 2 * 4 * 16 * 32 + 4 * 32 + (16 * 32 + 32)
    assert head.backward_flops == 2 * (2 * 4 * 32 * 8) + 32 * 8  # input and weight matmuls, the add
    assert relu.flops == relu.backward_flops == 4 * 32
    assert lin.param_bytes == (16 * 32 + 32) * 4 and lin.buffer_bytes == 0
    assert lin.activation_bytes == 4 * 32 * 4
    assert lin.saved_bytes == 4 * 16 * 4  # its input (for the weight's gradient), not the weight
    assert head.saved_bytes == 4 * 32 * 4
    assert relu.saved_bytes == 4 * 32 * 4  # its output
    assert head.param_bytes == 32 * 8 * 4 and head.output_shape == (4, 8) and head.output_dtype == "float32"
    assert all(lp.forward_time > 0 and lp.backward_time > 0 for lp in prof.layers)
    assert sorted(prof.graph.nodes) == [0, 1, 2]
    assert prof.graph.edges[0, 1]["bytes"] == lin.activation_bytes
    assert prof.graph.nodes[2]["flops"] == head.flops
    assert relu.weight_time == 0.0 and relu.input_time > 0  # no parameters: all input gradient
    assert lin.input_time == 0.0 and lin.weight_time > 0  # stage 0 computes no input gradient
    assert head.input_time > 0 and head.weight_time > 0
    assert prof.graph.nodes[0]["weight_time"] == lin.weight_time
    assert prof.input_bytes == 4 * 16 * 4
    assert not any(lp.inplace for lp in prof.layers) and all(lp.sendable for lp in prof.layers)
    assert prof.peak_bytes > 0 and prof.seconds > 0 and prof.device == "cpu" and prof.autocast is None
    # the split backward's flops: input gradient (none for layer 0), then weight gradient
    assert lin.input_flops == 0 and lin.weight_flops == lin.backward_flops
    assert head.input_flops == 2 * 4 * 32 * 8 and head.weight_flops == 2 * 4 * 32 * 8 + 32 * 8
    assert relu.input_flops == 4 * 32 and relu.weight_flops == 0
    for lp in prof.layers:  # at least repeat samples, at most the cap; each time's estimate kept
        assert 3 <= lp.samples <= 10 * 3 and lp.timing is not None and lp.spread >= 0.0 and lp.error >= 0.0
        assert lp.timing.forward.measured > 0 and lp.timing.forward.value == lp.forward_time
        assert lp.timing.weight.value == lp.weight_time and lp.timing.input.value == lp.input_time
    assert prof.trusted == (not prof.noisy_layers)


def test_input_and_weight_gradients_are_timed_apart() -> None:
    # A Linear's backward is two matmuls of one size, one for the input, one for the weight: each
    # part is measured on its own (the split backward's B and W), and neither is negligible.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), nn.Linear(384, 384, bias=False))
    lin = profile(model, torch.randn(384, 384), warmup=2, repeat=9).layers[1]
    assert lin.input_time > 0 and lin.weight_time > 0
    assert 0.2 < lin.input_time / lin.weight_time < 5.0


def test_backward_parts_and_closing_transients_are_profiled_apart() -> None:
    # Linear(32, 32) + ReLU on 8 rows: an activation is 1024 bytes, the weight's gradient 4096, the
    # bias's 128. Whole backward: ReLU's gradient, the input's, the weights'; B (split): no weights';
    # W: no input's; layer 0 computes no input gradient (the step's data takes none)
    act, w, b = 1024, 4096, 128
    block = lambda: nn.Sequential(nn.Linear(32, 32), nn.ReLU())  # noqa: E731
    first, second = profile(nn.Sequential(block(), block()), torch.randn(8, 32), warmup=0, repeat=1).layers
    assert second.backward_transient_bytes == 2 * act + w + b
    assert second.input_transient_bytes == 2 * act
    assert second.weight_transient_bytes == act + w + b
    assert first.input_transient_bytes == 0 and first.weight_transient_bytes == act + w + b
    # closing (under the loss): the output is freed once ReLU's backward has read it, before the
    # weights' gradients come; B keeps the graph (nothing freed), its gradient made inside
    assert second.closing_backward_transient_bytes == 2 * act + w + b - act
    assert second.closing_weight_transient_bytes == act + w + b - act
    assert second.closing_input_transient_bytes == 2 * act
    assert second.forward_transient_bytes == act  # Linear's output, freed once ReLU has run


def test_views_of_one_storage_count_once() -> None:
    class TwoViews(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2.0
            return y[:, :4] * y[:, 4:]  # both factors are saved: two views of y's storage

    prof = profile(nn.Sequential(nn.Identity(), TwoViews()), torch.randn(3, 8), warmup=0, repeat=1)
    assert prof.layers[1].saved_bytes == 3 * 8 * 4


def test_gpt_profiles_int_input() -> None:
    model, sample = gpt(vocab_size=11, width=16, n_layers=1, n_heads=2, max_seq_len=8, batch_size=2)
    prof = profile(model, sample, warmup=0, repeat=1)
    emb = prof.layers[0]
    assert emb.kind == "Embedding" and prof.layers[-1].output_shape == (2, 8, 11)
    assert emb.flops == 2 * 8 * 16  # the position embedding added to the token embedding
    assert emb.backward_flops > 2 * 8 * 16  # the gathered rows added into the weights' gradients
    assert prof.layers[1].flops > 0 and prof.layers[-2].flops > 0  # a block; the final LayerNorm
    assert emb.input_time == 0.0 and emb.weight_time > 0  # token ids take no gradient
    assert prof.input_bytes == 2 * 8 * 8  # int64 ids, one micro-batch


def test_the_loss_is_profiled() -> None:
    torch.manual_seed(0)
    model, sample = gpt(vocab_size=64, width=16, n_layers=1, n_heads=2, max_seq_len=8, batch_size=2)
    target = torch.randint(0, 64, (2, 8))
    prof = profile(model, sample, loss_fn=gpt_loss, target=target, warmup=0, repeat=1)
    loss = prof.loss
    assert loss is not None and loss.name == "loss"
    assert loss.forward_time > 0 and loss.input_time > 0 and loss.weight_time == 0.0
    assert loss.saved_bytes >= 2 * 8 * 64 * 4  # the fp32 log-softmax over B x T x V
    assert loss.flops > 2 * 8 * 64 and loss.activation_bytes == 4  # a scalar
    assert profile(model, sample, warmup=0, repeat=1).loss is None
    with pytest.raises(ValueError, match=r"loss_fn rejected the last layer's output of shape \(2, 8, 64\)"):
        profile(model, sample, loss_fn=gpt_loss, warmup=0, repeat=1)  # no target
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar \(0-dim\) tensor, got \(2, 8\)"):
        profile(model, sample, loss_fn=lambda out, y: out.sum(-1), target=target, warmup=0, repeat=1)


def test_bad_sample_names_layer_and_shape() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 2))
    with pytest.raises(ValueError, match=r"layer 1 \(1: Linear\) rejected its input of shape \(2, 4\)"):
        profile(model, torch.randn(2, 4))


def test_bad_models_and_arguments() -> None:
    with pytest.raises(ValueError, match="empty"):
        profile(nn.Sequential(), torch.randn(1))
    with pytest.raises(ValueError, match=r"must be an nn\.Module"):
        profile("a model", torch.randn(1, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"repeat \(0\) must be an integer >= 1"):
        profile(nn.Sequential(nn.ReLU()), torch.randn(2), repeat=0)
    with pytest.raises(ValueError, match=r"warmup \(-1\) must be an integer >= 0"):
        profile(nn.Sequential(nn.ReLU()), torch.randn(2), warmup=-1)
    with pytest.raises(ValueError, match=r"autocast \(torch.float64\) must be torch.bfloat16"):
        profile(nn.Sequential(nn.ReLU()), torch.randn(2), autocast=torch.float64)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        profile(nn.Sequential(nn.ReLU()), torch.randn(2), loss_fn="mse")  # type: ignore[arg-type]
    for threads in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"threads \({threads!r}\) must be an integer >= 1"):
            profile(nn.Sequential(nn.ReLU()), torch.randn(2), threads=threads)  # type: ignore[arg-type]


class _Traced(nn.Module):  # not a Sequential: profiled on its traced graph
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


@pytest.mark.parametrize("traced", [False, True], ids=["sequential", "traced"])
def test_layers_are_timed_with_a_launched_ranks_threads(
    traced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU every layer runs with the threads a launched rank has (launch's default, or threads=),
    and the caller's count comes back: a balance of the times ranks will see (two threads on a busy
    2-core host stall at each kernel's barrier in every sample)."""
    from partitioner import _measure
    from pipeline.launch import CPU_THREADS

    seen: list[int] = []
    timed = _measure.one_sample

    def counted(*args: Any) -> Any:
        seen.append(torch.get_num_threads())
        return timed(*args)

    monkeypatch.setattr(_measure, "one_sample", counted)
    model = _Traced() if traced else nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        for given, expected in ((None, CPU_THREADS), (2, 2)):
            seen.clear()
            profile(model, torch.randn(2, 4), warmup=0, repeat=1, threads=given)
            assert seen and set(seen) == {expected}
            assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_a_layer_writing_into_its_parameters_is_named() -> None:
    class Drifts(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.weight.add_(1.0)
            return super().forward(x)

    with pytest.raises(ValueError, match=r"layer 1 \(1: Drifts\) wrote into its own parameters \(weight\)"):
        profile(nn.Sequential(nn.ReLU(), Drifts(4, 4)), torch.randn(2, 4), warmup=0, repeat=1)
