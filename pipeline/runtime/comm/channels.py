"""The NCCL path's lanes: one two-rank process group per ordered pair of neighbouring ranks.

    # r: this rank, q: a peer rank, p: ranks

NCCL runs a communicator's operations in order on one stream, and each one
waits on the GPU for its peer. If r's sends to q and its receives from q shared
a communicator, a send posted before a receive would hold the receive back
until q took the send, while q might do the same the other way round: a
deadlock that depends on how each rank interleaves the two directions. With
one channel per direction,

    channel r -> q:  r's sends to q, in r's order   ==  q's receives from r, in q's order
    channel q -> r:  q's sends to r, in q's order   ==  r's receives from q, in r's order

each channel is a FIFO whose two ends post the same messages in the same order
(``validate``'s per-pair order check proves it for every schedule), so no
channel waits on another and no send ever holds the host or the compute
stream back: a schedule runs exactly when it runs in the validator's
non-blocking-send model, its default, interleaved with m > p included.

Messages between ranks that are not neighbours (``gather_state_dict``'s and
``predict(dst=)``'s, outside the schedule) go on the pipeline's group itself
(``off_channel``: every such pair, whose first message is sent at construction,
since NCCL connects a pair at its first message; collectives.py). A message is
posted as one group on its channel (several tensors: one NCCL
group, which completes when all of it is matched, as the peer's single group
does); ``post`` returns one transfer per group, as NCCL returns one work per
batch. Collectives never use the channels, so they never queue behind them.

The groups are made with ``dist.new_group``, which every rank of the world
calls in the same order, once per process group (pipelines on one group share
them: each NCCL communicator holds device buffers). With replicas of the
pipeline (a mesh, mesh.py), every rank makes the channels of every replica's
pipeline, replica by replica, and keeps its own. Under the emulation they
are gloo groups and ``post`` returns emulation.py's ``EmuTransfer``.
"""

from __future__ import annotations

import contextlib
import datetime
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeline.runtime.comm import emulation
from pipeline.runtime.comm.emulation import EmuTransfer
from pipeline.runtime.comm.watchdog import Pairs, close_pairs

__all__ = [
    "Channels",
    "NcclTransfer",
    "Op",
    "Transfer",
    "abort_nccl",
    "channels_for",
    "post_ops",
]

# one op of a group: (tensor, peer rank in the pipeline's group, is a send)
Op = tuple[torch.Tensor, int, bool]


class NcclTransfer:
    """The work(s) NCCL returned for one posted group, and its tensors, kept alive until ordered."""

    __slots__ = ("tensors", "works")

    def __init__(self, works: list[Any], tensors: list[torch.Tensor]) -> None:
        self.works, self.tensors = works, tensors

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def order(self, stream: torch.cuda.Stream) -> None:
        """``stream`` runs on only after the transfer (an event wait on the device; the host goes on).

        Its tensors are dropped here: whatever the stream (and the caching allocator, which hands a
        freed block only to work on the stream it was made on) runs next comes after the transfer,
        and a transfer kept for a stuck report (the executor's recent receives) must not keep them."""
        with torch.cuda.stream(stream):
            for w in self.works:
                w.wait()
        self.tensors = []


Transfer = NcclTransfer | EmuTransfer


class Channels:
    """This rank's channels in a pipeline group of ``len(global_ranks)`` ranks (group rank ``rank``)."""

    def __init__(
        self,
        group: Any,
        rank: int,
        global_ranks: list[int],
        backend: str,
        timeout: datetime.timedelta,
        pipelines: list[list[int]] | None = None,
    ) -> None:
        n = len(global_ranks)
        rows = pipelines if pipelines is not None else [global_ranks]
        covered = sorted(g for row in rows for g in row)
        if covered != list(range(dist.get_world_size())) or global_ranks not in rows:
            raise ValueError(
                f"the pipelines' process groups hold ranks {covered} of the world's "
                f"{dist.get_world_size()}; on NCCL (and its emulation) the pipeline's channels are made "
                "with dist.new_group, which every rank of the world calls: pass group=None, or a mesh "
                "that spans the world (mesh=)"
            )
        from torch.distributed import distributed_c10d as c10d

        self.rank, self.emulated, self._global = rank, backend == "gloo", global_ranks
        # weak: the cache below is keyed by the group, which its value must not keep alive
        self._group = weakref.ref(group if group is not None else c10d._get_default_group())
        pairs = sorted({(a, (a + d) % n) for a in range(n) for d in (1, -1) if (a + d) % n != a})
        self.directions = pairs  # (src, dst) of every channel, in the one order every rank uses
        # every other ordered pair, whose messages go on the group itself (the same order everywhere)
        self.off_channel = [(a, b) for a in range(n) for b in range(n) if a != b and (a, b) not in pairs]
        self.prepared = False  # the first message of each channel and off-channel pair sent (at construction)
        # (src, dst) -> (group, dst-or-src's rank in it, its global rank)
        self._lanes: dict[tuple[int, int], tuple[Any, int, int]] = {}
        for row in rows:  # the same order on every rank: dist.new_group is collective
            for a, b in pairs:
                pg = dist.new_group([row[a], row[b]], timeout=timeout, backend=backend)
                if row == global_ranks and rank in (a, b):
                    peer = global_ranks[b if rank == a else a]
                    self._lanes[(a, b)] = (pg, dist.get_group_rank(pg, peer), peer)
        # the emulation's gloo pairs, their backends held here: a watchdog keeps weak references
        # only (watchdog.py), and a backend's Python object lives only while something holds it (one
        # made for the call would be gone at once, and a failure would close none of these pairs)
        cpu = torch.device("cpu")
        self._pairs: list[tuple[Any, int]] = (
            [(pg._get_backend(cpu), peer) for pg, peer, _ in self._lanes.values()] if self.emulated else []
        )

    def _lane(self, q: int, send: bool) -> tuple[Any, int, int]:
        """(group, q's rank in it, q's global rank): q's channel, or the pipeline's group."""
        lane = self._lanes.get((self.rank, q) if send else (q, self.rank))
        if lane is None:  # not a neighbour: only outside the step (gather_state_dict)
            return self._group(), q, self._global[q]
        return lane

    def post(self, ops: Sequence[Op], what: str) -> Transfer:
        """Post ``ops`` as one group; receives fill their tensors once the transfer is ordered."""
        lanes = {self._lane(q, send) for _, q, send in ops}
        if len(lanes) != 1:  # an NCCL group on several channels would couple them again
            raise RuntimeError(f"{what}: one NCCL group must stay on one channel, got {len(lanes)}")
        ((pg, peer, global_peer),) = lanes
        return post_ops(pg, [(t, peer, global_peer, send) for t, _, send in ops], what, self.emulated)

    def pairs(self) -> Pairs:
        """The gloo pairs a failure closes (the emulation's channels); none on NCCL."""
        return list(self._pairs)

    def abort(self) -> None:
        """After a failure: stop every transfer in flight, so that waits raise and exit never hangs."""
        if self.emulated:
            close_pairs(self.pairs())
            return
        abort_nccl([pg for pg, _, _ in self._lanes.values()])


def post_ops(
    pg: Any, ops: Sequence[tuple[torch.Tensor, int, int, bool]], what: str, emulated: bool
) -> Transfer:
    """Post ``ops`` (tensor, the peer's rank in ``pg``, its global rank, whether a send) as one group
    on ``pg``: a channel, or a group itself; ``emulated``: on gloo, under the NCCL emulation, whose
    rules each message is checked against (``emulation.message``)."""
    if emulated:
        me, size = dist.get_rank(), dist.get_world_size(pg)
        be = pg._get_backend(torch.device("cpu"))
        works: list[Any] = []
        sent: list[torch.Tensor] = []
        received: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t, peer, global_peer, send in ops:
            emulation.message(pg, size, me if send else global_peer, global_peer if send else me, what)
            if send:
                works.append(be.send([t], peer, 0))
                sent.append(t)
            else:
                staging = torch.empty_like(t)
                works.append(be.recv([staging], peer, 0))
                received.append((t, staging))
        return EmuTransfer(works, sent, received, what)
    tensors = [t for t, _, _, _ in ops]
    # always batched, one tensor too: ProcessGroupNCCL runs a batch on the group's communicator
    # but a lone send/recv on a second one, keyed by the pair, with its own stream and setup;
    # the channel would be two queues, not one FIFO (and hold two communicators' memory)
    p2p = [dist.P2POp(dist.isend if send else dist.irecv, t, peer, pg) for t, _, peer, send in ops]
    return NcclTransfer(list(dist.batch_isend_irecv(p2p)), tensors)


def abort_nccl(groups: Sequence[Any]) -> None:
    """Abort the NCCL communicators of ``groups``, all of them inside one NCCL group call where the
    torch build allows it (aborting them one by one can wait on a kernel of the next one).

    ``ProcessGroup.abort()`` exists from torch 2.7; older builds abort through the NCCL backend
    object, so that an abort is never silently a no-op.
    """
    nccl: Any = None
    with contextlib.suppress(Exception):
        nccl = groups[0]._get_backend(torch.device("cuda")) if groups else None
    grouped = nccl is not None and hasattr(nccl, "_group_start") and hasattr(nccl, "_group_end")
    if grouped:  # as torch's own _abort_process_group does (pytorch issue 119797)
        try:
            nccl._group_start()
        except Exception:
            grouped = False
    try:
        for pg in groups:
            try:
                pg.abort()
            except Exception:
                with contextlib.suppress(Exception):
                    pg._get_backend(torch.device("cuda")).abort()
    finally:
        if grouped:
            with contextlib.suppress(Exception):
                nccl._group_end()


# per pipeline process group: made once (dist.new_group is collective), shared by its pipelines
_made: weakref.WeakKeyDictionary[Any, Channels] = weakref.WeakKeyDictionary()


def channels_for(
    group: Any,
    rank: int,
    global_ranks: list[int],
    backend: str,
    timeout: datetime.timedelta,
    pipelines: list[list[int]] | None = None,
) -> Channels:
    """The channels of ``group`` (None: the world), made at the first call on every rank; with
    ``pipelines`` (every replica's global ranks, ``group`` one of them) those of every replica."""
    from torch.distributed import distributed_c10d as c10d

    key = group if group is not None else c10d._get_default_group()
    made = _made.get(key)
    if made is None:
        made = _made[key] = Channels(group, rank, global_ranks, backend, timeout, pipelines)
    return made
