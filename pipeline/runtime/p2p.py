"""Point-to-point between ranks that never hangs: direct posts, timed waits, failure signalling.

    # r: this rank, q: the peer rank

``Comm`` owns one rank's view of the pipeline's process group. On gloo it posts
each tensor straight to the group's backend object (``send([t], q, tag)`` /
``recv([t], q, tag)``, peer ranks local to the group, resolved once), skipping
``torch.distributed``'s Python wrappers; on NCCL a block of sends and receives
goes out as one coalesced ``batch_isend_irecv`` (deadlock freedom needs it).

Never hang. Every wait on another process is bounded by ``timeout``, and a
failure anywhere reaches every rank within a fraction of a second:

    rank 1: stage raises -> publish("rank 1 failed: ...") in the store -> re-raise
    rank 0: blocked in 0RECV_B2's wait -> its watchdog reads the store every 50 ms,
            sees the failure, closes rank 0's connections -> the wait raises ->
            PeerFailure("rank 1 failed while rank 0 waited for 0RECV_B2 from rank 1: ...")
    rank 2: blocked on rank 0 or 1 -> the same, naming rank 1 too

What gloo does (measured, torch 2.13): ``is_completed()`` of a point-to-point
work stays False until ``wait()`` is called, even when the data is there, and
there is no future, so the host cannot poll; ``wait(timeout)`` on expiry
closes the connection to the peer ("Application timeout caused pair
closure"), so short timed waits cannot be retried; a send completes only once
the peer has posted its receive; ``abort()`` and ``shutdown()`` of a backend
wake neither its own blocked waits nor its peers'. But a pair's closure wakes
every wait on that pair, on both sides, with an error. Hence the host calls the
blocking ``wait(timeout)`` itself (it releases the GIL; no thread handoff on the
critical path), and one watchdog thread per ``Comm``, asleep unless the host is
blocked, reads the failure key every 50 ms; when it is set, the watchdog closes
every pair of the group with a receive on an unused tag timed out after 1 ms,
which wakes the host's wait, and the host raises ``PeerFailure`` naming the
failed rank. The group is then unusable, as after any failure. NCCL's
``work.wait()`` does not block the host (it orders the current stream after the
transfer), so there it is called at once and hangs inside the GPU are bounded by
the process group's timeout; the loss broadcast at the end of each step is
polled with the failure key, so a failed peer still surfaces within seconds.

Sends are not waited for inside the step: the caller waits for each one where it
is known to be done (see program.py) or at the step's end.

The watchdog belongs to one ``Comm`` (one Pipeline), not to the process: it holds
no reference to its ``Comm`` and stops when the ``Comm`` is closed
(``Pipeline.close()``) or garbage-collected.

Only the first failure is published (``compare_set``), so the error every
rank reports names the root cause, not a rank that merely lost a connection.

Metadata (tensor signatures and when they travel) is metadata.py's.

A fake tensor (``FakeTensorMode``) has no data: ``isend`` of one dispatches to
a fake kernel that returns a finished ``FakeWork`` without touching the process
group, so nothing moves and the peer waits until its timeout. ``post`` refuses
fake tensors at once.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["Comm", "PeerFailure", "PipelineTimeout"]

_CHECK_STORE_S = 0.05
_CLOSE_TAG = 2**30 - 7  # never used by a message: a receive on it only ever times out
# how long a rank that lost a connection waits for the failed peer's published reason
_LOST_GRACE_S = 1.0


class PipelineTimeout(TimeoutError):
    """A wait on another rank ran past the timeout."""


class PeerFailure(RuntimeError):
    """Another rank failed while this one waited for it."""


def _group_store(group: Any) -> Any:
    from torch.distributed import distributed_c10d as c10d

    entry = c10d._world.pg_map.get(group if group is not None else c10d._get_default_group())
    return entry[1] if entry is not None else c10d._get_default_store()


def _backend(group: Any) -> Any:
    """The gloo ``ProcessGroupGloo`` behind ``group``: its send / recv take group-local ranks."""
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    return pg._get_backend(torch.device("cpu"))


def _refuse_fake(tensor: torch.Tensor, send: bool, rank: int, peer: int) -> None:
    raise ValueError(
        f"rank {rank} was to {'send' if send else 'receive'} a fake tensor "
        f"({list(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}) "
        f"{'to' if send else 'from'} rank {peer}; fake tensors hold no data, so nothing would "
        "move and the peer would wait: run the step outside FakeTensorMode and keep fake "
        "values out of the model"
    )


# a posted block: per entry (tensors, group-local peer rank)
Entries = Sequence[tuple[Sequence[torch.Tensor], int]]


class Comm:
    """One rank's point-to-point in ``group``, with timeouts and a shared failure key."""

    def __init__(self, group: Any, key_prefix: str, timeout: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = timeout
        self.nccl = dist.get_backend(group) == "nccl"
        self.store = _group_store(group)
        self.failure_key = f"{key_prefix}/failed"
        n = self.world_size
        self._global = [dist.get_global_rank(group, q) if group is not None else q for q in range(n)]
        self._be: Any = None if self.nccl else _backend(group)
        self._watchdog = _Watchdog(self.store, self.failure_key, self._be, self.rank, n)
        # at close() or when collected; the callback must not hold self, or self would never be collected
        self._close = weakref.finalize(self, self._watchdog.close)

    # ---- posting

    def post(self, sends: Entries, recvs: Entries, what: str) -> list[list[Any]]:
        """Post every entry's tensors (``recvs`` fill theirs); the works per entry, sends first."""
        if not self._close.alive:
            raise RuntimeError(
                f"rank {self.rank}: cannot post {what}: this pipeline's communication was closed "
                "(Pipeline.close()); build a new Pipeline"
            )
        for entries, send in ((sends, True), (recvs, False)):
            for tensors, q in entries:
                for t in tensors:
                    if isinstance(t, FakeTensor):
                        _refuse_fake(t, send, self.rank, q)
        try:
            if self.nccl:
                return self._post_coalesced(sends, recvs)
            be = self._be
            out = [[be.send([t], q, 0) for t in tensors] for tensors, q in sends]
            out += [[be.recv([t], q, 0) for t in tensors] for tensors, q in recvs]
            return out
        except Exception as exc:  # a peer that is gone already
            self._raise(what, exc)
            raise

    def _post_coalesced(self, sends: Entries, recvs: Entries) -> list[list[Any]]:
        ops = [dist.P2POp(dist.isend, t, self._global[q], self.group) for ts, q in sends for t in ts]
        ops += [dist.P2POp(dist.irecv, t, self._global[q], self.group) for ts, q in recvs for t in ts]
        works = list(dist.batch_isend_irecv(ops)) if ops else []
        for w in works:
            w.wait()  # orders the current stream after the transfer; the host does not block
        out, k = [], 0
        for ts, _ in (*sends, *recvs):
            out.append(works[k : k + len(ts)])
            k += len(ts)
        return out

    # ---- failure signalling

    def publish(self, message: str) -> None:
        """Record this rank's failure unless another rank's came first."""
        # a store that is gone already means the launcher is tearing the job down
        with contextlib.suppress(Exception):
            self.store.compare_set(self.failure_key, "", f"{self.rank}|{message}")

    def failure(self) -> tuple[int, str] | None:
        """(rank, message) of the first published failure, if any."""
        try:
            if not self.store.check([self.failure_key]):
                return None
            rank, message = bytes(self.store.get(self.failure_key)).decode().split("|", 1)
        except Exception:
            return None
        return int(rank), message

    def _raise(self, what: str, exc: BaseException | None) -> None:
        timed_out = exc is None or "Timed out" in str(exc)
        failed = self.failure()
        deadline = time.monotonic() + _LOST_GRACE_S
        while failed is None and not timed_out and time.monotonic() < deadline:
            time.sleep(0.01)  # a lost connection: give the failed peer's publish a moment to land
            failed = self.failure()
        if failed is not None:
            q, message = failed
            raise PeerFailure(f"rank {q} failed while rank {self.rank} waited for {what}: {message}") from exc
        if not timed_out:
            raise RuntimeError(f"rank {self.rank}: error while waiting for {what}: {exc}") from exc
        raise PipelineTimeout(f"rank {self.rank} timed out after {self.timeout:.1f} s waiting for {what}")

    # ---- waiting

    def wait(self, works: Sequence[Any], what: str) -> None:
        """Block until ``works`` are done; ``what`` names the awaited action and peer for errors."""
        if self.nccl:
            return  # waited for at post: the stream is ordered, the host never blocks
        dog = self._watchdog
        if dog.thread is None:
            dog.start()
        dog.blocked += 1
        try:
            deadline = time.monotonic() + self.timeout
            for w in works:
                left = deadline - time.monotonic()
                if left <= 0 or not w.wait(datetime.timedelta(seconds=left)):
                    self._raise(what, None)
        except (PeerFailure, PipelineTimeout):
            raise
        except Exception as exc:
            self._raise(what, exc)
        finally:
            dog.blocked -= 1

    def wait_key(self, key: str, what: str) -> bytes:
        """A store value another rank sets, with the same timeout and failure watch."""
        start = time.monotonic()
        while not self.store.check([key]):
            if self.store.check([self.failure_key]) or time.monotonic() - start > self.timeout:
                self._raise(what, None)
            time.sleep(0.002)
        return bytes(self.store.get(key))

    def set_key(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def close(self) -> None:
        """Stop the watchdog thread; later posts raise. Idempotent."""
        self._close()

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """``dist.broadcast`` from group rank ``src``, waited for like a receive."""
        self._collective(
            lambda: dist.broadcast(tensor, self._global[src], group=self.group, async_op=True), what
        )

    def all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> None:
        """``dist.all_reduce`` over the group, in place, waited for like a receive."""
        self._collective(lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True), what)

    def _collective(self, start_op: Any, what: str) -> None:
        if not self._close.alive:
            self.post([], [], what)  # raises: closed
        work = start_op()
        if work is None:
            raise RuntimeError(f"rank {self.rank}: {what} returned no work to wait for")
        if not self.nccl:
            self.wait([work], what)
            return
        start = time.monotonic()
        while not work.is_completed():  # NCCL polls without blocking
            if self.store.check([self.failure_key]) or time.monotonic() - start > self.timeout:
                self._raise(what, None)
            time.sleep(1e-4)
        work.wait()


class _Watchdog:
    """A daemon thread, started at the first blocking wait, that wakes the host on a peer's failure.

    ``blocked`` counts the host's waits in progress (the thread only reads it:
    a stale read costs at most one extra store read). It holds no reference to its ``Comm``.
    """

    def __init__(self, store: Any, key: str, backend: Any, rank: int, world_size: int) -> None:
        self.blocked = 0
        self._args = (store, key, backend, rank, world_size)
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(
            target=_watch, args=(self, *self._args), name="stagewise-p2p-watchdog", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self._stop.set()


def _watch(dog: _Watchdog, store: Any, key: str, backend: Any, rank: int, world_size: int) -> None:
    """The watchdog's loop, until closed: on a published failure, close this rank's pairs once."""
    while not dog._stop.wait(_CHECK_STORE_S):
        if dog.blocked <= 0:
            continue
        try:
            failed = store.check([key])
        except Exception:  # the store is gone: the launcher is tearing the job down
            return
        if failed and backend is not None:
            dummy = torch.empty(1)
            for q in range(world_size):
                if q != rank:  # a timed-out receive closes the pair: every wait on it raises
                    with contextlib.suppress(Exception):
                        backend.recv([dummy], q, _CLOSE_TAG).wait(datetime.timedelta(milliseconds=1))
            return
