"""Ranks agreeing on a configuration before anything of different sizes can meet in a message.

    # r: this rank, q: another rank of the group

Each rank publishes its configuration (one line: the schedule's text, m, the balance, ...) in
the store under ``key/r`` and reads every other rank's; the first that differs is returned, for
the caller to name in its own terms (the pipeline's ranks, or the replicas of one pipeline rank).
Reading the store is bounded by the Comm's timeout and watches its failure key, like every wait.
"""

from __future__ import annotations

from pipeline.runtime.comm.p2p import Comm

__all__ = ["agree", "summary"]


def agree(comm: Comm, key: str, mine: str) -> tuple[int, str] | None:
    """Publish ``mine`` and read every rank's: the first (group rank, its configuration) that differs
    from ``mine``, or None when all agree. Call on every rank of ``comm``'s group."""
    comm.set_key(f"{key}/{comm.rank}", mine.encode())
    for q in range(comm.world_size):
        theirs = comm.wait_key(f"{key}/{q}", f"rank {comm.name(q)}'s configuration").decode()
        if theirs != mine:
            return q, theirs
    return None


def summary(config: str) -> str:
    """A configuration ``schedule text|field|field...`` in one line, for an error message."""
    text, *rest = config.split("|")
    return f"{', '.join(rest)}, schedule {' / '.join(text.splitlines())!r}"
