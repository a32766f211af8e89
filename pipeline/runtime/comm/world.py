"""The world group's NCCL communicator and its pairs with rank 0, made at a Pipeline's construction.

    # r: a rank, n: the world's ranks

Checkpoints (``pipeline.checkpointing``) run on the world group, through torch itself:
``all_gather_object`` (every check's outcome, ``checkpoint/ranks.py``), ``barrier``, and
``torch.distributed.checkpoint``, whose coordinator is rank 0: it broadcasts and all-gathers, and
gathers every rank's plan to rank 0 and scatters the result back, which ProcessGroupNCCL runs as
point-to-point messages between rank 0 and each rank. On NCCL the world's communicator is made
at its first collective (unless ``init_process_group(device_id=...)`` made it), and each pair's
connection at its first message, at any ``NCCL_RUNTIME_CONNECT``: left to the first save, a peer
that failed but lives would hold every rank in a call that nothing of the pipeline's can
interrupt. So on the NCCL path (emulated too) a Pipeline's construction makes them, under its
creation guard (arrival.py), once per world and process::

    every rank   all-reduce of one zero on the world        its communicator (and, with
                                                             NCCL_RUNTIME_CONNECT=0, every algorithm)
    then         (0 -> 1) (1 -> 0) (0 -> 2) (2 -> 0) ...     each pair's first message, in this one
                                                             order on every rank (collectives.py)

It uses a ``Comm`` of its own on the world, without channels, so that the messages go on the world
group itself even between neighbours (whose pipeline messages travel on their channels, other
communicators), and closes it: later saves post nothing of ours. Under the emulation ``calling``
makes a checkpoint a call after construction and checks the world's operations it will run
(``emulation.uses``): a communicator or pair made there raises, naming it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from pipeline.runtime.comm import emulation
from pipeline.runtime.comm.p2p import Comm
from pipeline.runtime.comm.transport import process_group

__all__ = ["calling", "connect", "pairs"]

# the worlds (default groups) whose communicator and pairs this process has made: once per world
_connected: weakref.WeakSet[Any] = weakref.WeakSet()


def pairs(n: int) -> list[tuple[int, int]]:
    """(sender, receiver) of every message between rank 0 (torch.distributed.checkpoint's coordinator)
    and the other ranks of a world of ``n``, in the one order every rank makes them."""
    return [pair for r in range(1, n) for pair in ((0, r), (r, 0))]


def connect(timeout: float, failure: tuple[Any, str], key_prefix: str) -> None:
    """The world's communicator and its pairs with rank 0 (see the module docstring), unless made
    already in this process. Call on every rank of the world, at the same point of construction;
    every wait is bounded by ``timeout`` and watches ``failure`` (the pipeline's key)."""
    world = process_group(None)
    if world in _connected:
        return
    comm = Comm(None, key_prefix, timeout, failure=failure, p2p=False, global_names=True)
    try:
        comm.collectives.make_group()
        for a, b in pairs(comm.world_size):
            what = f"rank {a} -> rank {b}'s first message on the world group (checkpoints; at construction)"
            comm.collectives.first_message(a, b, what)
    finally:
        comm.close()
    _connected.add(world)


@contextlib.contextmanager
def calling(emulated: bool, what: str) -> Iterator[None]:
    """Under the NCCL emulation (``emulated``): the inside of a call (``what``, e.g. a checkpoint's
    save) that runs torch's own operations on the world group, checked first as if posted here."""
    if not emulated or not dist.is_initialized():  # type: ignore[no-untyped-call]
        yield
        return
    with emulation.stepping():
        n = dist.get_world_size()
        emulation.uses(process_group(None), n, dist.get_rank(), f"{what} on the world group", pairs(n))
        yield
