"""Collectives on a pipeline's (or its replicas') group, and every communicator made up front.

    # r: this rank, p: ranks

Collectives run on the group itself, never on the channels (channels.py), so
they never queue behind a message. Each is started (``start_all_reduce``, or
inside ``broadcast`` / ``all_reduce``) and then waited for like a receive
(``finish``): the transport's timeout and failure watch (transport.py).

NCCL makes a communicator at its first operation, a blocking rendezvous of its
ranks outside every timeout of ours, so a peer that died before would hang a
step there. So on the NCCL path (emulated too) a pipeline's communicators are
made at construction (``make_communicators``), once every rank has arrived
there (arrival.py), in one order:

    1. the group's own: an all-reduce of one zero on every rank (the loss, the
       norm, and messages between non-neighbours, whose first operation would
       leave the other ranks out)
    2. each channel's first message, in ``Channels.directions`` order, the same
       list on every rank; a rank takes part in those it is an end of:

           p = 3     (0,1)  (0,2)  (1,0)  (1,2)  (2,0)  (2,1)
           rank 0    send   send   recv     .    recv     .
           rank 1    recv     .    send   send     .    recv
           rank 2      .    recv     .    recv   send   send

       every rank's list is a part of one global order, so the first message
       not yet through always has both its ends waiting on it: no two ranks
       wait on each other.

The channels are made once per group and shared by its pipelines, so step 2
runs once per group (``Channels.prepared``), step 1 for each ``Comm`` that has
channels (a collectives-only ``Comm``, ``p2p=False``, makes none up front).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeline.runtime.comm.transport import Transport

__all__ = ["Collectives"]


class Collectives:
    """The collectives of ``transport``'s group: this rank ``rank``, the group's ranks' global ranks
    ``global_ranks``; ``names[q]``: how errors name group rank q."""

    def __init__(
        self, transport: Transport, rank: int, global_ranks: Sequence[int], names: Sequence[int]
    ) -> None:
        self.transport, self.rank = transport, rank
        self.group = transport.group
        self._global, self._names = list(global_ranks), list(names)
        # waited for like a receive: the transport's timeout and failure watch (bound, not wrapped: a
        # traceback ends where the wait was)
        self.finish = transport.finish

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """``dist.broadcast`` from group rank ``src``, waited for like a receive."""
        self._collective(
            tensor, lambda: dist.broadcast(tensor, self._global[src], group=self.group, async_op=True), what
        )

    def all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> None:
        """``dist.all_reduce`` over the group, in place, waited for like a receive."""
        self._collective(tensor, self._all_reduce_op(tensor, op), what)

    def start_all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> Any:
        """``dist.all_reduce`` over the group, in place, started: its work, for ``finish``."""
        return self._start(tensor, self._all_reduce_op(tensor, op), what)

    def make_communicators(self) -> None:
        """The group's and its channels' first operations, here at construction, not in a step (see
        the module's docstring); each message is waited for with the timeout and the failure watch."""
        t = self.transport
        ch = t.channels
        if ch is None:
            return
        # the group's own communicator: the loss, the norm, and messages between non-neighbours
        # (predict(dst=), gather_state_dict), whose first operation would leave the other ranks out
        one = torch.zeros((1,), dtype=torch.float32, device=t.device)
        self.all_reduce(one, dist.ReduceOp.SUM, "the group's communicator (every rank)")
        if ch.prepared:
            return
        for a, b in ch.directions:
            if self.rank not in (a, b):
                continue
            what = f"channel {self._names[a]} -> {self._names[b]}'s first message (made at construction)"
            msg = [torch.zeros((1,), dtype=torch.float32, device=t.device)]
            works = t.post([(msg, b)], [], what) if self.rank == a else t.post([], [(msg, a)], what)
            t.wait(works[0], what)
        ch.prepared = True

    def _all_reduce_op(self, tensor: torch.Tensor, op: Any) -> Callable[[], Any]:
        return lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True)

    def _collective(self, tensor: torch.Tensor, start_op: Callable[[], Any], what: str) -> None:
        self.finish(self._start(tensor, start_op, what), what)

    def _start(self, tensor: torch.Tensor, start_op: Callable[[], Any], what: str) -> Any:
        t = self.transport
        t.check_open(what)
        t.check(tensor, what)
        t.before_collective(len(self._global), what)
        try:
            work = start_op()
        except Exception as exc:  # a peer that is gone already
            t.fail(what, exc)
        if work is None:
            raise RuntimeError(f"rank {t.me}: {what} returned no work to wait for")
        return work
