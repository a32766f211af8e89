"""Models, balances and references shared by the tests/test_pipe_*.py files."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.reference.models import gpt, gpt_loss, mlp
from pipeline.schedules.registry import REGISTRY

__all__ = [
    "BATCH",
    "CONFIGS",
    "MODELS",
    "RECOMPUTES",
    "CarriesIds",
    "M",
    "assert_close",
    "balance_of",
    "build",
    "grads_of",
    "microbatched_reference",
    "reference",
]

M, BATCH = 4, 8
MODELS = ("mlp", "gpt")
CONFIGS = [(name, e.default_virtual) for name, e in REGISTRY.items()]  # (schedule, v): every registered one
RECOMPUTES = ("never", "except_last", "always")


def build(name: str) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, Any]:
    """(model, inputs, targets, loss_fn), the same on every call (seeded)."""
    torch.manual_seed(0)
    if name == "mlp":
        model, x = mlp(width=8, depth=8, batch_size=BATCH)
        return model, x, torch.randn(BATCH, 8), nn.functional.mse_loss
    model, x = gpt(vocab_size=16, width=16, n_layers=6, n_heads=2, max_seq_len=8, batch_size=BATCH)
    return model, x, torch.randint(0, 16, (BATCH, 8)), gpt_loss


def balance_of(n_layers: int, n_stages: int) -> list[int]:
    """``n_layers`` spread over ``n_stages`` as evenly as possible, the first stages one more."""
    return [n_layers // n_stages + (1 if k < n_layers % n_stages else 0) for k in range(n_stages)]


def grads_of(named: Any) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in named}


def reference(name: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole batch at once: the loss and the gradients."""
    model, x, y, loss_fn = build(name)
    loss = loss_fn(model(x), y)
    loss.backward()
    return float(loss.detach()), grads_of(model.named_parameters())


def microbatched_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any) -> float:
    """One process, micro-batch by micro-batch as the pipeline runs them (per-batch statistics such
    as BatchNorm's then match): the gradient of the mean micro-batch loss; returns that loss."""
    losses = []
    for a, b in zip(x.chunk(M), y.chunk(M), strict=True):
        loss = loss_fn(model(a), b)
        (loss * (1.0 / M)).backward()
        losses.append(loss.detach().float())
    return float(torch.stack(losses).mean())


def assert_close(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], label: str, rel: float = 1e-5
) -> None:
    """Same keys, and per tensor max |got - ref| / max |ref| below ``rel``."""
    assert set(got) == set(ref), label
    for k, g in got.items():
        err = float((g.double() - ref[k].double()).abs().max() / ref[k].double().abs().max().clamp_min(1e-12))
        assert err < rel, f"{label}: {k} relative error {err:.2e}"


class CarriesIds(nn.Module):
    """(ids) or (h, ids) -> (h', ids): every stage boundary carries an int64 tensor (no gradient)
    beside h. The last layer returns h'.mean over T, or with ``tuple_output`` (h'.mean, ids)."""

    def __init__(self, first: bool, last: bool, width: int, tuple_output: bool = False) -> None:
        super().__init__()
        self.first, self.last, self.tuple_output = first, last, tuple_output
        self.emb = nn.Embedding(16, width)
        self.lin = nn.Linear(width, width)

    def forward(self, x: Any) -> Any:
        h, ids = (self.emb(x), x) if self.first else x
        h = torch.tanh(self.lin(h) + self.emb(ids))
        if not self.last:
            return h, ids
        return (h.mean(1), ids) if self.tuple_output else h.mean(1)
