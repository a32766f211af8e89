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
    3. then, in the same way, the first message of every other ordered pair
       (``Channels.off_channel``: ranks that are not neighbours, p >= 4), on
       the group itself, where ``predict(dst=)``, ``evaluate(dst=)`` and
       ``gather_state_dict(dst)`` send theirs: NCCL connects a pair at its
       first message, at any NCCL_RUNTIME_CONNECT.

Making a communicator is not connecting it: NCCL 2.22 and later connect a
collective algorithm at its first use unless ``NCCL_RUNTIME_CONNECT=0``, which
``import pipeline`` sets (pipeline/nccl_env.py), so that step 1 and the other
groups' first collectives connect every algorithm a later size may pick. A
one-float warm-up alone would connect only the algorithm NCCL picks for one
float. Point-to-point connections are per pair at any setting: one message each
(steps 2 and 3) connects them for every size.

The channels are made once per group and shared by its pipelines, so steps 2 and
3 run once per group (``Channels.prepared``), step 1 for each ``Comm`` that has
channels. A collectives-only ``Comm`` (``p2p=False``) makes nothing up front;
its owner calls ``make_group`` (the replicas' group, replicas.py), or its first
collective comes at construction (a tie's broadcast, ties.py; the world's,
world.py).
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

    def make_group(self) -> None:
        """The group's own communicator: an all-reduce of one zero on every rank (connected too, under
        NCCL_RUNTIME_CONNECT=0: see the module's docstring)."""
        one = torch.zeros((1,), dtype=torch.float32, device=self.transport.device)
        self.all_reduce(one, dist.ReduceOp.SUM, "the group's communicator (every rank)")

    def make_communicators(self) -> None:
        """The group's and its channels' first operations, and the first message of every pair of
        non-neighbours, here at construction, not in a step (see the module's docstring); each
        message is waited for with the timeout and the failure watch."""
        t = self.transport
        ch = t.channels
        if ch is None:
            return
        # the group's own communicator: the loss, the norm, and messages between non-neighbours
        # (predict(dst=), gather_state_dict), whose first operation would leave the other ranks out
        self.make_group()
        if ch.prepared:
            return
        for a, b in ch.directions:
            what = f"channel {self._names[a]} -> {self._names[b]}'s first message (made at construction)"
            self.first_message(a, b, what)
        for a, b in ch.off_channel:  # Channels posts these on the group itself
            what = (
                f"rank {self._names[a]} -> rank {self._names[b]}'s first message on the pipeline's group "
                "(not neighbours: predict(dst=), gather_state_dict; connected at construction)"
            )
            self.first_message(a, b, what)
        ch.prepared = True

    def first_message(self, a: int, b: int, what: str) -> None:
        """One float from group rank ``a`` to ``b``, posted and waited for where this rank is one of
        them (every rank calls it for the same pairs in the same order: see the module's docstring)."""
        t = self.transport
        if self.rank not in (a, b):
            return
        msg = [torch.zeros((1,), dtype=torch.float32, device=t.device)]
        works = t.post([(msg, b)], [], what) if self.rank == a else t.post([], [(msg, a)], what)
        t.wait(works[0], what)

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
