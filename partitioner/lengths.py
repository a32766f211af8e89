"""How a micro-batch's figures grow with its length at fixed tokens: the part that grows as its
tokens (rows x L) and the part that grows as rows x L² (attention), split by the profile.

    # R: rows, L: length (of a micro-batch), l: layer, s: stage; (R0, L0): the sample's shape

The profile measures every layer at the sample's shape (R0, L0), and measures its flops and bytes
again, untimed, at (R1, L1) = (2 R0, L0 // 2): the same tokens (one fewer per row for an odd L0),
half the length (``Profile.probe``). Per token, a figure is a + b L, and the two shapes give a, b::

    f(R, L) / (R L) = a + b L
    q = b L0 / (a + b L0)                           its length-squared share at (R0, L0), in [0, 1]
    f(R, L) = f0 [(1 - q) R L / (R0 L0) + q R L² / (R0 L0²)]        (``pipeline.runtime.inputs.varlen``)

Measured rather than read off the ops (products of two activations: attention's), because the
weight gradient of every Linear multiplies two activations too and grows as the tokens, and an
attention layer's W replays attention's backward: at two shapes every op, kernel, mask and
materialised score counts as it runs. Time follows flops within a layer: its length-squared
seconds are each of its times times that part's flop share (forward, whole backward, input and
weight gradients). Bytes are split per figure of the walk (``StageBytes``) by the same rule,
from ``stage_bytes`` at both shapes. A layer or loss that cannot run at the probe's shape (a
fixed length, a size built into a view) leaves no probe: every figure then grows as the tokens.
At equal tokens a per-call constant cancels out, but a term that grows as the length alone (a
position table's indices) reads as length²: small beside any layer that does real work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from partitioner._measure import Rejected, Run, WithTarget, measure
from partitioner._profiling import LossFn, loss_figures
from partitioner._trees import tensors, tree_map
from partitioner.composition import Composition
from partitioner.figures import LayerProfile, Profile
from partitioner.memory import stage_bytes
from pipeline.schedules.peaks import PARTS, StageBytes

__all__ = [
    "held_bytes",
    "probe_layer",
    "probe_loss",
    "probe_shape",
    "sample_shape",
    "share",
    "squared_seconds",
]


def sample_shape(sample: Any) -> tuple[int, int] | None:
    """The sample's (rows, length): its first tensor's two leading sizes; None with fewer."""
    found = tensors(sample)
    return (int(found[0].shape[0]), int(found[0].shape[1])) if found and found[0].dim() >= 2 else None


def probe_shape(shape: tuple[int, int] | None) -> tuple[int, int] | None:
    """Twice the rows at half the length (see the module docstring); None for a length below 2."""
    return None if shape is None or shape[1] < 2 else (2 * shape[0], shape[1] // 2)


def _halved(x: Any, shape: tuple[int, int]) -> Any:
    """``x`` with each tensor led by ``shape`` cut at half its length into two rows: every
    sequence's first and second halves (its last token dropped for an odd length)."""
    rows, length = shape
    half = length // 2

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2 or tuple(t.shape[:2]) != shape:
            return t  # not per token (a mask of other sizes, a table): as it is
        return t[:, : 2 * half].reshape(2 * rows, half, *t.shape[2:])

    if isinstance(x, WithTarget):
        return WithTarget(_halved(x.output, shape), _halved(x.target, shape))
    return tree_map(x, cut)


def probe_layer(
    index: int,
    name: str,
    kind: str,
    work: nn.Module,
    x: Any,
    run: Run,
    shape: tuple[int, int],
    *,
    first: bool,
    closing: bool,
) -> LayerProfile | None:
    """Layer ``index``'s untimed figures on its input ``x`` (at ``shape``) cut to the probe's shape,
    measured as the profile measures it (``first``, ``closing``); None when it rejects that input."""
    x = _halved(x, shape)
    try:
        figures, _ = measure(index, name, kind, work, work, x, run, first=first, closing=closing, timed=False)
    except Rejected:
        return None
    return figures


def probe_loss(
    loss_fn: LossFn, target: Any, out: Any, run: Run, shape: tuple[int, int]
) -> LayerProfile | None:
    """The loss's untimed figures at the probe's shape; None when it rejects that input."""
    try:
        return loss_figures(loss_fn, _halved(target, shape), _halved(out, shape), run, timed=False)
    except Rejected:
        return None


def share(at: float, probed: float, shape: tuple[int, int], probe: tuple[int, int]) -> float:
    """The length-squared share q of a figure that is ``at`` at ``shape`` and ``probed`` at ``probe``
    (see the module docstring); 0 for a figure of 0."""
    (r0, l0), (r1, l1) = shape, probe
    per0, per1 = at / (r0 * l0), probed / (r1 * l1)
    if per0 <= 0 or l0 == l1:
        return 0.0
    return min(max((per0 - per1) / (l0 - l1) * l0 / per0, 0.0), 1.0)


_PARTS_OF_TIME = (("forward_time", "flops"), ("backward_time", "backward_flops"),
                  ("input_time", "input_flops"), ("weight_time", "weight_flops"))  # fmt: skip


def squared_seconds(profile: Profile) -> list[tuple[float, ...]]:
    """Per layer (the loss's added to the last): the seconds of its forward, whole backward, input
    gradient and weight gradient that grow as rows x length² (each time x its flops' share); all 0
    without a probe."""
    probe, shape = profile.probe, profile.shape
    if probe is None or shape is None:
        return [(0.0,) * len(_PARTS_OF_TIME)] * len(profile.layers)

    def of(lp: LayerProfile, at: LayerProfile) -> tuple[float, ...]:
        return tuple(getattr(lp, time) * share(getattr(lp, flops), getattr(at, flops), shape, probe.shape)
                     for time, flops in _PARTS_OF_TIME)  # fmt: skip

    out = [of(lp, at) for lp, at in zip(profile.layers, probe.layers, strict=True)]
    if profile.loss is not None and probe.loss is not None:
        out[-1] = tuple(a + b for a, b in zip(out[-1], of(profile.loss, probe.loss), strict=True))
    return out


def held_bytes(
    profile: Profile, balance: Sequence[int], optimizer_state_factor: float | Composition
) -> list[StageBytes]:
    """``stage_bytes`` of ``balance`` at the profile's shape, each figure with its length-squared share
    (``StageBytes.squared``) from ``stage_bytes`` of the probe's; without a probe, none."""
    held = stage_bytes(profile, balance, optimizer_state_factor)
    probe, shape = profile.probe, profile.shape
    if probe is None or shape is None:
        return held
    at_probe = stage_bytes(dataclasses.replace(profile, layers=probe.layers, loss=probe.loss), balance,
                           optimizer_state_factor)  # fmt: skip
    return [
        dataclasses.replace(
            st, squared=tuple(share(getattr(st, f), getattr(pr, f), shape, probe.shape) for f in PARTS)
        )
        for st, pr in zip(held, at_probe, strict=True)
    ]
