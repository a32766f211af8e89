"""Every rank at a Pipeline's construction before any NCCL communicator or group is made.

    # r: this rank, q: a peer rank

NCCL makes a communicator in a blocking rendezvous of its ranks (``ncclCommInitRank`` at a group's
first operation; a split of the world's communicator in ``dist.new_group`` once the device is
bound) that no timeout or failure watch of ours can enter: a rank whose peer died before it waits
there for good, and names nobody. So on the NCCL path (emulated too) each rank first records its
process in the world's store and waits, with the pipeline's timeout and its peers' liveness, until
every rank of the pipeline's group has come; only then are the mesh, the channels, the world
group's communicator (world.py), the replicas' and tie groups and their first messages made
(collectives.py)::

    rank 0   arrive --- wait for 1, 2 ......................... mesh, channels, communicators
    rank 1   arrive --- wait for 2 ... rank 2's pid is gone ---> PeerFailure(rank 2 ...)   (its host)
    rank 2   arrive     SIGKILL
    (a rank that never arrives: PipelineTimeout naming it once the timeout has passed)

A peer on another host is named by the timeout; one on this host as soon as its process is gone
(``Liveness``, watchdog.py).

A peer can still die after every rank arrived, while NCCL makes a communicator. Its peers are then
inside ``ncclCommInitRank`` (or a split), a blocking C call that nothing can abort: NCCL offers no
abort for a communicator still being made, and torch's NCCL watchdog watches only work already
queued. So while the communicators are made (``Arrived.creating``) a guard thread watches the peers
that arrived. A peer whose process is gone, or a failure on the board, that the main thread has not
raised on itself within ``_GRACE_S`` ends this process: one line on stderr naming the peer and the
communicator, then exit status ``CREATION_EXIT``. That is torch's own policy for a communicator it
cannot recover (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), and ``launch`` or torchrun then ends the job::

    rank 0   arrived ... ncclCommInitRank(channel 1 -> 0) ......... guard: rank 1 is gone -> exit 75
    rank 1   arrived ... SIGKILL

The thread runs only where the C call released the GIL. c10d's bindings of collectives do, but
``perform_nocolor_split`` (every rank outside a new group runs it once the device is bound) holds it.
So the creation also arms a watch process (proc.py, started at the first creation, ended by
``close``) that checks the same peers' pids without the GIL. ``_WATCH_AFTER_S`` after the guard's
grace, while still armed, it writes its own line and SIGKILLs the rank. Only the thread reads the
board, so a failure on another host is seen only where the GIL was released. Under the emulation
the creation waits in Python. The tests hold the GIL in a C call to prove the watch.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from pipeline.runtime.comm import proc
from pipeline.runtime.comm.board import FailureBoard
from pipeline.runtime.comm.watchdog import Liveness, PeerFailure, PipelineTimeout, quiet_store

__all__ = ["CREATION_EXIT", "Arrived", "arrive", "creating"]

CREATION_EXIT = 75  # the exit status of a rank its creation guard ended
_POLL_S = 0.005
_GUARD_POLL_S = 0.05  # how often the creation guard looks at the peers
_GRACE_S = 2.0  # how long a failure may stay unraised by the main thread before the guard ends it
_WATCH_AFTER_S = 3.0  # then how long the watch process waits for the guard thread before it ends the rank
_counts: dict[tuple[int, ...], itertools.count[int]] = {}  # per group of ranks: constructions so far


def arrive(
    store: Any,
    members: tuple[int, ...],
    rank: int,
    timeout: float,
    what: str,
    board: FailureBoard | None = None,
) -> Arrived:
    """Record global rank ``rank`` as arrived at the n-th such point on ``members`` (global ranks, the
    same order on every rank) and wait until all have; ``what`` names the point. With ``board``, a
    failure published there (a rank whose construction raised) ends the wait naming that rank.
    Returns the ranks that arrived, whose ``creating`` guards the communicators made next."""
    n = next(_counts.setdefault(members, itertools.count()))
    key = f"stagewise/arrive{n}/{'_'.join(map(str, members))}"
    me = members.index(rank)
    liveness = Liveness(store, key, me, len(members))
    liveness.register()
    missing = [q for q in range(len(members)) if q != me]
    deadline = time.monotonic() + timeout
    while True:
        with quiet_store():
            missing = [q for q in missing if not store.check([f"{key}/{q}"])]
        if not missing:
            liveness.learn()
            return Arrived(liveness, members, rank, board)
        waited = f"ranks {[members[q] for q in missing]} at {what}"
        failed = board.first() if board is not None else None
        if failed is not None:
            raise PeerFailure(f"rank {failed[0]} failed while rank {rank} waited for {waited}: {failed[1]}")
        liveness.learn()  # the peers that arrived: their processes, on this host
        dead = liveness.dead()
        if dead:
            q = dead[0]
            raise PeerFailure(
                f"rank {members[q]}'s process (pid {liveness.pids[q]}) is gone: it arrived and then died "
                f"(SIGKILL, the OOM killer, a native crash) while rank {rank} waited for {waited}"
            )
        if time.monotonic() > deadline:
            raise PipelineTimeout(
                f"rank {rank} timed out after {timeout:g} s waiting for {waited}, where NCCL makes "
                "communicators next (a rendezvous of every rank that no timeout covers); check that "
                "those ranks are alive and construct the same Pipelines in the same order"
            )
        time.sleep(_POLL_S)


class Arrived:
    """The ranks of ``members`` that arrived (their processes in ``liveness``); ``board``: the failures
    their pipeline publishes, once it has one (the construction's first arrival comes before it).
    ``close`` once the communicators are made (it ends the creation watch)."""

    def __init__(
        self, liveness: Liveness, members: tuple[int, ...], rank: int, board: FailureBoard | None
    ) -> None:
        self.liveness, self.members, self.rank, self.board = liveness, members, rank, board
        self._watch: subprocess.Popen[bytes] | None = None

    @contextlib.contextmanager
    def creating(self, what: str) -> Iterator[None]:
        """Guard the making of ``what`` (communicators, groups): see the module's docstring."""
        done = threading.Event()
        guard = threading.Thread(
            target=self._guard, args=(what, done), name="stagewise-creation-guard", daemon=True
        )
        guard.start()
        self._tell(f"arm {what}")
        try:
            yield
        finally:
            self._tell("disarm")
            done.set()
            guard.join()

    def close(self) -> None:
        """End the creation watch (its process exits when its pipe closes)."""
        if self._watch is not None:
            _close_pipe(self._watch)
            self._watch.wait()
            self._watch = None

    def failure(self) -> str | None:
        """What ended a peer, if anything has: its process gone, or a failure on the board (its
        message's first line)."""
        dead = self.liveness.dead()
        if dead:
            q = dead[0]
            return f"rank {self.members[q]}'s process (pid {self.liveness.pids[q]}) is gone"
        failed = self.board.first() if self.board is not None else None
        if failed is not None:
            return f"rank {failed[0]} failed: {failed[1].splitlines()[0] if failed[1] else ''}"
        return None

    def _tell(self, line: str) -> None:
        """Arm or disarm the watch process, started at the first creation."""
        if self._watch is None:
            peers = [f"{self.members[q]}:{pid}" for q, pid in sorted(self.liveness.pids.items())]
            args = [str(os.getpid()), str(self.rank), str(_GRACE_S + _WATCH_AFTER_S), str(_GUARD_POLL_S)]
            self._watch = subprocess.Popen(
                [sys.executable, "-S", "-E", proc.__file__, *args, *peers], stdin=subprocess.PIPE
            )
            weakref.finalize(self, _close_pipe, self._watch)
        assert self._watch.stdin is not None
        with contextlib.suppress(OSError):  # a watch that is gone: the guard thread still runs
            self._watch.stdin.write(f"{line}\n".encode())
            self._watch.stdin.flush()

    def _guard(self, what: str, done: threading.Event) -> None:
        seen: tuple[float, str] | None = None  # when a failure was first seen, and what it was
        while not done.wait(_GUARD_POLL_S):
            try:
                why = self.failure() if seen is None else seen[1]
            except Exception:  # a store read that failed: look again at the next poll
                continue
            if why is None:
                continue
            if seen is None:
                seen = (time.monotonic(), why)
            if time.monotonic() - seen[0] < _GRACE_S or done.is_set():
                continue
            sys.stdout.flush()
            sys.stderr.write(
                f"stagewise: rank {self.rank} is ending its process (exit status {CREATION_EXIT}): {why} "
                f"while NCCL made {what}, a blocking rendezvous that cannot be aborted and would wait "
                "for that rank forever\n"
            )
            sys.stderr.flush()
            os._exit(CREATION_EXIT)


def _close_pipe(watch: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        assert watch.stdin is not None
        watch.stdin.close()


def creating(arrived: Arrived | None, what: str) -> contextlib.AbstractContextManager[None]:
    """``arrived.creating(what)``; nothing to guard off the NCCL path (``arrived`` None)."""
    return arrived.creating(what) if arrived is not None else contextlib.nullcontext()
