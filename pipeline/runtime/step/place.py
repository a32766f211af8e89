"""Place: a call's micro-batches on this rank's device, ordered before the compute that reads them.

    # m: micro-batches, i: a micro-batch

The third move of a step's data (prepare.py: the four). Each micro-batch is copied from pinned
memory on the copy stream, and the compute stream waits for the copy with an event (no host sync);
on CPU nothing moves, and under the NCCL emulation a copy reads as poison until compute is ordered
after it (emulation.py), so a missing ordering shows::

    copy stream      [H2D x_0][H2D x_1] ...                 [H2D next batch]  (a prefetch)
                             \\ event                                \\ event, waited for next call
    compute stream            [F x_0 ...] [F x_1 ...]

A prefetch (``Pipeline.step(..., prefetch=(x, y))``) copies the next call's batch whole while this
call computes; the next call that is given that very batch object takes the copy and splits it on
the device as ``prepare`` split it on the host (``microbatch.split`` is a function of the rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.runtime.comm import stream
from pipeline.runtime.inputs.microbatch import Batch, split
from pipeline.runtime.step.prepare import Prepared

__all__ = ["Placed", "Placer", "Prefetched"]


def _map(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` on each tensor of a tensor or tuple; anything else as it is (checked where it is used)."""
    if isinstance(batch, tuple):
        return tuple(_map(t, fn) for t in batch)
    return fn(batch) if isinstance(batch, torch.Tensor) else batch


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, tuple):
        return [t for item in batch for t in _tensors(item)]
    return [batch] if isinstance(batch, torch.Tensor) else []


@dataclass
class Placed:
    """A call's micro-batches on the device: ``xs`` (stage 0's rank), ``ys`` (the last stage's)."""

    xs: list[Batch]
    ys: list[Any]


class Prefetched:
    """A batch whose copy to the device was started ahead of its call."""

    __slots__ = ("copy", "event", "host")

    def __init__(self, host: Any, copy: Any, event: stream.Event) -> None:
        self.host, self.copy, self.event = host, copy, event


class Placer:
    """Copies to ``device`` on a copy stream of its own (see the module docstring)."""

    def __init__(self, device: torch.device, emulated: bool, m: int) -> None:
        self.device, self.emulated, self.m = device, emulated, m
        self.copy_stream = stream.new_stream(device, emulated, "copy")
        self.prefetched: dict[str, Prefetched] = {}  # "inputs" / "targets": the next call's copy
        self.prefetch_used = 0  # prefetched copies a call took (for tests)

    def _compute(self) -> stream.AbstractStream:
        """Where compute runs: the caller's current stream, read at every call (a step under
        ``torch.cuda.stream(s)`` runs its stages on s)."""
        return stream.current_stream(self.device, self.emulated)

    def place(self, prepared: Prepared) -> Placed:
        """``prepared``'s micro-batches on the device: the prefetched copy of a batch given whole, else
        each micro-batch copied now."""
        xs, ys = self._slot(prepared, "inputs", prepared.xs), self._slot(prepared, "targets", prepared.ys)
        return Placed(xs, ys)

    def _slot(self, prepared: Prepared, slot: str, host: Sequence[Any]) -> list[Any]:
        pre = self.prefetched.get(slot)
        if pre is not None and slot in prepared.given and pre.host is prepared.given[slot]:
            del self.prefetched[slot]
            self.prefetch_used += 1
            return split(self.take_prefetched(pre), self.m, what=slot)
        return [self.to_device(b) for b in host]

    def to_device(self, batch: Any) -> Any:
        """``batch`` (a tensor or tuple of them) on the device: pinned, copied on the copy stream,
        ordered before what compute runs next."""
        return self.take_prefetched(self.prefetch(batch))

    def prefetch(self, batch: Any) -> Prefetched:
        """Start ``batch``'s copy to the device on the copy stream; compute is not ordered after it
        until ``take_prefetched`` (so the copy overlaps whatever compute is queued meanwhile)."""
        device, copies = self.device, self.copy_stream
        copy = _map(batch, lambda t: stream.start_copy(stream.pin(t, device), device, copies))
        return Prefetched(batch, copy, stream.record_event(self.copy_stream))

    def take_prefetched(self, pre: Prefetched) -> Any:
        """The prefetched copy, with the compute stream ordered after it (an event wait, no host sync)."""
        compute = self._compute()
        stream.wait_event(compute, pre.event)
        for t in _tensors(pre.copy):  # made on the copy stream, used on compute: not reused before
            stream.record_stream(t, compute)
        return pre.copy

    def start_prefetch(self, prefetch: Sequence[Any] | None, needs_inputs: bool, needs_targets: bool) -> None:
        """Start the copies of the next call's inputs and targets, where this rank uses them."""
        if prefetch is None:
            return
        x, y = prefetch
        if needs_inputs and x is not None:
            self.prefetched["inputs"] = self.prefetch(x)
        if needs_targets and y is not None:
            self.prefetched["targets"] = self.prefetch(y)
