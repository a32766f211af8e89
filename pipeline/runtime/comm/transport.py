"""How one rank's messages travel and are waited for: one class per posting path, chosen once.

    # r: this rank, q: a peer rank

``Comm`` picks its transport when it is made (``transport_class``) and from then
on only delegates; no posting or waiting code asks which backend it runs on:

    backend (STAGEWISE_EMULATE_NCCL)   class          device   post                  order / wait
    gloo (or another host backend)     GlooTransport  cpu      each tensor straight  the host waits
                                                               to the gloo backend   (it is the stream)
    nccl                               NcclTransport  cuda:i   one group per         order: the stream waits
                                                               message, on its       on the device, the host
                                                               channel (channels.py) goes on; wait: polls
    gloo, emulation on (=1)            EmulatedNccl   cpu      as NCCL, gloo         the host waits, then the
                                                               underneath            stream is ordered after

The communication device. Every tensor handed to the process group (headers,
receive buffers, the loss, flags, norms) is made on the transport's ``device``
(NCCL: this rank's CUDA device; gloo and the emulation: the CPU), and every
tensor posted is checked first (``check``): a fake, meta or wrong-device
tensor, or on the NCCL path (emulated too) a non-contiguous one or a dtype NCCL
cannot send, is refused with a ValueError naming it, before it can reach the
backend (where it would be a native crash or a silent hang).

gloo posts each tensor with the backend's own ``send`` / ``recv`` (group-local
ranks, no Python wrappers). The NCCL path posts each message as one group on
its channel (one two-rank group per direction, so that no direction or
collective waits on another; a group without channels, on the group itself:
the world's first messages, world.py); ``order(works, stream)`` makes the consuming
stream wait for the transfer on the device. ``STAGEWISE_EMULATE_NCCL=1`` on a
gloo group takes the NCCL path on gloo, with NCCL's rules made strict
(emulation.py).

Never hang. Every wait on another process is bounded by ``timeout``, which
stays below the process group's own (a larger one is clamped to 90% of it, and
the error says so), so the error names the rank and action, not a backend
watchdog::

    wait(works) --- done ------------------------------------------> return
        |--- past the timeout -----------------------------------> PipelineTimeout(rank r, what)
        |--- failure key set (every 50 ms / the watchdog) ---------> PeerFailure(rank q failed ...)
        '--- connection or store lost: q's process gone? ----------> PeerFailure(q's process is gone)
                                        else (1 s for q's publish) -> RuntimeError(r, what, the cause)

A failure anywhere reaches every rank within a fraction of a second: the
failing rank publishes it on the failure board (board.py; only the first
failure is kept, so every rank names the root cause); a rank blocked in gloo
(``host_wait``: gloo and the emulation) is woken by its watchdog thread
(watchdog.py); a rank polling (``poll``: NCCL) reads the key at most every
50 ms. A rank that dies without a word is named by the peer that notices (its
process is gone: see watchdog.py), not that peer's own lost connection. After
a failure the transport is aborted (``abort``: the channels, on NCCL also the
group), so that transfers in flight stop and exit never hangs; the group is
then unusable, as after any failure.

What gloo does (measured, torch 2.13): ``is_completed()`` of a point-to-point
work stays False until ``wait()`` is called, so the host cannot poll it;
``wait(timeout)`` on expiry closes the connection to the peer; a send
completes only once the peer has posted its receive.
"""

from __future__ import annotations

import datetime
import os
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NoReturn

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from pipeline.runtime.comm import emulation
from pipeline.runtime.comm.board import FailureBoard
from pipeline.runtime.comm.channels import Channels, Op, Transfer, abort_nccl, post_ops
from pipeline.runtime.comm.emulation import EmuStream, EmuTransfer
from pipeline.runtime.comm.watchdog import CHECK_STORE_S, PeerFailure, PipelineTimeout, Watchdog

__all__ = [
    "CLAMP",
    "NCCL_DTYPES",
    "EmulatedNccl",
    "Entries",
    "GlooTransport",
    "NcclTransport",
    "Transport",
    "backend_timeout",
    "process_group",
    "transport_class",
]

# how long a rank that lost a connection waits for the failed peer's published reason
_LOST_GRACE_S = 1.0
CLAMP = 0.9  # the pipeline's timeout at most this share of the process group's
NCCL_DTYPES = frozenset(
    {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
     torch.int8, torch.uint8, torch.bool}
)  # fmt: skip

# a posted block: per entry (tensors, group-local peer rank)
Entries = Sequence[tuple[Sequence[torch.Tensor], int]]


def process_group(group: Any) -> Any:
    """``group``'s process group object (None: the default group)."""
    from torch.distributed import distributed_c10d as c10d

    return group if group is not None else c10d._get_default_group()


def backend_timeout(group: Any, device: torch.device) -> float | None:
    """The process group's own timeout in seconds, when the backend tells it."""
    try:
        return float(process_group(group)._get_backend(device).options._timeout.total_seconds())
    except Exception:
        return None


def _nccl_device() -> torch.device:
    """This rank's CUDA device on NCCL: the current one, which must be LOCAL_RANK's under torchrun
    (otherwise every rank of a node would pick GPU 0 and NCCL would fail on the duplicate)."""
    current = torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK")
    own = int(local) if local is not None and local.isdigit() else current
    if own != current and own < torch.cuda.device_count():
        raise ValueError(
            f"LOCAL_RANK is {local} but the current CUDA device is cuda:{current}: call "
            f"torch.cuda.set_device({local}) before building the Pipeline (pipeline.init_distributed() "
            "does it), so that each rank of a node uses its own GPU"
        )
    return torch.device("cuda", current)


def _fmt(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"


def transport_class(backend: str) -> type[Transport]:
    """The posting path for a group of ``backend`` (``dist.get_backend``), the emulation's switch read."""
    if emulation.enabled() and backend != "gloo":
        raise ValueError(
            f"{emulation.ENV} runs the NCCL code path on a gloo process group, but this group's "
            f"backend is {backend!r}: unset {emulation.ENV} or initialise with gloo"
        )
    if emulation.enabled():
        return EmulatedNccl
    return NcclTransport if backend == "nccl" else GlooTransport


class Transport(ABC):
    """One rank's posting path in ``group``: posts, orders and waits, every wait bounded by
    ``timeout`` and watching ``board``; ``me``: this rank as errors name it.

    The class says what is fixed by the path (``nccl``, ``emulated``, ``channel_backend``,
    ``device_for``); an instance is made once the failure board exists (``Comm``).
    """

    nccl: ClassVar[bool] = False  # the NCCL code path (NCCL, or its emulation)
    emulated: ClassVar[bool] = False
    channel_backend: ClassVar[str | None] = None  # the backend of its channels (channels.py); None: none

    def __init__(
        self,
        group: Any,
        rank: int,
        me: int,
        device: torch.device,
        board: FailureBoard,
        channels: Channels | None,
        timeout: float,
        pg_timeout: float | None,
    ) -> None:
        self.group, self.me, self.device, self.board, self.channels = group, me, device, board, channels
        self.backend = "nccl-emulated" if self.emulated else dist.get_backend(group)  # as errors name it
        self.liveness = board.liveness
        self.requested_timeout, self.pg_timeout = timeout, pg_timeout
        clamp = pg_timeout is not None and timeout >= pg_timeout
        self.timeout = CLAMP * pg_timeout if clamp and pg_timeout else timeout
        # on the host (gloo, the emulation): the group's gloo backend, where gloo posts and whose pairs
        # the watchdog closes
        on_host = device.type != "cuda"
        self._be: Any = process_group(group)._get_backend(torch.device("cpu")) if on_host else None
        pairs: list[tuple[Any, int]] = []
        if self._be is not None:
            pairs = [(self._be, q) for q in range(dist.get_world_size(group)) if q != rank]
        pairs += channels.pairs() if channels is not None else []
        self._watchdog = Watchdog(board.store, board.key, pairs, self.liveness)
        # at close() or when collected; the callback must not hold self, or self would never be collected
        self._close = weakref.finalize(self, self._watchdog.close)
        self._aborted = False

    @classmethod
    def device_for(cls) -> torch.device:
        """The communication device of this path."""
        return torch.device("cpu")

    # ---- tensors and state

    def check(self, t: torch.Tensor, what: str) -> None:
        """Refuse what the backend cannot take: fake, meta or other-device tensors."""
        if isinstance(t, FakeTensor):
            raise ValueError(
                f"rank {self.me}: {what} was handed a fake tensor ({_fmt(t)}); fake tensors hold no "
                "data, so nothing would move and the peer would wait: run the step outside "
                "FakeTensorMode and keep fake values out of the model"
            )
        if t.device != self.device:
            hint = (
                "it was made without an explicit device while the default device was meta (the NCCL "
                "emulation runs each step so, to catch such tensors as NCCL catches CPU ones): pass "
                "device= to the factory"
                if t.is_meta
                else f"make it on {self.device} (Comm.empty / zeros / tensor) or move it there"
            )
            raise ValueError(
                f"rank {self.me}: {what} was handed a tensor on {t.device} ({_fmt(t)}), but this "
                f"pipeline's {self.backend} communication runs on {self.device}; {hint}"
            )

    def check_open(self, what: str) -> None:
        """Refuse to post after ``close()``."""
        if not self._close.alive:
            raise RuntimeError(
                f"rank {self.me}: cannot post {what}: this pipeline's communication was closed "
                "(Pipeline.close()); build a new Pipeline"
            )

    def close(self) -> None:
        """Stop the watchdog thread; later posts raise. Idempotent."""
        self._close()

    # ---- what each path does

    def post(self, sends: Entries, recvs: Entries, what: str) -> list[list[Any]]:
        """Post every entry's tensors (``recvs`` fill theirs); the works per entry, sends first."""
        self.check_open(what)
        for entries in (sends, recvs):
            for tensors, _ in entries:
                for t in tensors:
                    self.check(t, what)
        try:
            return self._post(sends, recvs, what)
        except Exception as exc:  # a peer that is gone already
            self.fail(what, exc)

    @abstractmethod
    def _post(self, sends: Entries, recvs: Entries, what: str) -> list[list[Any]]: ...

    @abstractmethod
    def order(self, works: Sequence[Any], stream: Any, what: str) -> None:
        """``stream`` runs past this point only once ``works`` are done (``what`` names them for errors)."""

    @abstractmethod
    def wait(self, works: Sequence[Any], what: str) -> None:
        """Block the host until ``works`` are done; what follows on the current stream sees their data."""

    @abstractmethod
    def finish(self, work: Any, what: str) -> None:
        """Wait for a started collective like a receive: the timeout and the failure watch."""

    def before_collective(self, size: int, what: str) -> None:
        """Called as a collective on the group (``size`` ranks, all taking part) is started."""
        return None

    def drain(self, works: Sequence[Any], what: str) -> None:
        """Block the host until ``works`` are done, ordering no stream after them: what a device-wide
        synchronisation waits for (drain.py). On gloo, a host wait."""
        self.wait(works, what)

    @abstractmethod
    def abort(self) -> None:
        """Stop every transfer in flight. Idempotent."""

    # ---- the waits every path shares

    def host_wait(self, works: Sequence[Any], what: str) -> None:
        """gloo: the blocking ``wait(timeout)`` (it releases the GIL), with the watchdog awake."""
        dog = self._watchdog
        if dog.thread is None:
            dog.start()
        dog.blocked += 1
        try:
            deadline = time.monotonic() + self.timeout
            for w in works:
                left = deadline - time.monotonic()
                if left <= 0 or not w.wait(datetime.timedelta(seconds=left)):
                    raise self.error(what) from None
        except (PeerFailure, PipelineTimeout):
            raise
        except Exception as exc:
            self.fail(what, exc)
        finally:
            dog.blocked -= 1

    def poll(self, done: Callable[[], bool], what: Callable[[], str]) -> None:
        """Wait for ``done()`` without blocking in the backend, with the timeout and failure watch (50 ms)."""
        if done():
            return
        start = now = time.monotonic()
        check_at, nap = now + CHECK_STORE_S, 2e-5
        while not done():
            now = time.monotonic()
            if now - start > self.timeout:
                raise self.error(what()) from None
            if now >= check_at:
                check_at = now + CHECK_STORE_S
                if self.board.first() is not None:
                    raise self.error(what()) from None
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)

    def fail(self, what: str, exc: BaseException) -> NoReturn:
        """Raise the error for ``what`` where the backend raised ``exc``: another rank's failure alone
        (``exc`` is then only its echo, a closed connection: a dozen lines of noise in every
        surviving rank's output), any other error with ``exc`` as its cause."""
        err, echo = self._judge(what, exc)
        try:
            if echo:
                raise err from None
            raise err from exc
        finally:
            del err  # its traceback holds this frame: a cycle that would keep the Pipeline alive

    def error(self, what: str) -> Exception:
        """The error to raise (``raise self.error(what) from None``) where a wait ended with no backend
        error (``fail`` where it raised one): the failed peer named, else the lost store or our
        timeout."""
        return self._judge(what, None)[0]

    def _judge(self, what: str, exc: BaseException | None) -> tuple[Exception, bool]:
        """The error for ``what`` (the backend's ``exc``, None if none), and whether ``exc`` is only
        the echo of another rank's failure."""
        timed_out = exc is None or "Timed out" in str(exc)
        failed = self.board.first()
        deadline = time.monotonic() + _LOST_GRACE_S
        # a lost connection (or store): a peer whose process is gone is the cause; else give the
        # failed peer's publish a moment to land
        while failed is None and (not timed_out or self.liveness.store_gone):
            failed = self.board.blame_dead()
            if failed is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
            failed = self.board.first()
        if failed is not None:
            q, message = failed
            if q != self.me:
                self.abort()
            named = PeerFailure(f"rank {q} failed while rank {self.me} waited for {what}: {message}")
            return named, q != self.me
        if self.liveness.store_gone:
            return RuntimeError(
                f"rank {self.me}: lost the store while waiting for {what} (the process that served it "
                f"died, or the launcher is tearing the job down): {exc}"
            ), False
        if not timed_out:
            return RuntimeError(f"rank {self.me}: error while waiting for {what}: {exc}"), False
        note = ""
        if self.timeout != self.requested_timeout:
            note = (
                f" (the pipeline's timeout of {self.requested_timeout:g} s, clamped to "
                f"{CLAMP:.0%} of the process group's {self.pg_timeout:g} s so that it fires first)"
            )
        return PipelineTimeout(
            f"rank {self.me} timed out after {self.timeout:.1f} s{note} waiting for {what}"
        ), False


class GlooTransport(Transport):
    """Each tensor straight to the group's gloo backend; the host is the stream, so every order
    and wait is a blocking host wait."""

    def _post(self, sends: Entries, recvs: Entries, what: str) -> list[list[Any]]:
        be = self._be
        out = [[be.send([t], q, 0) for t in tensors] for tensors, q in sends]
        out += [[be.recv([t], q, 0) for t in tensors] for tensors, q in recvs]
        return out

    def order(self, works: Sequence[Any], stream: Any, what: str) -> None:
        if works:
            self.host_wait(works, what)

    def wait(self, works: Sequence[Any], what: str) -> None:
        if works:
            self.host_wait(works, what)

    def finish(self, work: Any, what: str) -> None:
        self.host_wait([work], what)

    def abort(self) -> None:
        """Nothing to stop: no channels, and the watchdog closes the group's pairs."""


class NcclTransport(Transport):
    """Each message as one group on its channel; the consuming stream waits on the device, the
    host goes on; host waits poll with the timeout and failure watch."""

    nccl = True
    channel_backend = "nccl"

    @classmethod
    def device_for(cls) -> torch.device:
        return _nccl_device()

    def check(self, t: torch.Tensor, what: str) -> None:
        """As every path, and what NCCL refuses: non-contiguous tensors (gloo copies them), its dtypes."""
        super().check(t, what)
        if not t.is_contiguous():  # ProcessGroupNCCL refuses them; gloo copies them
            raise ValueError(
                f"rank {self.me}: {what} was handed a non-contiguous tensor ({_fmt(t)}, strides "
                f"{tuple(t.stride())}), which NCCL refuses; pass t.contiguous() (or a copy in a "
                "contiguous buffer)"
            )
        if t.dtype not in NCCL_DTYPES:
            raise ValueError(
                f"rank {self.me}: {what} was handed a {str(t.dtype).replace('torch.', '')} tensor "
                f"({_fmt(t)}), which NCCL cannot send or receive; use one of "
                f"{sorted(str(d).replace('torch.', '') for d in NCCL_DTYPES)} between stages"
            )

    def _post(self, sends: Entries, recvs: Entries, what: str) -> list[list[Any]]:
        ch = self.channels
        post: Callable[[list[Op], str], Any] = ch.post if ch is not None else self._post_on_group
        out = [[post([(t, q, True) for t in ts], what)] if ts else [] for ts, q in sends]
        out += [[post([(t, q, False) for t in ts], what)] if ts else [] for ts, q in recvs]
        return out

    def _post_on_group(self, ops: list[Op], what: str) -> Any:
        """A collectives-only group's messages (no channels: the world's first ones, world.py) go on
        the group itself, one batch each, as a pipeline's between non-neighbours do."""
        pg = process_group(self.group)
        glob = [(t, q, dist.get_global_rank(pg, q) if self.group is not None else q, s) for t, q, s in ops]
        return post_ops(pg, glob, what, self.emulated)

    def order(self, works: Sequence[Any], stream: Any, what: str) -> None:
        """An event wait on the device; the host goes on."""
        for t in works:
            t.order(stream)

    def wait(self, works: Sequence[Any], what: str) -> None:
        if not works:
            return
        self.poll(lambda: all(t.is_completed() for t in works), lambda: what)
        for t in works:
            t.order(torch.cuda.current_stream(self.device))

    def finish(self, work: Any, what: str) -> None:
        self.poll(work.is_completed, lambda: what)
        work.wait()

    def drain(self, works: Sequence[Any], what: str) -> None:
        self.poll(lambda: all(t.is_completed() for t in works), lambda: what)

    def abort(self) -> None:
        """The channels, and the group: a collective stuck behind a dead peer would hold the exit too."""
        if self._aborted:
            return
        self._aborted = True
        if self.channels is not None:
            self.channels.abort()
        abort_nccl([process_group(self.group)])


class EmulatedNccl(NcclTransport):
    """The NCCL path on gloo (emulation.py): the host waits for each transfer, then ``stream`` is
    ordered after it, which makes the received data visible to compute on that stream."""

    emulated = True
    channel_backend = "gloo"

    @classmethod
    def device_for(cls) -> torch.device:
        return torch.device("cpu")

    def order(self, works: Sequence[Any], stream: Any, what: str) -> None:
        if not works:
            return
        if not isinstance(stream, EmuStream):
            raise TypeError(f"the NCCL emulation orders emulated streams, got {stream!r}")
        self._complete(works, what)
        emulation.order(stream, works)

    def wait(self, works: Sequence[Any], what: str) -> None:
        if not works:
            return
        self._complete(works, what)
        emulation.order(emulation.current(), works)

    def drain(self, works: Sequence[Any], what: str) -> None:
        self._complete(works, what)  # the data stays invisible to compute until it is ordered

    def _complete(self, works: Sequence[Transfer], what: str) -> None:
        for t in works:
            assert isinstance(t, EmuTransfer)
            t.complete(lambda ws: self.host_wait(ws, what))

    def before_collective(self, size: int, what: str) -> None:
        """Every rank takes part, so the group's communicator is made here (emulation.first_use); in a
        call, it must have connected every algorithm when made (emulation.collective)."""
        emulation.collective(process_group(self.group), size, what)

    def abort(self) -> None:
        """The channels' gloo pairs (no NCCL group to abort); nothing without channels."""
        if self._aborted or self.channels is None:
            return
        self._aborted = True
        self.channels.abort()
