"""The three models of ``bench_autoplan.py``, each an ``nn.Sequential`` with one batch and its loss.

    # B: batch rows (one step), T: sequence, C: channels / width, V: vocabulary

    gpt     the reference GPT (pipeline/reference/models.py): embedding, blocks, norm, head
    resnet  a ResNet-like CNN: stem, residual blocks (two convs and a skip inside each), pool, head
    heavy   an MLP of light layers around ONE layer ~24x heavier than any other (wide inside),
            where equal layer counts are far from balanced

Every builder seeds torch first, so each rank (and each configuration) gets the same weights
and batch. ``quick`` makes each model tiny (the test's size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.reference import models

__all__ = ["MODELS", "Workload", "build"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Workload:
    """A model, one step's batch (B rows) and the loss of its output against ``y``."""

    model: nn.Sequential
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: LossFn


def _gpt(quick: bool, batch: int) -> Workload:
    width, n_layers, seq = (32, 2, 16) if quick else (64, 4, 32)
    model, x = models.gpt(vocab_size=96, width=width, n_layers=n_layers, n_heads=4, max_seq_len=seq,
                          batch_size=batch)  # fmt: skip
    return Workload(model, x, torch.randint(0, 96, x.shape), models.gpt_loss)


def _resnet(quick: bool, batch: int) -> Workload:
    widths, image = ((4, 8), 8) if quick else ((8, 16, 32), 16)
    model, x = models.resnet(widths=widths, blocks_per_width=2, n_classes=10, image_size=image,
                             batch_size=batch)  # fmt: skip
    return Workload(model, x, torch.randint(0, 10, (batch,)), F.cross_entropy)


def _heavy(quick: bool, batch: int) -> Workload:
    width, wide, n_light = (16, 128, 4) if quick else (256, 1024, 6)

    def light() -> nn.Module:
        return nn.Sequential(nn.Linear(width, width), nn.ReLU())

    heavy = nn.Sequential(nn.Linear(width, wide), nn.ReLU(), nn.Linear(wide, wide), nn.ReLU(),
                          nn.Linear(wide, width))  # fmt: skip
    layers = [light() for _ in range(2)] + [heavy] + [light() for _ in range(n_light - 2)]
    return Workload(nn.Sequential(*layers), torch.randn(batch, width), torch.randn(batch, width), F.mse_loss)


MODELS: dict[str, Callable[[bool, int], Workload]] = {"gpt": _gpt, "resnet": _resnet, "heavy": _heavy}


def build(name: str, quick: bool, batch: int) -> Workload:
    """The named model (a key of MODELS), seeded: the same weights and batch on every call."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    torch.manual_seed(0)
    return MODELS[name](quick, batch)
