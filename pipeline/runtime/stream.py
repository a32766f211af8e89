"""CUDA streams behind one small interface, with a stand-in for CPU.

On a GPU the executor uses three streams: compute (the device's current stream),
a copy stream for host-to-device copies of micro-batches from pinned memory,
and a comm stream on which sends and receives are posted. They are ordered
with events (``wait_stream``), and a tensor made on one stream but used on
another is marked with ``record_stream`` so that the caching allocator does
not hand its memory out again before the other stream is done with it::

    copy stream     [H2D mb0][H2D mb1] ...
                          \\ event
    compute stream         [F mb0 ......][F mb1 ......]
                                         \\ event
    comm stream                           [send mb0 activation]

On CPU every call here is a no-op on the ``CPUStream`` stand-in, so the same
executor code runs unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "AbstractStream",
    "CPUStream",
    "current_stream",
    "default_stream",
    "is_cuda",
    "new_stream",
    "pin",
    "record_stream",
    "to_device",
    "use_stream",
    "wait_stream",
]


class CPUStreamType:
    """The stand-in stream of the CPU: everything on it is already ordered."""

    def __repr__(self) -> str:
        return "CPUStream"


CPUStream = CPUStreamType()
AbstractStream = torch.cuda.Stream | CPUStreamType


def new_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def current_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.current_stream(device)


def default_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.default_stream(device)


def is_cuda(stream: AbstractStream) -> bool:
    return not isinstance(stream, CPUStreamType)


@contextlib.contextmanager
def use_stream(stream: AbstractStream) -> Iterator[None]:
    """Make ``stream`` the current stream of its device for the block."""
    if not isinstance(stream, torch.cuda.Stream):
        yield
        return
    with torch.cuda.stream(stream):
        yield


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """``source`` waits for the work queued on ``target`` so far (an event, no host sync)."""
    if isinstance(source, torch.cuda.Stream) and isinstance(target, torch.cuda.Stream):
        source.wait_stream(target)


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Keep ``tensor``'s memory from reuse until the work queued on ``stream`` is done."""
    if isinstance(stream, torch.cuda.Stream) and tensor.is_cuda:
        tensor.record_stream(stream)


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """Page-locked copy of a CPU tensor when CUDA is available (so copies can be asynchronous)."""
    if tensor.device.type == "cpu" and torch.cuda.is_available() and not tensor.is_pinned():
        return tensor.pin_memory()
    return tensor


def to_device(
    tensor: torch.Tensor, device: torch.device, copy_stream: AbstractStream, compute: AbstractStream
) -> torch.Tensor:
    """Copy a (pinned) host tensor to ``device`` on ``copy_stream``, ordered before ``compute``.

    The copy is ``non_blocking``; ``compute`` waits for it with an event and the
    result is recorded on ``compute`` since it was allocated on ``copy_stream``.
    """
    if tensor.device == device:
        return tensor
    if not isinstance(copy_stream, torch.cuda.Stream):
        return tensor.to(device)
    with use_stream(copy_stream):
        out = tensor.to(device, non_blocking=True)
    wait_stream(compute, copy_stream)
    record_stream(out, compute)
    return out
