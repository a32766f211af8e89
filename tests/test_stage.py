"""One stage at a time, no processes: each mode's gradients against one plain backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.reference.models import mlp
from pipeline.runtime.inputs.microbatch import split
from pipeline.runtime.step.stage import StageRuntime
from pipeline.runtime.trace import shape_memo

M = 4
cpu = torch.device("cpu")


def _reference(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _two_stages(model: nn.Sequential, split_backward: bool, recompute: str) -> list[StageRuntime]:
    kw = dict(n_stages=2, n_microbatches=M, split_backward=split_backward, recompute=recompute, device=cpu)
    return [
        StageRuntime(0, model[:2], loss_fn=None, **kw),  # type: ignore[arg-type]
        StageRuntime(1, model[2:], loss_fn=nn.functional.mse_loss, **kw),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("split_backward", [False, True])
@pytest.mark.parametrize("recompute", ["never", "except_last", "always"])
def test_gradients_equal_one_backward(split_backward: bool, recompute: str) -> None:
    torch.manual_seed(0)
    model, x = mlp(width=16, depth=4, batch_size=8)
    y = torch.randn(8, 16)
    loss_ref, grads_ref = _reference(model, x, y)
    model.zero_grad()
    s0, s1 = _two_stages(model, split_backward, recompute)
    for i, (xi, yi) in enumerate(zip(split(x, M), split(y, M), strict=True)):
        out = s0.forward(i, xi)
        assert isinstance(out, torch.Tensor) and s1.forward(i, out, yi) is None
    assert (s0.live, s1.live, s0.peak) == (M, M, M)
    for i in reversed(range(M)):  # any order of micro-batches works
        g = s1.backward(i, None)
        assert g is not None and g[0] is not None and g[0].shape == (2, 16)
        assert s0.backward(i, g) is None  # the first stage sends no gradient
        if split_backward:
            assert s0.live == i + 1  # split: state lives on until W
            s1.weight(i)
            s0.weight(i)
        assert s0.live == i and s1.live == i
    assert abs(sum(float(v) for v in s1.losses) / M - loss_ref) < 1e-6
    for p, ref in zip(model.parameters(), grads_ref, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-7)


def _dropout_grads(split_backward: bool, recompute: str) -> tuple[list[float], list[torch.Tensor]]:
    """Two stages with dropout in each, one step of M micro-batches (forwards in order, then the
    backwards in reverse, the last stage's first): the losses and the weight gradients."""
    torch.manual_seed(0)
    width = 16
    model = nn.Sequential(
        nn.Linear(width, width),
        nn.Dropout(0.5),
        nn.Linear(width, width),
        nn.Dropout(0.5),
        nn.Linear(width, 4),
    )
    x, y = torch.randn(8, width), torch.randn(8, 4)
    kw = dict(n_stages=2, n_microbatches=M, split_backward=split_backward, recompute=recompute, device=cpu)
    s0 = StageRuntime(0, model[:2], loss_fn=None, **kw)  # type: ignore[arg-type]
    s1 = StageRuntime(1, model[2:], loss_fn=nn.functional.mse_loss, **kw)  # type: ignore[arg-type]
    torch.manual_seed(1)  # the dropout masks: the same draws in F whatever the mode
    for i, (xi, yi) in enumerate(zip(split(x, M), split(y, M), strict=True)):
        s1.forward(i, s0.forward(i, xi), yi)
    for i in reversed(range(M)):
        s0.backward(i, s1.backward(i, None))
        if split_backward:
            s1.weight(i)
            s0.weight(i)
    return [float(v) for v in s1.losses], [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("split_backward", [False, True])
@pytest.mark.parametrize("recompute", ["except_last", "always"])
def test_recomputed_dropout_draws_the_masks_of_its_forward(split_backward: bool, recompute: str) -> None:
    # a replay without the forward's RNG state draws other masks: other gradients, same losses
    losses_ref, grads_ref = _dropout_grads(split_backward, "never")
    losses, grads = _dropout_grads(split_backward, recompute)
    assert losses == losses_ref
    for g, ref in zip(grads, grads_ref, strict=True):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, ref, rtol=1e-6, atol=0.0)
    # the split and unsplit backwards agree too, so the reference is not the same mistake twice
    for g, ref in zip(_dropout_grads(not split_backward, "never")[1], grads_ref, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("split_backward", [False, True])
def test_recomputation_updates_batchnorm_statistics_once(split_backward: bool) -> None:
    def run(recompute: str) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2))
        x, y = torch.randn(16, 4), torch.randn(16, 2)
        kw = dict(
            n_stages=2, n_microbatches=M, split_backward=split_backward, recompute=recompute, device=cpu
        )
        s0 = StageRuntime(0, model[:2], loss_fn=None, **kw)  # type: ignore[arg-type]
        s1 = StageRuntime(1, model[2:], loss_fn=nn.functional.mse_loss, **kw)  # type: ignore[arg-type]
        for i, (xi, yi) in enumerate(zip(split(x, M), split(y, M), strict=True)):
            s1.forward(i, s0.forward(i, xi), yi)
        for i in range(M):
            s0.backward(i, s1.backward(i, None))
            if split_backward:
                s1.weight(i)
                s0.weight(i)
        return dict(model.state_dict()), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    state_ref, grads_ref = run("never")
    state, grads = run("always")
    assert int(state["1.num_batches_tracked"]) == M
    for k, t in state.items():
        torch.testing.assert_close(t, state_ref[k], rtol=0.0, atol=0.0)
    for g, ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-6, atol=0.0)


def test_split_b_computes_no_weight_gradients() -> None:
    model, x = mlp(width=8, depth=3, batch_size=2)
    stage = StageRuntime(
        1, model, n_stages=2, n_microbatches=1, split_backward=True, recompute="never",
        loss_fn=lambda out, _: out.sum(), device=cpu,
    )  # fmt: skip
    stage.forward(0, x, None)
    g = stage.backward(0, None)
    assert g is not None and g[0] is not None
    assert all(p.grad is None for p in model.parameters())  # B: input gradient only
    stage.weight(0)
    assert all(p.grad is not None for p in model.parameters())


def test_loss_must_be_scalar() -> None:
    model, x = mlp(width=4, depth=2, batch_size=4)
    stage = StageRuntime(
        0, model, n_stages=1, n_microbatches=1, split_backward=False, recompute="never",
        loss_fn=lambda out, _: out, device=cpu,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar \(0-dim\) tensor, got \(4, 4\)"):
        stage.forward(0, x, None)


def test_infer_does_not_compute_or_touch_buffers() -> None:
    layer = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5))
    stage = StageRuntime(
        0, layer, n_stages=2, n_microbatches=1, split_backward=False, recompute="never",
        loss_fn=None, device=cpu,
    )  # fmt: skip
    shape_memo.clear()  # the fake forward runs (an earlier test's entry would answer instead)
    assert stage.infer((((7, 3), torch.float32),)) == (((7, 5), torch.float32),)
    assert int(layer[1].num_batches_tracked) == 0  # type: ignore[arg-type]


@pytest.mark.parametrize("split_backward", [False, True])
@pytest.mark.parametrize("recompute", ["never", "always"])
def test_meter_counts_what_a_stage_holds_until_it_is_freed(split_backward: bool, recompute: str) -> None:
    torch.manual_seed(0)
    model, x = mlp(width=16, depth=4, batch_size=8)
    y = torch.randn(8, 16)
    s0, s1 = _two_stages(model, split_backward, recompute)
    s1.meter = s0.meter
    meter = s0.meter
    meter.begin_step([*model.parameters()])
    row = 2 * 16 * 4  # one micro-batch's activation: 2 rows of 16 floats
    outs = [s0.forward(i, xi) for i, xi in enumerate(split(x, M))]
    # stage 0 keeps, per micro-batch, the input x (a view of the batch: one storage for all
    # four) and each layer's ReLU output, or only the input when it recomputes
    per_mb = 2 * row if recompute == "never" else 0
    assert meter.now == x.untyped_storage().nbytes() + M * per_mb
    for i, (out, yi) in enumerate(zip(outs, split(y, M), strict=True)):
        s1.forward(i, out, yi)
    assert meter.now > M * per_mb
    for i in reversed(range(M)):
        g = s1.backward(i, None)
        s0.backward(i, g)
        if split_backward:
            s1.weight(i)
            s0.weight(i)
    del outs, g
    assert meter.now == 0 and s0.live == s1.live == 0
    assert meter.peak >= x.untyped_storage().nbytes() + M * per_mb
