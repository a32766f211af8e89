"""Activation recomputation: which micro-batches recompute their forward in backward.

    # i: micro-batch, m: micro-batches

    "never"        every micro-batch keeps its activations from F to backward
    "except_last"  all but the last micro-batch (i < m - 1) recompute: the last one's
                   backward follows its forward at once, so saving it costs little
    "always"       every micro-batch recomputes

A recomputed micro-batch's forward runs under ``no_grad`` and keeps only its input
and the random-number state; the backward replays the forward with the same state,
so dropout and friends draw the same numbers and the gradients are identical to
those without recomputation. (torch calls this activation checkpointing and
Megatron activation recomputation; "checkpoint" in this library means a training
checkpoint on disk, see pipeline/checkpointing.py.)

A plan's ``recompute`` is one mode for every stage, or a tuple of one mode per stage
(``check_recompute``), e.g. ``("always", "never")``: stage 0 holds the most micro-batches
under 1F1B, so recomputing there alone can be what makes a model fit. ``mode_of`` gives
stage s's mode either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.schedules.modes import RECOMPUTE_MODES, check_mode, recomputes

__all__ = [
    "CHECKPOINT_MODES",
    "RECOMPUTE_MODES",
    "RNGState",
    "Recompute",
    "check_mode",
    "check_recompute",
    "mode_of",
    "recomputes",
]

Recompute = str | tuple[str, ...]  # one mode for every stage, or one per stage
CHECKPOINT_MODES = RECOMPUTE_MODES  # the old name, kept for one release


def check_recompute(recompute: object, n_stages: int) -> Recompute:
    """``recompute`` checked: one mode (a str), or one mode per stage (a list or tuple of
    ``n_stages`` modes, returned as a tuple); a TypeError / ValueError naming the stage otherwise."""
    if isinstance(recompute, str):
        return check_mode(recompute)
    if not isinstance(recompute, list | tuple):
        raise TypeError(
            f"recompute must be a mode ({', '.join(RECOMPUTE_MODES)}) or a list of one mode per stage, "
            f"got {type(recompute).__name__} {recompute!r}"
        )
    if len(recompute) != n_stages:
        raise ValueError(
            f"recompute has {len(recompute)} modes for {n_stages} stages; give one mode per stage, "
            "or one mode (a str) for all"
        )
    for s, mode in enumerate(recompute):
        if not isinstance(mode, str) or mode not in RECOMPUTE_MODES:
            raise ValueError(
                f"recompute[{s}] (stage {s}) is {mode!r}; each must be one of {', '.join(RECOMPUTE_MODES)}"
            )
    return tuple(recompute)


def mode_of(recompute: Recompute, stage: int) -> str:
    """Stage ``stage``'s mode under a checked ``recompute`` (one mode, or one per stage)."""
    return recompute if isinstance(recompute, str) else recompute[stage]


@dataclass
class RNGState:
    """The CPU generator's state, and the device's when it is a GPU, at capture time."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> RNGState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
