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
collected) and stops when closed. On NCCL nothing blocks in the backend (the
host polls), so no thread is needed there.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["CHECK_STORE_S", "PeerFailure", "PipelineTimeout", "Watchdog", "close_pairs"]

CHECK_STORE_S = 0.05  # how often a waiting rank reads the failure key
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


class Watchdog:
    """A daemon thread, started at the first blocking wait, that closes ``pairs`` on a published failure.

    ``blocked`` counts the host's waits in progress (the thread only reads it:
    a stale read costs at most one extra store read).
    """

    def __init__(self, store: Any, key: str, pairs: Pairs) -> None:
        self.blocked = 0
        self._args = (store, key, list(pairs))
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(
            target=_watch, args=(self, *self._args), name="stagewise-p2p-watchdog", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self._stop.set()


def _watch(dog: Watchdog, store: Any, key: str, pairs: Pairs) -> None:
    """The watchdog's loop, until closed: on a published failure, close the pairs once."""
    while not dog._stop.wait(CHECK_STORE_S):
        if dog.blocked <= 0:
            continue
        try:
            failed = store.check([key])
        except Exception:  # the store is gone: the launcher is tearing the job down
            return
        if failed:
            close_pairs(pairs)
            return
