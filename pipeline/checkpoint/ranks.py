"""The ranks of a checkpoint: who this is, and failures raised together on every rank.

Saving and loading are collective (``torch.distributed.checkpoint`` gathers
plans, the folder is renamed after a barrier). A rank that raised before such a
collective would leave the others waiting in it until the process group's
timeout, so each check's outcome is gathered first (``together``): a failure on
any rank is then raised on every rank at once, naming the rank.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["barrier", "distributed", "from_rank0", "rank", "together", "world"]

_KINDS: dict[str, type[Exception]] = {"TypeError": TypeError, "FileNotFoundError": FileNotFoundError}


def distributed() -> bool:
    return bool(dist.is_initialized())  # type: ignore[no-untyped-call]


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world() -> int:
    return dist.get_world_size() if distributed() else 1


def barrier() -> None:
    if distributed():
        dist.barrier()


def together(error: Exception | None, payload: Any) -> list[Any]:
    """Every rank's ``payload``; or, when a rank failed (``error``), that error raised on every rank."""
    if not distributed():
        if error is not None:
            raise error
        return [payload]
    gathered: list[Any] = [None] * dist.get_world_size()
    mine = None if error is None else (type(error).__name__, str(error), getattr(error, "errno", None))
    dist.all_gather_object(gathered, (mine, payload))
    if error is not None:
        raise error
    for r, (theirs, _) in enumerate(gathered):
        if theirs is not None:
            name, text, errno = theirs
            if errno is not None:  # an OSError (a full disk ...): keep its errno for the caller
                raise OSError(errno, f"rank {r} failed: {text}")
            raise _KINDS.get(name, ValueError)(f"rank {r} failed: {text}")
    return [p for _, p in gathered]


def from_rank0(error: Exception | None, payload: Any) -> Any:
    """Rank 0's ``payload`` on every rank (what rank 0 decided or read), after ``together``."""
    return together(error, payload)[0]
