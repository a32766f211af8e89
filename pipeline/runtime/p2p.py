"""One rank's communication in the pipeline's group: one device, two posting paths, waits that never hang.

    # r: this rank, q: a peer rank, p: ranks

The communication device. Every tensor handed to the process group (headers,
receive buffers, the loss, flags, norms) is made by ``Comm.empty`` /
``zeros`` / ``tensor`` on ``Comm.device`` (NCCL: this rank's CUDA device;
gloo: the CPU), and every tensor posted is checked first: a fake, meta or
wrong-device tensor, or on NCCL a dtype it cannot send, is refused with a
ValueError naming it, before it can reach the backend (where it would be a
native crash or a silent hang).

Two posting paths:

    gloo      each tensor straight to the group's gloo backend (``send`` /
              ``recv``, group-local ranks, no Python wrappers); ``order`` and
              ``wait`` block the host with a timeout (the host is the stream)
    NCCL      each message as one group on its channel (channels.py: one
              two-rank group per direction, so that no direction or collective
              waits on another); ``order(works, stream)`` makes the consuming
              stream wait for the transfer on the device, the host goes on;
              host waits (``wait``, ``poll``) poll with the timeout and failure watch

``STAGEWISE_EMULATE_NCCL=1`` on a gloo group takes the NCCL path on gloo,
with NCCL's rules made strict (emulation.py).

Never hang. Every wait on another process is bounded by ``timeout``, which
stays below the process group's own (a larger one is clamped to 90% of it, and
the error says so), so the error names the rank and action, not a backend
watchdog. A failure anywhere reaches every rank within a fraction of a second:
the failing rank publishes it in the store (``publish``; only the first
failure is kept, so every rank names the root cause); a rank blocked in gloo
is woken by its watchdog thread (watchdog.py); a rank polling on NCCL reads
the key at most every 50 ms. A rank that dies without a word is named by the
peer that notices (its process is gone: see watchdog.py), not that peer's own
lost connection. After a failure the channels are aborted (on
NCCL also the group), so that transfers in flight stop and exit never hangs;
the group is then unusable, as after any failure.

What gloo does (measured, torch 2.13): ``is_completed()`` of a point-to-point
work stays False until ``wait()`` is called, so the host cannot poll it;
``wait(timeout)`` on expiry closes the connection to the peer; a send
completes only once the peer has posted its receive.

In a mesh of pipeline replicas (mesh.py) each rank has two: the pipeline's
("pp", point to point) and its replicas' ("dp", collectives only), which watch
one failure key in the world's store, so that a failure anywhere in the mesh
reaches every rank; errors then name global ranks.

Sends are not waited for inside the step: the caller orders each one where it
is known to be done (see program.py) or at the step's end. Metadata (tensor
signatures and when they travel) is metadata.py's.
"""

from __future__ import annotations

import datetime
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from pipeline.runtime import emulation
from pipeline.runtime.board import FailureBoard
from pipeline.runtime.channels import Channels, Transfer, abort_nccl, channels_for
from pipeline.runtime.emulation import EmuStream, EmuTransfer
from pipeline.runtime.stream import from_host
from pipeline.runtime.watchdog import CHECK_STORE_S, PeerFailure, PipelineTimeout, Watchdog, quiet_store

__all__ = ["NCCL_DTYPES", "Comm", "PeerFailure", "PipelineTimeout", "world_store"]

# how long a rank that lost a connection waits for the failed peer's published reason
_LOST_GRACE_S = 1.0
_CLAMP = 0.9  # the pipeline's timeout at most this share of the process group's
NCCL_DTYPES = frozenset(
    {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
     torch.int8, torch.uint8, torch.bool}
)  # fmt: skip


def _group_store(group: Any) -> Any:
    from torch.distributed import distributed_c10d as c10d

    entry = c10d._world.pg_map.get(group if group is not None else c10d._get_default_group())
    return entry[1] if entry is not None else c10d._get_default_store()


def world_store() -> Any:
    """The default process group's store: where a mesh's ranks share their failure key."""
    return _group_store(None)


def _process_group(group: Any) -> Any:
    from torch.distributed import distributed_c10d as c10d

    return group if group is not None else c10d._get_default_group()


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


def _pg_timeout(group: Any, device: torch.device) -> float | None:
    """The process group's own timeout in seconds, when the backend tells it."""
    try:
        return float(_process_group(group)._get_backend(device).options._timeout.total_seconds())
    except Exception:
        return None


def _fmt(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"


# a posted block: per entry (tensors, group-local peer rank)
Entries = Sequence[tuple[Sequence[torch.Tensor], int]]


class Comm:
    """One rank's point-to-point and collectives in ``group``, with timeouts and a shared failure key."""

    def __init__(
        self,
        group: Any,
        key_prefix: str,
        timeout: float,
        *,
        failure: tuple[Any, str] | None = None,
        pipelines: list[list[int]] | None = None,
        p2p: bool = True,
        global_names: bool = False,
    ) -> None:
        """``failure``: the (store, key) of the failure key when it is shared beyond ``group`` (a
        mesh's replicas watch one key); ``pipelines``: every pipeline's global ranks when ``group``
        is one of several (the channels of all are made together); ``p2p=False``: collectives only,
        no channels; ``global_names``: errors name global ranks (in a mesh, where a group rank is
        ambiguous)."""
        self.group = group
        self.key_prefix = key_prefix  # this pipeline's keys in the store (every executor's)
        self.rank = dist.get_rank(group)
        self.world_size = n = dist.get_world_size(group)
        backend = dist.get_backend(group)
        if emulation.enabled() and backend != "gloo":
            raise ValueError(
                f"{emulation.ENV} runs the NCCL code path on a gloo process group, but this group's "
                f"backend is {backend!r}: unset {emulation.ENV} or initialise with gloo"
            )
        self.emulated = emulation.enabled()
        self.nccl = backend == "nccl" or self.emulated  # the NCCL code path
        self.backend = "nccl-emulated" if self.emulated else backend
        on_gpu = backend == "nccl"
        self.device = _nccl_device() if on_gpu else torch.device("cpu")
        self.requested_timeout = timeout
        self.pg_timeout = _pg_timeout(group, self.device)
        clamp = self.pg_timeout is not None and timeout >= self.pg_timeout
        self.timeout = _CLAMP * self.pg_timeout if clamp and self.pg_timeout else timeout
        self.store = _group_store(group)
        self._global = [dist.get_global_rank(group, q) if group is not None else q for q in range(n)]
        self._names = self._global if global_names else list(range(n))
        self.me = self._names[self.rank]  # this rank as errors name it
        self._be: Any = None if on_gpu else _process_group(group)._get_backend(torch.device("cpu"))
        self.channels: Channels | None = None
        if self.nccl and n > 1 and p2p:
            td = datetime.timedelta(seconds=self.pg_timeout or 1800.0)
            self.channels = channels_for(
                group, self.rank, self._global, "gloo" if self.emulated else "nccl", td, pipelines
            )
        pairs = [(self._be, q) for q in range(n) if q != self.rank] if self._be is not None else []
        pairs += self.channels.pairs() if self.channels is not None else []
        self.board = FailureBoard(self.store, failure, key_prefix, self.rank, self._names)
        self.liveness = self.board.liveness
        self._watchdog = Watchdog(self.board.store, self.board.key, pairs, self.liveness)
        # at close() or when collected; the callback must not hold self, or self would never be collected
        self._close = weakref.finalize(self, self._watchdog.close)
        self._aborted = False
        self._make_communicators()
        # (kind, number) of the Pipeline call in progress; the step header carries it (metadata.py)
        self.call = (0, 0)

    def name(self, q: int) -> int:
        """How errors name group rank ``q``: its global rank in a mesh, else ``q``."""
        return self._names[q]

    # ---- tensors on the communication device

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    def tensor(self, data: Any, dtype: torch.dtype) -> torch.Tensor:
        return from_host(data, dtype, self.device)  # no host synchronisation on CUDA

    def check(self, t: torch.Tensor, what: str) -> None:
        """Refuse what the backend cannot take: fake, meta or other-device tensors, unsendable dtypes."""
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
        if self.nccl and not t.is_contiguous():  # ProcessGroupNCCL refuses them; gloo copies them
            raise ValueError(
                f"rank {self.me}: {what} was handed a non-contiguous tensor ({_fmt(t)}, strides "
                f"{tuple(t.stride())}), which NCCL refuses; pass t.contiguous() (or a copy in a "
                "contiguous buffer)"
            )
        if self.nccl and t.dtype not in NCCL_DTYPES:
            raise ValueError(
                f"rank {self.me}: {what} was handed a {str(t.dtype).replace('torch.', '')} tensor "
                f"({_fmt(t)}), which NCCL cannot send or receive; use one of "
                f"{sorted(str(d).replace('torch.', '') for d in NCCL_DTYPES)} between stages"
            )

    # ---- posting

    def post(self, sends: Entries, recvs: Entries, what: str) -> list[list[Any]]:
        """Post every entry's tensors (``recvs`` fill theirs); the works per entry, sends first."""
        self._check_open(what)
        for entries in (sends, recvs):
            for tensors, _ in entries:
                for t in tensors:
                    self.check(t, what)
        try:
            ch = self.channels
            if self.nccl:  # one group per message, on its channel
                assert ch is not None, "a group of one rank has no peers to post to"
                out = [[ch.post([(t, q, True) for t in ts], what)] if ts else [] for ts, q in sends]
                out += [[ch.post([(t, q, False) for t in ts], what)] if ts else [] for ts, q in recvs]
                return out
            be = self._be
            out = [[be.send([t], q, 0) for t in tensors] for tensors, q in sends]
            out += [[be.recv([t], q, 0) for t in tensors] for tensors, q in recvs]
            return out
        except Exception as exc:  # a peer that is gone already
            raise self._error(what, exc) from exc

    def _check_open(self, what: str) -> None:
        if not self._close.alive:
            raise RuntimeError(
                f"rank {self.me}: cannot post {what}: this pipeline's communication was closed "
                "(Pipeline.close()); build a new Pipeline"
            )

    # ---- waiting

    def order(self, works: Sequence[Any], stream: Any, what: str) -> None:
        """``stream`` runs past this point only once ``works`` are done (``what`` names them for errors).

        gloo: the host waits (it is the stream). NCCL: an event wait on the
        device, the host goes on. Emulation: the host waits, and ``stream`` is
        ordered after the transfers, which makes them visible on the default stream.
        """
        if not works:
            return
        if not self.nccl:
            self._host_wait(works, what)
        elif self.emulated:
            if not isinstance(stream, EmuStream):
                raise TypeError(f"the NCCL emulation orders emulated streams, got {stream!r}")
            self._complete(works, what)
            emulation.order(stream, works)
        else:
            for t in works:
                t.order(stream)

    def wait(self, works: Sequence[Any], what: str) -> None:
        """Block the host until ``works`` are done; what follows on the current stream sees their data."""
        if not works:
            return
        if not self.nccl:
            self._host_wait(works, what)
        elif self.emulated:
            self._complete(works, what)
            emulation.order(emulation.current(), works)
        else:
            self.poll(lambda: all(t.is_completed() for t in works), lambda: what)
            for t in works:
                t.order(torch.cuda.current_stream(self.device))

    def _complete(self, works: Sequence[Transfer], what: str) -> None:
        for t in works:
            assert isinstance(t, EmuTransfer)
            t.complete(lambda ws: self._host_wait(ws, what))

    def _host_wait(self, works: Sequence[Any], what: str) -> None:
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
                    raise self._error(what, None) from None
        except (PeerFailure, PipelineTimeout):
            raise
        except Exception as exc:
            raise self._error(what, exc) from exc
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
                raise self._error(what(), None) from None
            if now >= check_at:
                check_at = now + CHECK_STORE_S
                if self.board.first() is not None:
                    raise self._error(what(), None) from None
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)

    def wait_key(self, key: str, what: str) -> bytes:
        """A store value another rank sets, with the same timeout and failure watch."""
        start, pause = time.monotonic(), 0.0002  # short at first: the step header is read each step
        try:
            while True:
                if not self.board.usable():
                    raise RuntimeError("the process that served the store is gone")
                with quiet_store():
                    if self.store.check([key]):
                        return bytes(self.store.get(key))
                    failed = self.board.store.check([self.board.key])
                if failed or time.monotonic() - start > self.timeout:
                    raise self._error(what, None) from None
                time.sleep(pause)
                pause = min(2 * pause, 0.002)
        except (PeerFailure, PipelineTimeout):
            raise
        except Exception as exc:  # the store is gone
            self.liveness.store_gone = True
            raise self._error(what, exc) from exc

    def add_key(self, key: str, amount: int) -> int:
        """The store's counter ``key`` after adding ``amount`` (atomic across ranks)."""
        try:
            with quiet_store():
                return int(self.store.add(key, amount))
        except Exception as exc:
            self.liveness.store_gone = True
            raise self._error(f"the store to count {key}", exc) from exc

    def delete_keys(self, keys: Sequence[str]) -> None:
        try:
            with quiet_store():
                for key in keys:
                    self.store.delete_key(key)
        except Exception as exc:
            self.liveness.store_gone = True
            raise self._error(f"the store to delete {', '.join(keys)}", exc) from exc

    def set_key(self, key: str, value: bytes) -> None:
        try:
            if not self.board.usable():
                raise RuntimeError("the process that served the store is gone")
            with quiet_store():
                self.store.set(key, value)
        except Exception as exc:
            self.liveness.store_gone = True
            raise self._error(f"the store to set {key}", exc) from exc

    # ---- failure signalling (the board's)

    def publish(self, message: str) -> None:
        """Record this rank's failure unless another rank's came first; stop transfers in flight."""
        self.board.publish_as(self.me, message)
        self.abort()

    def abort(self) -> None:
        """Stop every transfer in flight (the channels; on NCCL also the group). Idempotent."""
        if self._aborted or (self.channels is None and not self.nccl):
            return
        self._aborted = True
        if self.channels is not None:
            self.channels.abort()
        if not self.emulated:  # a collective stuck behind a dead peer would hold the exit too
            abort_nccl([_process_group(self.group)])

    def _error(self, what: str, exc: BaseException | None) -> Exception:
        """The error to raise (``raise self._error(what, exc) from exc``, so that a traceback ends
        where the wait was): the failed peer named, else the lost store, the backend's error or our
        timeout."""
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
            return PeerFailure(f"rank {q} failed while rank {self.me} waited for {what}: {message}")
        if self.liveness.store_gone:
            return RuntimeError(
                f"rank {self.me}: lost the store while waiting for {what} (the process that served it "
                f"died, or the launcher is tearing the job down): {exc}"
            )
        if not timed_out:
            return RuntimeError(f"rank {self.me}: error while waiting for {what}: {exc}")
        note = ""
        if self.timeout != self.requested_timeout:
            note = (
                f" (the pipeline's timeout of {self.requested_timeout:g} s, clamped to "
                f"{_CLAMP:.0%} of the process group's {self.pg_timeout:g} s so that it fires first)"
            )
        return PipelineTimeout(
            f"rank {self.me} timed out after {self.timeout:.1f} s{note} waiting for {what}"
        )

    def close(self) -> None:
        """Stop the watchdog thread; later posts raise. Idempotent."""
        self._close()

    # ---- collectives (on the group itself: never queued behind the channels)

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """``dist.broadcast`` from group rank ``src``, waited for like a receive."""
        self._collective(
            tensor, lambda: dist.broadcast(tensor, self._global[src], group=self.group, async_op=True), what
        )

    def all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> None:
        """``dist.all_reduce`` over the group, in place, waited for like a receive."""
        self._collective(
            tensor, lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True), what
        )

    def start_all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> Any:
        """``dist.all_reduce`` over the group, in place, started: its work, for ``finish``."""
        return self._start(
            tensor, lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True), what
        )

    def finish(self, work: Any, what: str) -> None:
        """Wait for a started collective like a receive: the timeout and the failure watch."""
        if not self.nccl:
            self._host_wait([work], what)
            return
        self.poll(work.is_completed, lambda: what)
        work.wait()

    def _collective(self, tensor: torch.Tensor, start_op: Callable[[], Any], what: str) -> None:
        self.finish(self._start(tensor, start_op, what), what)

    def _make_communicators(self) -> None:
        """The group's and its channels' first operations, here at construction, not in a step:
        NCCL makes a communicator at its first operation, a blocking rendezvous of its ranks, so a
        peer that died before would hang the step there, outside every timeout. The ranks go through
        the channels in one global order (a rank takes part in those it is an end of), so no two
        wait on each other; each message is waited for with the timeout and the failure watch."""
        ch = self.channels
        if ch is None:
            return
        # the group's own communicator: the loss, the norm, and messages between non-neighbours
        # (predict(dst=), gather_state_dict), whose first operation would leave the other ranks out
        self.all_reduce(self.zeros((1,)), dist.ReduceOp.SUM, "the group's communicator (every rank)")
        if ch.prepared:
            return
        for a, b in ch.directions:
            if self.rank not in (a, b):
                continue
            what = f"channel {self.name(a)} -> {self.name(b)}'s first message (made at construction)"
            one = [self.zeros((1,))]
            works = self.post([(one, b)], [], what) if self.rank == a else self.post([], [(one, a)], what)
            self.wait(works[0], what)
        ch.prepared = True

    def _start(self, tensor: torch.Tensor, start_op: Callable[[], Any], what: str) -> Any:
        self._check_open(what)
        self.check(tensor, what)
        if self.emulated:  # a collective: every rank takes part, so the communicator is made here
            emulation.first_use(_process_group(self.group), self.world_size, self.world_size, what)
        try:
            work = start_op()
        except Exception as exc:  # a peer that is gone already
            raise self._error(what, exc) from exc
        if work is None:
            raise RuntimeError(f"rank {self.me}: {what} returned no work to wait for")
        return work
