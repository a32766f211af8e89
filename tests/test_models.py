"""Reference models make every forward (and backward) tensor on the input's device, never the default one."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from pipeline.reference.models import gpt, gpt_loss, mlp, resnet

Build = Callable[[], tuple[nn.Sequential, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]


def _gpt() -> tuple[nn.Sequential, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    model, x = gpt(vocab_size=11, width=16, n_layers=2, n_heads=2, max_seq_len=8, batch_size=3)
    targets = torch.randint(0, 11, x.shape)
    return model, x, lambda logits: gpt_loss(logits, targets)


def _resnet() -> tuple[nn.Sequential, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    model, x = resnet(widths=(4, 8), blocks_per_width=1, n_classes=5, image_size=8, batch_size=2)
    return model, x, lambda out: out.square().mean()


def _mlp() -> tuple[nn.Sequential, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    model, x = mlp(width=8, depth=3, in_features=5, batch_size=4)
    return model, x, lambda out: out.square().mean()


BUILDERS: dict[str, Build] = {"gpt": _gpt, "resnet": _resnet, "mlp": _mlp}


def _run(
    model: nn.Module, x: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    loss_fn(out).backward()
    return out.detach(), [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", BUILDERS)
def test_forward_and_backward_run_with_the_default_device_on_meta(name: str) -> None:
    torch.manual_seed(0)
    model, x, loss_fn = BUILDERS[name]()
    twin = copy.deepcopy(model)  # BatchNorm's running statistics start equal too
    out, grads = _run(model, x, loss_fn)

    previous = torch.get_default_device()
    torch.set_default_device("meta")  # a tensor made without a device now lands on meta, and fails
    try:
        assert torch.empty(1).device.type == "meta"
        meta_out, meta_grads = _run(twin, x, loss_fn)
    finally:
        torch.set_default_device(previous)

    assert meta_out.device.type == "cpu" and torch.equal(meta_out, out)
    assert len(meta_grads) == len(grads) == len(list(model.parameters()))
    assert all(g.device.type == "cpu" and torch.equal(g, h) for g, h in zip(meta_grads, grads, strict=True))
