"""Point-to-point between ranks that never hangs: batched posts, timed waits, failure signalling.

    # r: this rank, q: the peer rank

``Comm`` owns one rank's view of the pipeline's process group. It posts a block
of sends and receives as one ``batch_isend_irecv`` and waits for their works.

Never hang. Every wait on another process is bounded by ``timeout``, and a
failure anywhere reaches every rank within milliseconds:

    rank 1: stage raises -> publish("rank 1 failed: ...") in the store -> re-raise
    rank 0: waiting for 0RECV_B2 -> reads the store every 50 ms -> PeerFailure("rank 1
            failed while rank 0 waited for 0RECV_B2 from rank 1: ...")
    rank 2: waiting on rank 0 or 1 -> the same, naming rank 1 too

What gloo does (measured, torch 2.13): ``is_completed()`` of a point-to-point
work stays False until ``wait()`` is called, even when the data is there, and
there is no future, so the host cannot poll; ``wait(timeout)`` on expiry
closes the connection to the peer ("Application timeout caused pair
closure"), so short timed waits cannot be retried; a send completes only once
the peer has posted its receive; and ``abort()`` of a group does not close its
connections while the group object lives, so peers are not woken that way.
Hence one waiter thread per rank (per ``Comm``) calls the blocking ``wait(timeout)`` (which
releases the GIL) on every posted work, in post order (receives are consumed
in post order, so the one the host needs is never queued behind one it does
not), and sets an event; the host waits on that event in 50 ms slices,
reading the failure key between slices. A work already done costs one
``Event.is_set``. NCCL's ``work.wait()`` does not block the host (it orders
the current stream after the transfer), so there it is called directly and
hangs inside the GPU are bounded by the process group's timeout; the loss
broadcast at the end of each step goes through the waiter as well, so a
failed peer still surfaces within seconds.

The waiter belongs to one ``Comm`` (one Pipeline), not to the process: in a
shared queue, a job of one pipeline could hold back another's that a peer
needs first (two pipelines stepped from two threads could deadlock). It stops,
after the jobs already queued, when the ``Comm`` is closed (``Pipeline.close()``)
or garbage-collected.

Only the first failure is published (``compare_set``), so the error every
rank reports names the root cause, not a rank that merely lost a connection.

Metadata. Tensor signatures (shapes, dtypes) travel as one fixed-size int64
tensor (``encode`` / ``decode``); the executor decides when (see executor.py).

A fake tensor (``FakeTensorMode``) has no data: ``isend`` of one dispatches to
a fake kernel that returns a finished ``FakeWork`` without touching the process
group, so nothing moves and the peer waits until its timeout. ``op`` refuses
fake tensors at once.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from pipeline.microbatch import Signature

__all__ = ["HEADER_LEN", "Comm", "Job", "PeerFailure", "PipelineTimeout", "decode", "encode"]

HEADER_LEN = 64
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
_CHECK_STORE_S = 0.05


class PipelineTimeout(TimeoutError):
    """A wait on another rank ran past the timeout."""


class PeerFailure(RuntimeError):
    """Another rank failed while this one waited for it."""


def encode(sig: Signature, tag: int) -> torch.Tensor:
    """``[tag, n, (dtype, ndim, *shape) per tensor, 0 ...]`` as a (HEADER_LEN,) int64 tensor.

    ``tag`` is one word for the caller (the executor sends its autocast state).
    """
    words = [tag, len(sig)]
    for shape, dtype in sig:
        if dtype not in _DTYPES:
            raise ValueError(f"cannot send tensors of dtype {dtype} between stages; use one of {_DTYPES}")
        words += [_DTYPES.index(dtype), len(shape), *shape]
    if len(words) > HEADER_LEN:
        raise ValueError(
            f"stage input signature {sig} needs {len(words)} header words, more than {HEADER_LEN}; "
            "pass fewer or lower-dimensional tensors between stages"
        )
    return torch.tensor(words + [0] * (HEADER_LEN - len(words)), dtype=torch.int64)


def decode(header: torch.Tensor) -> tuple[Signature, int]:
    """Inverse of ``encode``: (signature, tag)."""
    words = header.tolist()
    tag, n, k = words[0], words[1], 2
    sig = []
    for _ in range(n):
        dtype, ndim = _DTYPES[words[k]], words[k + 1]
        sig.append((tuple(words[k + 2 : k + 2 + ndim]), dtype))
        k += 2 + ndim
    return tuple(sig), tag


def _group_store(group: Any) -> Any:
    from torch.distributed import distributed_c10d as c10d

    entry = c10d._world.pg_map.get(group if group is not None else c10d._get_default_group())
    return entry[1] if entry is not None else c10d._get_default_store()


class Comm:
    """One rank's point-to-point in ``group``, with timeouts and a shared failure key."""

    def __init__(self, group: Any, key_prefix: str, timeout: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = timeout
        # the waiter's own timeout is a backstop: the host gives up first and names the action
        self._waiter = _Waiter(timeout + 5.0)
        # at close() or when collected; the callback must not hold self, or self would never be collected
        self._close = weakref.finalize(self, self._waiter.close)
        self.nccl = dist.get_backend(group) == "nccl"
        self.store = _group_store(group)
        self.failure_key = f"{key_prefix}/failed"
        n = self.world_size
        self._global = [dist.get_global_rank(group, q) if group is not None else q for q in range(n)]

    # ---- posting

    def op(self, send: bool, tensor: torch.Tensor, peer: int) -> dist.P2POp:
        if isinstance(tensor, FakeTensor):
            raise ValueError(
                f"rank {self.rank} was to {'send' if send else 'receive'} a fake tensor "
                f"({list(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}) "
                f"{'to' if send else 'from'} rank {peer}; fake tensors hold no data, so nothing would "
                "move and the peer would wait: run the step outside FakeTensorMode and keep fake "
                "values out of the model"
            )
        return dist.P2POp(dist.isend if send else dist.irecv, tensor, self._global[peer], self.group)

    def post(self, ops: Sequence[dist.P2POp], what: str) -> list[Any]:
        self._check_open(what)
        try:
            return list(dist.batch_isend_irecv(list(ops))) if ops else []
        except Exception as exc:  # a peer that is gone already
            self._raise(what, exc)
            raise

    def _check_open(self, what: str) -> None:
        if not self._close.alive:
            raise RuntimeError(
                f"rank {self.rank}: cannot post {what}: this pipeline's communication was closed "
                "(Pipeline.close()); build a new Pipeline"
            )

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
        failed = self.failure()
        if failed is None and exc is not None and "Timed out" not in str(exc):
            time.sleep(0.05)  # a lost connection: give the failed peer's publish a moment to land
            failed = self.failure()
        if failed is not None:
            q, message = failed
            raise PeerFailure(f"rank {q} failed while rank {self.rank} waited for {what}: {message}") from exc
        if exc is not None and "Timed out" not in str(exc):
            raise RuntimeError(f"rank {self.rank}: error while waiting for {what}: {exc}") from exc
        raise PipelineTimeout(f"rank {self.rank} timed out after {self.timeout:.1f} s waiting for {what}")

    # ---- waiting

    def watch(self, works: Sequence[Any], keep: Sequence[torch.Tensor] = ()) -> Job:
        """Hand ``works`` to the waiter thread; ``keep`` stays referenced until they complete."""
        job = Job(list(works), list(keep))
        if self.nccl:
            for w in job.works:
                w.wait()  # orders the current stream after the transfer; the host does not block
            job.done.set()
        else:
            self._waiter.submit(job)
        return job

    def wait(self, job: Job, what: str) -> None:
        """Block until ``job`` is done; ``what`` names the awaited action and peer for errors."""
        if not job.done.is_set():
            deadline = time.monotonic() + self.timeout
            while not job.done.wait(_CHECK_STORE_S):
                if self.store.check([self.failure_key]) or time.monotonic() > deadline:
                    self._raise(what, None)
        if job.error is not None:
            self._raise(what, job.error)

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
        """Stop the waiter thread once the jobs already handed to it are done; idempotent."""
        self._close()

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """``dist.broadcast`` from group rank ``src``, waited for like a receive."""
        self._check_open(what)
        work = dist.broadcast(tensor, self._global[src], group=self.group, async_op=True)
        assert work is not None
        if not self.nccl:
            self.wait(self.watch([work]), what)
            return
        start = time.monotonic()
        while not work.is_completed():  # NCCL polls without blocking
            if self.store.check([self.failure_key]) or time.monotonic() - start > self.timeout:
                self._raise(what, None)
            time.sleep(1e-4)
        work.wait()


class Job:
    """Works handed to the waiter thread: ``done`` is set when all completed (or one failed)."""

    __slots__ = ("done", "error", "keep", "works")

    def __init__(self, works: list[Any], keep: list[torch.Tensor]) -> None:
        self.works, self.keep = works, keep
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Waiter:
    """A daemon thread, started at the first job, that blocks on works in submission order.

    gloo's ``wait`` releases the GIL. ``close`` queues a stop after the pending jobs.
    """

    def __init__(self, timeout: float) -> None:
        self._timeout = datetime.timedelta(seconds=timeout)
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the p2p waiter was closed; build a new Pipeline")
            if self._thread is None:
                args = (self._jobs, self._timeout)
                self._thread = threading.Thread(target=_wait_jobs, args=args, name="stagewise-p2p-waiter",
                                                daemon=True)  # fmt: skip
                self._thread.start()
        self._jobs.put(job)

    def close(self) -> None:
        with self._lock:
            if self._thread is not None and not self._closed:
                self._jobs.put(None)
            self._closed = True


def _wait_jobs(jobs: queue.SimpleQueue[Job | None], timeout: datetime.timedelta) -> None:
    """The waiter thread's loop, until a None job; it holds no reference to its Comm."""
    while (job := jobs.get()) is not None:
        try:
            for w in job.works:
                w.wait(timeout)
        except BaseException as exc:  # reported by the host thread, never lost here
            job.error = exc
        job.keep = []
        job.done.set()
