"""A strict NCCL emulation on gloo: the runtime's NCCL code path, run on CPU, failing where NCCL would.

    STAGEWISE_EMULATE_NCCL=1   (set in every rank; read when a Pipeline's Comm is made)

With it set on a gloo process group, ``Comm`` takes its NCCL code path wherever
it would on NCCL (channels per ordered rank pair, one posted group per message,
stream ordering on every receive, polled collectives) with gloo underneath,
and makes NCCL's and CUDA's rules observable on CPU, at least as strictly:

groups      a posted group completes only when every op in it is matched (its
            waits wait for all of them), as an NCCL group does;
devices     the step runs with ``torch.set_default_device("meta")`` in force
            (``strict_devices``), so a tensor made without an explicit device is
            a meta tensor, which the runtime's device guard refuses, as NCCL
            would a CPU tensor;
asynchrony  a receive lands in a staging buffer; the buffer compute reads holds
            poison (NaN, or an out-of-range integer) until the default stream,
            on which compute runs, is ordered after the transfer (directly, or
            through another stream or an event). A missing ordering gives wrong
            numbers, never silently right ones:

    channel q -> r   [recv -> staging]
                                     \\  order(default, transfer): staging -> buffer
    default stream   [F0] ............ [F1 reads buffer]      (no order: F1 reads NaN)

communicators  NCCL makes a group's communicator at the group's first operation,
            a blocking rendezvous of all its ranks, outside any timeout of ours: a
            first operation that is a point-to-point between two of three or more
            ranks waits forever for the others, and one inside a step hangs there if
            a peer died before it. Both raise here (``first_use``, ``stepping``); a
            collective on the group, which every rank takes part in, makes the
            communicator, as does each channel's first message at construction
            (``Comm``). The creation itself is that rendezvous here too: each
            rank waits for all, watched by none of the pipeline's waits (arrival.py
            keeps a dead peer from being waited for there, and its creation guard
            ends a rank whose peer dies inside it).

connections  A communicator's connections are made apart from it, each a blocking
            handshake with peers inside the ``dist.*`` call that first needs it:
            a collective algorithm's (ring, tree ...) when the communicator is
            made if ``NCCL_RUNTIME_CONNECT=0`` (what ``import pipeline`` sets,
            nccl_env.py), else at the first collective that picks it, by size;
            a pair's point-to-point connection at the first message between the
            two, at any setting. So inside a step or another call after
            construction (``stepping``: step, evaluate, predict, the optimizer
            step's companions, gather_state_dict, checkpointing) a collective on
            a communicator made without ``NCCL_RUNTIME_CONNECT=0`` raises
            (``collective``: no warm-up proves the algorithm a later size picks
            connected), and so does a message between two ranks that none
            exchanged on that group before (``message``). The variable is read
            as each communicator is made (NCCL reads it once per process, at the
            first: one process here can test both). What torch posts itself
            (checkpointing's collectives, gathers of Python objects) is declared
            before it runs (``uses``) and checked the same way.

Host-to-device copies of the inputs (``copy``) are emulated the same way: the
copy reads as poison until compute is ordered after the copy stream it was
queued on (a prefetched batch used without that ordering gives NaN).

Sent tensors and receive buffers must not be written while a transfer is in
flight (CUDA would race): a write is detected through the tensor's version
counter and raises.

The stand-in streams and events here are what ``stream.py`` hands out under
the emulation; compute runs on the current stream (``DEFAULT``, the device's default stream, unless
``use`` made another current, as ``torch.cuda.stream(s)`` would).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "DEFAULT",
    "ENV",
    "EmuEvent",
    "EmuStream",
    "EmuTransfer",
    "collective",
    "connects_eagerly",
    "copy",
    "current",
    "enabled",
    "first_use",
    "message",
    "order",
    "poison",
    "record_event",
    "stepping",
    "strict_devices",
    "use",
    "uses",
    "wait_event",
    "wait_stream",
]

ENV = "STAGEWISE_EMULATE_NCCL"


def enabled() -> bool:
    """True when this process runs the NCCL code path on gloo (``STAGEWISE_EMULATE_NCCL`` set, not 0)."""
    return os.environ.get(ENV, "").strip() not in ("", "0")


_CREATED = "stagewise/emulated_nccl_comm"  # in a group's store: its ranks at the communicator's creation
_made: set[int] = set()  # ids of the groups whose communicator exists (groups live as long as the job)


_in_step = [False]  # whether this process is inside a step (``stepping``)
RUNTIME_CONNECT = "NCCL_RUNTIME_CONNECT"  # nccl_env.VAR: how NCCL connects (see ``connections`` above)
_connect_mode: dict[int, str | None] = {}  # group id -> NCCL_RUNTIME_CONNECT when its communicator was made
_pairs: set[tuple[int, int, int]] = set()  # (group id, sender, receiver: global ranks) connected


@contextlib.contextmanager
def stepping() -> Iterator[None]:
    """The inside of a step (or another call after construction): no communicator may be made or
    connected here. Nests (a call inside a call)."""
    outer, _in_step[0] = _in_step[0], True
    try:
        yield
    finally:
        _in_step[0] = outer


def first_use(group: Any, size: int, taking_part: int, what: str) -> None:
    """A point-to-point on ``group`` (``size`` ranks) that ``taking_part`` of them take part in: if
    it is the group's first operation, NCCL would make the communicator here and wait for all."""
    if id(group) in _made:
        return
    if _in_step[0]:
        raise RuntimeError(
            f"NCCL emulation: {what} would be the first operation on its group, inside a step (or another "
            "call after construction): NCCL "
            "would make the group's communicator here, a blocking rendezvous outside the pipeline's "
            "timeout and failure watch; make every communicator at construction"
        )
    if taking_part < size:
        raise RuntimeError(
            f"NCCL emulation: {what} would be the first operation on a group of {size} ranks and only "
            f"{taking_part} take part; NCCL makes a group's communicator at its first operation, with "
            "every rank of the group, so the others never come and this hangs on GPUs. Run a "
            "collective on every rank of the group first (Comm makes its group's at construction)"
        )
    _rendezvous(group, size, what)
    _made.add(id(group))
    _connect_mode[id(group)] = os.environ.get(RUNTIME_CONNECT)  # read as NCCL does, when it makes one


def connects_eagerly(mode: str | None) -> bool:
    """Whether a communicator made with ``NCCL_RUNTIME_CONNECT`` = ``mode`` connected every collective
    algorithm then (0), not at each one's first use (1, or unset: NCCL's default since 2.22)."""
    return mode is not None and mode.strip() == "0"


def collective(group: Any, size: int, what: str) -> None:
    """A collective on ``group`` (``size`` ranks, all taking part): it makes the communicator if it
    is the group's first operation (``first_use``); inside a call, its algorithm must have been
    connected when the communicator was made (``NCCL_RUNTIME_CONNECT=0``)."""
    first_use(group, size, size, what)
    mode = _connect_mode.get(id(group))
    if _in_step[0] and not connects_eagerly(mode):
        shown = "unset" if mode is None else f"{mode!r}"
        raise RuntimeError(
            f"NCCL emulation: {what} is a collective inside a step (or another call after construction) "
            f"on a communicator made with {RUNTIME_CONNECT} {shown}: NCCL (2.22 and later) then connects "
            "the algorithm it picks for this call (ring, tree, NVLS ..., by message size) here, a "
            "blocking handshake outside the pipeline's timeout and failure watch, which no warm-up at "
            f"construction can prove done for every size; set {RUNTIME_CONNECT}=0 in every rank's "
            "environment before its first NCCL communicator (import pipeline does when it is unset)"
        )


def message(group: Any, size: int, src: int, dst: int, what: str) -> None:
    """One message from global rank ``src`` to ``dst`` on ``group`` (``size`` ranks): the group's
    first operation makes the communicator (``first_use``, with these two alone); the pair's first
    message connects them, which inside a call raises: NCCL connects a pair at its first message, at
    any ``NCCL_RUNTIME_CONNECT``."""
    first_use(group, size, 2, what)
    key = (id(group), src, dst)
    if key in _pairs:
        return
    if _in_step[0]:
        raise RuntimeError(
            f"NCCL emulation: {what} would be the first message from rank {src} to rank {dst} on its "
            "group, inside a step (or another call after construction): NCCL connects the pair here "
            "(at any NCCL_RUNTIME_CONNECT), a blocking handshake with the peer outside the pipeline's "
            "timeout and failure watch; send one message per pair that a call uses at construction"
        )
    _pairs.add(key)


def uses(group: Any, size: int, me: int, what: str, pairs: Iterable[tuple[int, int]] = ()) -> None:
    """Operations torch posts itself on ``group`` (``size`` ranks; this process is global rank
    ``me``): collectives, and messages between the ``pairs`` of global ranks (sender, receiver) this
    rank is an end of, each checked as if posted here (``collective``, ``message``)."""
    collective(group, size, what)
    for src, dst in pairs:
        if me in (src, dst):
            message(group, size, src, dst, f"{what} (rank {src} -> rank {dst})")


def _rendezvous(group: Any, size: int, what: str) -> None:
    """NCCL's communicator creation: each of the group's ``size`` ranks waits here for all of them,
    and nothing of the pipeline's watches that wait (no failure key, no liveness, no timeout of ours:
    only the group's own). Only arrival.py's creation guard, a thread and a process apart from the
    wait, ends a rank whose peer died before or inside it."""
    from torch.distributed import distributed_c10d as c10d

    store = c10d._world.pg_map[group][1]  # the group's own prefix of the job's store
    try:
        bound = float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:
        bound = 1800.0
    start = time.monotonic()
    store.add(_CREATED, 1)
    while int(store.add(_CREATED, 0)) < size:
        if time.monotonic() - start > bound:
            raise RuntimeError(
                f"NCCL emulation: {what} made its group's communicator, a rendezvous of the group's "
                f"{size} ranks that waited {bound:g} s for the others: on GPUs NCCL waits here for good, "
                "outside the pipeline's timeout and failure watch, and names no rank"
            )
        time.sleep(0.002)


def strict_devices(active: bool) -> contextlib.AbstractContextManager[Any]:
    """The step's device rule under the emulation: the default device is meta."""
    return torch.device("meta") if active else contextlib.nullcontext()


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` with what a read before the transfer must not mistake for data."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype is torch.bool:
        t.fill_(True)
    else:  # the most negative value: an index out of any range
        t.fill_(torch.iinfo(t.dtype).min)


class EmuTransfer:
    """One posted group on gloo: ``works`` (every op's), the tensors it sends, the buffers it fills.

    ``received`` holds (buffer compute reads, staging buffer gloo fills) pairs;
    the buffer is poisoned here and filled only by ``materialize``.
    """

    __slots__ = ("done", "received", "sent", "visible", "what", "works")

    def __init__(
        self,
        works: list[Any],
        sent: Sequence[torch.Tensor],
        received: Sequence[tuple[torch.Tensor, torch.Tensor]],
        what: str,
    ) -> None:
        self.works, self.what = works, what
        for buf, _ in received:
            poison(buf)
        self.sent = [(t, t._version) for t in sent]
        self.received = [(buf, staging, buf._version) for buf, staging in received]
        self.done = False
        self.visible = not received

    def is_completed(self) -> bool:
        return self.done

    def complete(self, wait: Callable[[list[Any]], None]) -> None:
        """Wait (``wait`` bounds it) for every op of the group, then check the sent tensors."""
        if self.done:
            return
        wait(self.works)
        self.done, self.works = True, []
        for t, version in self.sent:
            if t._version != version:
                raise RuntimeError(
                    f"a tensor sent for {self.what} was modified in place while the send was in "
                    "flight; on NCCL the peer could receive the modified values: do not write to a "
                    "stage's output after returning it"
                )
        self.sent = []

    def materialize(self) -> None:
        """Make the received data visible to compute: the default stream is ordered after it."""
        if self.visible:
            return
        if not self.done:
            raise RuntimeError(f"{self.what}: ordered a stream after a transfer that was not waited for")
        for buf, staging, version in self.received:
            if buf._version != version:
                raise RuntimeError(
                    f"the receive buffer of {self.what} was written before its transfer was ordered; "
                    "on CUDA the transfer could overwrite it"
                )
            buf.copy_(staging)
        self.received, self.visible = [], True


class EmuStream:
    """A CUDA stream stand-in: the completed transfers it is ordered after that compute cannot see yet."""

    __slots__ = ("after", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.after: set[EmuTransfer] = set()

    def __repr__(self) -> str:
        return f"EmuStream({self.name!r})"


class EmuEvent:
    """A CUDA event stand-in: what its stream was ordered after when it was recorded."""

    __slots__ = ("after",)

    def __init__(self, after: Iterable[EmuTransfer]) -> None:
        self.after = frozenset(after)


DEFAULT = EmuStream("default")
_current: list[EmuStream] = [DEFAULT]


def current() -> EmuStream:
    return _current[-1]


@contextlib.contextmanager
def use(stream: EmuStream) -> Iterator[None]:
    _current.append(stream)
    try:
        yield
    finally:
        _current.pop()


def order(stream: EmuStream, transfers: Iterable[EmuTransfer]) -> None:
    """``stream`` runs on only after ``transfers`` (each completed); ordered onto the stream that is
    current (where compute runs: ``DEFAULT`` unless the caller made another current), they become visible."""
    if stream is current():
        for t in transfers:
            t.materialize()
    else:
        stream.after.update(t for t in transfers if not t.visible)


def copy(tensor: torch.Tensor, stream: EmuStream) -> torch.Tensor:
    """An emulated host-to-device copy of ``tensor`` queued on ``stream``: poison until compute is
    ordered after it. The source is snapshotted, as a pinned staging copy would be."""
    out = torch.empty_like(tensor)
    shape = "x".join(map(str, tensor.shape)) or "scalar"
    what = f"the host-to-device copy of a {shape} input"
    done = EmuTransfer([], [], [(out, tensor.detach().clone())], what)
    done.done = True
    stream.after = {t for t in stream.after if not t.visible}  # forget what is visible already
    stream.after.add(done)
    return out


def wait_stream(waiter: EmuStream, target: EmuStream) -> None:
    order(waiter, list(target.after))


def record_event(stream: EmuStream) -> EmuEvent:
    stream.after = {t for t in stream.after if not t.visible}
    return EmuEvent(stream.after)


def wait_event(stream: EmuStream, event: EmuEvent) -> None:
    order(stream, event.after)
