"""CUDA streams and events behind one small interface, with stand-ins for CPU and the NCCL emulation.

On a GPU the executor uses two streams of its own: compute (the device's
current stream) and a copy stream for host-to-device copies of micro-batches
from pinned memory. Transfers run on the NCCL channels' internal streams; a
receive is consumed only after the compute stream has been ordered after it
(``Comm.order``). Streams are ordered with events (``wait_stream``), and a
tensor made on one stream but used on another is marked with
``record_stream`` so that the caching allocator does not hand its memory out
again before the other stream is done with it::

    copy stream      [H2D mb0][H2D mb1] ...
                           \\ event
    compute stream          [F mb0 ......] wait(recv) [F mb1 ......]
                                         \\              /
    channel r -> q                        [send mb0]    /
    channel q -> r                           [recv from q]

A batch can be copied ahead of its step (``Pipeline.step(..., prefetch=...)``):
``start_copy`` queues the copy on the copy stream and an event is recorded
after it; only when the batch is used is compute made to wait for that event,
so the copy overlaps the compute queued in between (the current step's):

    copy stream      [H2D batch t+1] . event
    compute stream   [step t ..........] wait(event) [step t+1 ...]

On plain CPU every call here is a no-op on the ``CPUStream`` stand-in; under
the NCCL emulation (``emulated=True``) streams and events are emulation.py's
stand-ins, which make a missing ordering visible (a copy made there reads as
poison until compute is ordered after it). The same executor code runs on all
three.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pipeline.runtime.comm import emulation
from pipeline.runtime.comm.emulation import EmuEvent, EmuStream

__all__ = [
    "AbstractStream",
    "CPUStream",
    "Event",
    "current_stream",
    "default_stream",
    "event_done",
    "is_cuda",
    "new_stream",
    "pin",
    "record_event",
    "record_stream",
    "start_copy",
    "to_device",
    "use_stream",
    "wait_event",
    "wait_stream",
]


class CPUStreamType:
    """The stand-in stream of the CPU: everything on it is already ordered."""

    def __repr__(self) -> str:
        return "CPUStream"


CPUStream = CPUStreamType()
AbstractStream = torch.cuda.Stream | CPUStreamType | EmuStream
# a recorded point on a stream: None on plain CPU (always passed)
Event = torch.cuda.Event | EmuEvent | None


def new_stream(device: torch.device, emulated: bool = False, name: str = "side") -> AbstractStream:
    if device.type == "cuda":
        return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return EmuStream(name) if emulated else CPUStream


def current_stream(device: torch.device, emulated: bool = False) -> AbstractStream:
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return emulation.current() if emulated else CPUStream


def default_stream(device: torch.device, emulated: bool = False) -> AbstractStream:
    if device.type == "cuda":
        return torch.cuda.default_stream(device)
    return emulation.DEFAULT if emulated else CPUStream


def is_cuda(stream: AbstractStream) -> bool:
    return isinstance(stream, torch.cuda.Stream)


@contextlib.contextmanager
def use_stream(stream: AbstractStream) -> Iterator[None]:
    """Make ``stream`` the current stream of its device for the block."""
    if isinstance(stream, torch.cuda.Stream):
        with torch.cuda.stream(stream):
            yield
    elif isinstance(stream, EmuStream):
        with emulation.use(stream):
            yield
    else:
        yield


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """``source`` waits for the work queued on ``target`` so far (an event, no host sync)."""
    if isinstance(source, torch.cuda.Stream) and isinstance(target, torch.cuda.Stream):
        source.wait_stream(target)
    elif isinstance(source, EmuStream) and isinstance(target, EmuStream):
        emulation.wait_stream(source, target)


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Keep ``tensor``'s memory from reuse until the work queued on ``stream`` is done."""
    if isinstance(stream, torch.cuda.Stream) and tensor.is_cuda:
        tensor.record_stream(stream)


def record_event(stream: AbstractStream, timing: bool = False) -> Event:
    """A point on ``stream`` after the work queued so far."""
    if isinstance(stream, torch.cuda.Stream):
        event = torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]
        event.record(stream)
        return event
    if isinstance(stream, EmuStream):
        return emulation.record_event(stream)
    return None


def wait_event(stream: AbstractStream, event: Event) -> None:
    """``stream`` runs on only after ``event`` has passed (no host sync)."""
    if isinstance(stream, torch.cuda.Stream) and isinstance(event, torch.cuda.Event):
        stream.wait_event(event)
    elif isinstance(stream, EmuStream) and isinstance(event, EmuEvent):
        emulation.wait_event(stream, event)


def event_done(event: Event) -> bool:
    """Whether the device has passed ``event`` (host-side query, never blocks)."""
    if isinstance(event, torch.cuda.Event):
        return bool(event.query())  # type: ignore[no-untyped-call]
    return True  # CPU and the emulation run everything before the host moves on


def pin(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Page-locked copy of a CPU tensor bound for a CUDA ``device`` (so its copy can be asynchronous).

    For any other target (or none given) it returns ``tensor``: a CPU run on a
    GPU host never touches CUDA.
    """
    if (
        device is not None
        and device.type == "cuda"
        and tensor.device.type == "cpu"
        and not tensor.is_pinned()
    ):
        return tensor.pin_memory()
    return tensor


def from_host(data: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` without a host synchronisation.

    On CUDA ``torch.tensor(list, device=cuda)`` copies from pageable memory, which
    blocks the host until the stream drains: a step that does so for a header, a
    flag or a loss weight waits for all its queued work. Here the values go
    through a pinned buffer and a ``non_blocking`` copy on the current stream;
    the caching host allocator keeps that buffer until the copy is done.
    """
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def start_copy(tensor: torch.Tensor, device: torch.device, copy_stream: AbstractStream) -> torch.Tensor:
    """Queue a (pinned) host tensor's copy to ``device`` on ``copy_stream``; no other stream is ordered
    after it yet (``wait_event`` / ``wait_stream`` do that, ``record_stream`` marks its use there).

    A tensor already on ``device`` is returned as it is, except under the emulation,
    where every input is copied as from a host, so that a missing ordering shows.
    """
    if isinstance(copy_stream, EmuStream):
        return emulation.copy(tensor, copy_stream)
    if tensor.device == device:
        return tensor
    if not isinstance(copy_stream, torch.cuda.Stream):
        return tensor.to(device)
    with use_stream(copy_stream):
        return tensor.to(device, non_blocking=True)


def to_device(
    tensor: torch.Tensor, device: torch.device, copy_stream: AbstractStream, compute: AbstractStream
) -> torch.Tensor:
    """Copy a (pinned) host tensor to ``device`` on ``copy_stream``, ordered before ``compute``.

    The copy is ``non_blocking``; ``compute`` waits for it with an event and the
    result is recorded on ``compute`` since it was allocated on ``copy_stream``.
    """
    out = start_copy(tensor, device, copy_stream)
    if out is not tensor:
        wait_stream(compute, copy_stream)
        record_stream(out, compute)
    return out
