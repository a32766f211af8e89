"""Workload A's timed layers, and this machine's limits: p2p latency and how long a sleep lasts.

    # p: ranks, s: stage, m: micro-batches, t_f / t_b / t_w: forward / input-grad / weight-grad sleep

A timed layer costs exactly what it is told and uses no CPU while it waits, so many
stages fit on two cores and the ideal step time of a schedule is known exactly.
Its forward and its two backward parts live in separate autograd nodes, so that
autograd of the stage input alone (split B) runs only the input part and autograd
of the parameters alone (split W) runs only the weight part; a plain backward runs
both and costs t_b + t_w::

    x ──> _InputPart ──> h ─┐         forward: sleep t_f;  backward: sleep t_b
                            (+) ──> y
    weight ──> _WeightPart ─┘         forward: zeros;      backward: sleep t_w

(``ctx.needs_input_grad`` cannot tell the two apart in one node: it is fixed at
forward time, whatever ``autograd.grad`` asks for later.)

Every sleep is timed and added to a per-process ledger, so the bench can check
that both runtimes did the same work and feed the layers' real durations to the
simulator.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "MB_ROWS",
    "WIDTH",
    "TimedLayer",
    "p2p_latency",
    "reset_work",
    "sleep_duration",
    "timed_loss",
    "work_done",
]

WIDTH = 16  # timed layers' activation width: messages stay small
MB_ROWS = 2  # rows per micro-batch of the timed workload

# seconds this process slept in timed layers, by part: as asked (nominal) and as measured (real)
_NOMINAL = {"F": 0.0, "B": 0.0, "W": 0.0}
_REAL = {"F": 0.0, "B": 0.0, "W": 0.0}


def _sleep(part: str, seconds: float) -> None:
    if seconds <= 0:
        return
    start = time.perf_counter()
    time.sleep(seconds)
    _REAL[part] += time.perf_counter() - start
    _NOMINAL[part] += seconds


def reset_work() -> None:
    for part in _NOMINAL:
        _NOMINAL[part] = _REAL[part] = 0.0


def work_done() -> dict[str, dict[str, float]]:
    """Seconds slept since the last ``reset_work``: {"nominal": {F, B, W}, "real": {F, B, W}}."""
    return {"nominal": dict(_NOMINAL), "real": dict(_REAL)}


class _InputPart(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:
        _sleep("F", t_f)
        ctx.t_b = t_b
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _sleep("B", ctx.t_b)
        return grad, None, None


class _WeightPart(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, t_w: float) -> torch.Tensor:
        ctx.t_w = t_w
        return torch.zeros_like(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _sleep("W", ctx.t_w)
        return grad, None


class TimedLayer(nn.Module):
    """(B, C) -> (B, C): forward sleeps ``t_f``; backward sleeps ``t_b`` (input) and ``t_w`` (weight)."""

    def __init__(self, width: int, t_f: float, t_b: float, t_w: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _InputPart.apply(x, self.t_f, self.t_b)  # type: ignore[no-untyped-call]  # (B, C)
        zeros = _WeightPart.apply(self.weight, self.t_w)  # type: ignore[no-untyped-call]  # (C,)
        out: torch.Tensor = h + zeros  # (B, C)
        return out


def timed_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that costs next to nothing next to the timed layers."""
    return (output * target).mean()


def sleep_duration(seconds: float, repeats: int) -> float:
    """Median real duration of ``time.sleep(seconds)`` here: wake-up latency included."""
    if seconds <= 0:
        return 0.0
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        time.sleep(seconds)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def p2p_latency(shape: tuple[int, ...], repeats: int) -> float:
    """Median one-way time of a ``shape`` float32 message between ranks 0 and 1 (ping-pong / 2).

    Called on every rank (the others wait in a barrier); returns the same value everywhere.
    """
    rank = dist.get_rank()
    buf = torch.zeros(shape)
    result = torch.zeros(1, dtype=torch.float64)
    dist.barrier()
    if rank in (0, 1):
        peer = 1 - rank
        samples = []
        for k in range(repeats + 3):  # the first round trips set up the connection
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            if k >= 3:
                samples.append(time.perf_counter() - start)
        result[0] = statistics.median(samples) / 2
    dist.broadcast(result, 0)
    return float(result[0])
