"""Every rank at a Pipeline's construction before any NCCL communicator or group is made.

    # r: this rank, q: a peer rank

NCCL makes a communicator in a blocking rendezvous of its ranks (``ncclCommInitRank`` at a group's
first operation; a split of the world's communicator in ``dist.new_group`` once the device is
bound) that no timeout or failure watch of ours can enter: a rank whose peer died before it waits
there for good, and names nobody. So on the NCCL path (emulated too) each rank first records its
process in the world's store and waits, with the pipeline's timeout and its peers' liveness, until
every rank of the pipeline's group has come; only then are the mesh, the channels, the tie groups
and their first messages made (collectives.py)::

    rank 0   arrive --- wait for 1, 2 ......................... mesh, channels, communicators
    rank 1   arrive --- wait for 2 ... rank 2's pid is gone ---> PeerFailure(rank 2 ...)   (its host)
    rank 2   arrive     SIGKILL
    (a rank that never arrives: PipelineTimeout naming it once the timeout has passed)

A peer on another host is named by the timeout; one on this host as soon as its process is gone
(``Liveness``, watchdog.py). Not covered: a peer that dies after every rank arrived and inside
NCCL's own rendezvous (well under a second); the launcher (``pipeline.launch``, torchrun) ends the
job then.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from pipeline.runtime.board import FailureBoard
from pipeline.runtime.watchdog import Liveness, PeerFailure, PipelineTimeout, quiet_store

__all__ = ["arrive"]

_POLL_S = 0.005
_counts: dict[tuple[int, ...], itertools.count[int]] = {}  # per group of ranks: constructions so far


def arrive(
    store: Any,
    members: tuple[int, ...],
    rank: int,
    timeout: float,
    what: str,
    board: FailureBoard | None = None,
) -> None:
    """Record global rank ``rank`` as arrived at the n-th such point on ``members`` (global ranks, the
    same order on every rank) and wait until all have; ``what`` names the point. With ``board``, a
    failure published there (a rank whose construction raised) ends the wait naming that rank."""
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
            return
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
