"""``materialize``: a meta model's stages get real values, ties survive, and nothing is left blank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.reference.graph_models import TiedGPT
from pipeline.runtime.trace.materialize import materialize


class Scaled(nn.Module):
    """A scale made in ``__init__`` (no reset_parameters) and a registered mask buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("mask", torch.tril(torch.ones(3, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x @ self.mask) * self.scale


def test_a_tensor_nothing_initialises_is_named() -> None:
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(
        ValueError, match=r"left scale \(a parameter of Scaled\), mask \(a buffer of Scaled\)"
    ):
        materialize([model], "cpu")


def test_init_fn_may_give_the_values() -> None:
    with torch.device("meta"):
        model = Scaled()

    def init(module: nn.Module) -> None:
        for sub in module.modules():
            if isinstance(sub, Scaled):
                with torch.no_grad():
                    sub.scale.fill_(1.0)
                sub.mask = torch.tril(torch.ones(3, 3))  # replaced, not written: counts too

    materialize([model], "cpu", init)
    assert torch.equal(model.scale, torch.ones(3)) and torch.equal(model.mask, torch.tril(torch.ones(3, 3)))
    assert not model.lin.weight.is_meta and torch.isfinite(model.lin.weight).all()


def test_ties_stay_one_tensor_across_modules() -> None:
    with torch.device("meta"):
        model = TiedGPT(vocab_size=7, width=8, n_layers=1, n_heads=2, max_seq_len=4)
    first, last = nn.ModuleDict({"tok": model.tok}), nn.ModuleDict({"head": model.head})
    materialize([first, last], "cpu")
    assert model.tok.weight is model.head.weight and not model.tok.weight.is_meta
    assert model.pos.weight.is_meta  # not given: left alone


class Ones(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.w)


def test_values_come_from_reset_parameters() -> None:
    with torch.device("meta"):
        model = nn.Sequential(Ones(), nn.LayerNorm(4))
    materialize([model], "cpu")
    assert torch.equal(model[0].w, torch.ones(4)) and torch.equal(model[1].bias, torch.zeros(4))
