"""Failure errors and the watchdog thread that wakes a rank blocked in gloo when a peer fails.

    # r: this rank, q: a peer rank

gloo's blocking waits cannot be interrupted: ``abort()`` and ``shutdown()`` of a
backend wake neither its own waits nor its peers'. But a pair's closure wakes
every wait on that pair, on both sides, with an error, and a receive on an
unused tag that times out closes its pair. So one watchdog thread per ``Comm``,
asleep unless the host is blocked, reads the failure key every 50 ms; once it
is set, the watchdog closes every pair it was given (the group's, and the
channels' under the NCCL emulation), the host's wait raises, and the host
raises ``PeerFailure`` naming the failed rank::

    rank 1: stage raises -> publish("rank 1 failed: ...") -> re-raise
    rank 0: blocked in 0RECV_B2 -> watchdog sees the key -> closes rank 0's pairs
            -> the wait raises -> PeerFailure("rank 1 failed while rank 0 waited for 0RECV_B2 ...")

The thread holds no reference to its ``Comm`` (so that the ``Comm`` can be
collected) and only weak ones to the backends it closes (so that it never
destroys one: see ``Watchdog``), and stops when closed, and at the latest when
the interpreter exits: an ``atexit`` hook stops every watchdog thread and waits for it. A
daemon thread still inside a torch call when the interpreter finalizes (a
pair's closing ``Work.wait``, a store read) is ended by CPython with
``pthread_exit`` as it retakes the GIL; the unwinding meets pybind11's
``noexcept`` ``~gil_scoped_release`` and std::terminate aborts the process
("terminate called without an active exception", status -6) after a rank
raised ``PeerFailure``, when the main thread outran its watchdog. On NCCL nothing blocks in the backend (the
host polls), so no thread is needed there.

A rank that dies without a word (SIGKILL, the OOM killer, a native crash)
publishes nothing, and its neighbours only see a lost connection. So that the
rank that died is named, not the first one that noticed, every rank records
its process (host, pid namespace, pid) in the store (``Liveness``); a rank
whose wait broke looks first for a peer on its own host whose process is gone,
and publishes the failure in that peer's name::

    rank 1: SIGKILL                                   (publishes nothing)
    rank 2: recv from 1 -> connection reset -> rank 1's pid is gone
            -> publish("1|rank 1's process (pid N) is gone ...") -> PeerFailure(rank 1 ...)
    rank 3: blocked on rank 2 -> watchdog sees the key -> PeerFailure(rank 1 ...)

When the dead rank hosted the store (rank 0 of a job started from MASTER_ADDR
/ MASTER_PORT without torchrun's agent), the store is gone too: a rank then
stops using it (``Liveness.store_gone``), and its watchdog, which checks the
host's process before each read, closes the pairs instead. A store call in
flight when the host dies cannot be avoided (on a loaded machine a read takes
tens of ms, so the watchdog is often inside one), and torch's client prints
each failed call as a C++ warning with its frames (``recvValue failed``,
``sendBytes failed``); so every store call of the pipeline runs under
``quiet_store``, which raises c10's log level (``FLAGS_caffe2_log_level``,
read by every log call, unlike TORCH_CPP_LOG_LEVEL, read once at import) to
errors for its duration, and the failure is reported as our own error instead.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import os
import socket
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pipeline.runtime.comm.proc import process_alive

__all__ = [
    "CHECK_STORE_S",
    "Liveness",
    "PeerFailure",
    "PipelineTimeout",
    "Watchdog",
    "close_pairs",
    "process_alive",
    "quiet_store",
]

CHECK_STORE_S = 0.05  # how often a waiting rank reads the failure key
_EXIT_JOIN_S = 10.0  # at exit, how long to wait for a watchdog inside a torch call
_CLOSE_TAG = 2**30 - 7  # never used by a message: a receive on it only ever times out


class PipelineTimeout(TimeoutError):
    """A wait on another rank ran past the timeout."""


class PeerFailure(RuntimeError):
    """Another rank failed while this one waited for it."""


# (gloo backend, group-local peer rank) pairs that a failure closes
Pairs = Sequence[tuple[Any, int]]


def close_pairs(pairs: Pairs) -> None:
    """Close each gloo pair: a receive on an unused tag timed out after 1 ms closes it."""
    dummy = torch.empty(1, device="cpu")
    for backend, peer in pairs:
        with contextlib.suppress(Exception):
            backend.recv([dummy], peer, _CLOSE_TAG).wait(datetime.timedelta(milliseconds=1))


_C10_ERROR = 2  # c10's log levels: 0 info, 1 warning, 2 error, 3 fatal
_quiet_lock = threading.Lock()
_quiet_depth = 0  # store calls in flight under quiet_store, all threads together
_quiet_saved = 0  # the level before the first of them
_NOT_FOUND: Any = object()
_level: Any = None  # ctypes.c_int32 of c10's FLAGS_caffe2_log_level, _NOT_FOUND, or None: not looked up


def _c10_log_level() -> Any:
    """c10's log level (the int every C++ log call reads), or None where it cannot be found (a
    build with gflags, another platform): then store failures print as torch prints them."""
    global _level
    if _level is None:
        _level = _NOT_FOUND
        lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
        for name in ("libc10.so", "libc10.dylib"):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                lib = ctypes.CDLL(os.path.join(lib_dir, name))  # loaded already: the same handle
                _level = ctypes.c_int32.in_dll(lib, "FLAGS_caffe2_log_level")
                break
    return None if _level is _NOT_FOUND else _level


@contextlib.contextmanager
def quiet_store() -> Iterator[None]:
    """Silence torch's C++ warnings while a store call that may meet a dead store host runs.

    The TCPStore client logs every failed call as a warning with its C++
    frames before it raises; the caller turns the exception into a few-line
    error naming the dead rank. The level is process-wide: a C++ warning of
    another thread during the call (well under a millisecond on a live store) is
    lost too; errors still print.
    """
    global _quiet_depth, _quiet_saved
    level = _c10_log_level()
    if level is None:
        yield
        return
    with _quiet_lock:
        if _quiet_depth == 0:
            _quiet_saved = level.value
            level.value = max(_quiet_saved, _C10_ERROR)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                level.value = _quiet_saved


def _machine() -> str:
    """This process's host and pid namespace: pids are comparable only within one."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{namespace}"


def hosts_world_store() -> bool:
    """True on the rank whose process serves the job's TCPStore: rank 0 under ``env://`` without
    torchrun's agent store (torch's own rule), so that its death is known to take the store along."""
    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
    except Exception:
        return False
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return type(store).__name__ == "TCPStore" and not agent and c10d.get_rank() == 0


class Liveness:
    """The processes of a group's ranks, recorded in the store, checked on this host without it.

    ``register`` sets this rank's entry (no wait); ``learn`` reads the peers'
    entries once they are all there (after the first step's agreement; a
    failure before that reads what is there). ``dead`` needs no store.
    """

    def __init__(self, store: Any, key: str, rank: int, n: int) -> None:
        self.store, self.key, self.rank, self.n = store, key, rank, n
        self.machine = _machine()
        self.pids: dict[int, int] = {}  # rank -> pid, for the peers on this host
        self.store_host: int | None = None  # the rank whose process serves the store, if any
        # a store call failed, or its host's process is gone: never call the store again (every
        # call would fail, and the watchdog stops reading it at once)
        self.store_gone = False

    def register(self) -> None:
        mine = f"{self.machine}|{os.getpid()}|{int(hosts_world_store())}"
        with contextlib.suppress(Exception), quiet_store():
            self.store.set(f"{self.key}/{self.rank}", mine)

    def learn(self) -> None:
        """Read every peer's entry that is set (a store that is gone: keep what is known)."""
        for q in range(self.n):
            if q == self.rank or q in self.pids:
                continue
            if self.store_lost():
                return
            k = f"{self.key}/{q}"
            try:
                with quiet_store():
                    if not self.store.check([k]):
                        continue
                    entry = bytes(self.store.get(k)).decode()
            except Exception:  # the store is gone
                self.store_gone = True
                return
            machine, pid, hosts = entry.rsplit("|", 2)
            if machine == self.machine:
                self.pids[q] = int(pid)
                if hosts == "1":
                    self.store_host = q

    def dead(self) -> list[int]:
        """The peers on this host whose process is gone."""
        return [q for q, pid in sorted(self.pids.items()) if not process_alive(pid)]

    def store_lost(self) -> bool:
        """The store is gone: a call failed, or the rank that served it is known and its process is gone."""
        q = self.store_host
        if not self.store_gone and q is not None and not process_alive(self.pids[q]):
            self.store_gone = True
        return self.store_gone


class Watchdog:
    """A daemon thread, started at the first blocking wait, that closes ``pairs`` on a published failure.

    ``blocked`` counts the host's waits in progress (the thread only reads it:
    a stale read costs at most one extra store read).
    """

    def __init__(self, store: Any, key: str, pairs: Pairs, liveness: Liveness | None = None) -> None:
        self.blocked = 0
        # the backends weakly: the thread must never be a process group's last owner. Its destructor
        # releases the GIL to join gloo's workers and takes it back: a thread doing so while the
        # interpreter finalizes is ended mid-destructor, and std::terminate aborts the process
        weak = [(weakref.ref(backend), peer) for backend, peer in pairs]
        self._args = (store, key, weak, liveness)
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(
            target=_watch, args=(self, *self._args), name="stagewise-p2p-watchdog", daemon=True
        )
        self.thread.start()
        _running[self.thread] = self._stop

    def close(self) -> None:
        self._stop.set()


# every watchdog thread still running, and the event that stops it (the threads, not their
# Watchdogs: a thread holds its Watchdog until its last step, so the Watchdog may be gone before it)
_running: weakref.WeakKeyDictionary[threading.Thread, threading.Event] = weakref.WeakKeyDictionary()


@atexit.register
def _stop_all() -> None:
    """Before the interpreter finalizes: stop every watchdog thread and let it leave its torch call."""
    running = list(_running.items())
    for _, stop in running:
        stop.set()
    for thread, _ in running:
        thread.join(_EXIT_JOIN_S)


def _watch(
    dog: Watchdog, store: Any, key: str, pairs: list[tuple[weakref.ref[Any], int]], liveness: Liveness | None
) -> None:
    """The watchdog's loop, until closed: on a published failure, or once the store is gone (its
    host died, or the launcher is tearing the job down), close the pairs once."""
    while not dog._stop.wait(CHECK_STORE_S):
        if dog.blocked <= 0:
            continue
        try:
            if liveness is not None and liveness.store_lost():
                failed = True
            else:
                with quiet_store():
                    failed = store.check([key])
        except Exception:
            failed = True
            if liveness is not None:
                liveness.store_gone = True
        if failed:
            close_pairs([(backend, peer) for ref, peer in pairs if (backend := ref()) is not None])
            return
