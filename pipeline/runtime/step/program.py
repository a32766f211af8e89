"""Bind one rank's program (``pipeline.schedules.program``) to its stages and messages.

    # s: stage, i: micro-batch, r: this rank, q: a peer rank

The program is data; this module makes it run, once, at the executor's construction:

    program:    0F1 | post 0SEND_F1 0RECV_B0 | wait 0RECV_B0  free 0SEND_F0  0B0 ...
    bound:      [F(0,1)] [block: post]        [B(0,0): take its input, then free the sends]

Each compute instruction takes its input from a mailbox, filled either locally
(the neighbour stage is on this rank: no copy, no comm) or by the receive that
its ``wait`` names, waited for only now (it was posted one block earlier, so the
transfer overlaps the compute in between). The ``free`` after a wait becomes that
receive's ``reap``: the sends it proves delivered are ordered and dropped as the
input is taken. Every message of the step is a ``Msg`` made here, bound into the
instructions that fill, post and consume it, with its peer and its description
for errors: the step itself does no lookups and formats no strings. Sends that no
receive proves delivered are ordered at the step's end (the program's last free).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pipeline.runtime.inputs.microbatch import Batch, Signature
from pipeline.runtime.step.stage import StageRuntime
from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.program import Free, Post, Wait
from pipeline.schedules.schedule import Schedule

__all__ = ["Compiled", "Host", "Instruction", "Msg", "compile_rank"]


class Msg:
    """One message of the step (or a local hand-over, with ``action`` None), made at compile time.

    ``value``: what the producing compute left (a batch or grads); ``tensors``: what
    was posted (sent tensors or receive buffers); ``works``: their works until
    waited for; ``spec``: the (shape, dtype) expected or allocated, set at setup;
    ``mask``: for gradients, which tensors of the batch take one; ``reap``: sends
    known to be done once this receive is; ``held``: the memory meter's tokens for ``tensors``, in a
    step that measures memory (memory.py).
    """

    __slots__ = (
        "action", "held", "like_tuple", "mask", "peer", "reap", "spec", "tensors", "value", "what", "works",
    )  # fmt: skip

    def __init__(self, action: Action | None, peer: int, peer_name: int | None = None) -> None:
        self.action, self.peer = action, peer
        self.what = ""
        if action is not None:  # errors name the peer by ``peer_name`` (its global rank in a mesh)
            name = peer if peer_name is None else peer_name
            self.what = f"{action} {'to' if action.kind.is_send else 'from'} rank {name}"
        self.value: Any = None
        self.tensors: list[torch.Tensor] = []
        self.works: list[Any] | None = None
        self.spec: Signature = ()
        self.mask: list[bool] = []
        self.like_tuple = False
        self.reap: list[Msg] = []
        self.held: list[Any] | None = None


class Host(Protocol):
    """What the bound instructions call back into at run time (the executor)."""

    inputs: list[Batch]
    targets: list[Any]

    def take(self, m: Msg) -> Any: ...

    def post(self, sends: list[Msg], recvs: list[Msg], what: str) -> None: ...

    def release(self, sends: list[Msg]) -> None: ...


# (action, callable) per instruction; a post's or a free's action is None
Instruction = tuple[Action | None, Callable[[], None]]


@dataclass
class Compiled:
    """A rank's program and the messages bound into it."""

    program: list[Instruction]
    msgs: dict[Action, Msg] = field(default_factory=dict)  # by comm action on this rank
    local: dict[tuple[int, int], Msg] = field(default_factory=dict)  # (receiving stage, i) -> hand-over
    waits: set[Action] = field(default_factory=set)  # the computes whose input is a receive (``take``)


def compile_rank(
    sched: Schedule,
    rank: int,
    stages: dict[int, StageRuntime],
    host: Host,
    name: Callable[[int], int] | None = None,
) -> Compiled:
    """Bind rank ``rank``'s ``sched.program(rank)`` to ``stages``, calling back into ``host``;
    ``name(q)``: how errors name rank q (default: q)."""
    return _Compiler(sched, rank, stages, host, name).compile()


def _same(q: int) -> int:
    return q


class _Compiler:
    def __init__(
        self,
        sched: Schedule,
        rank: int,
        stages: dict[int, StageRuntime],
        host: Host,
        name: Callable[[int], int] | None,
    ) -> None:
        self.sched, self.rank, self.stages, self.host = sched, rank, stages, host
        self.name: Callable[[int], int] = name if name is not None else _same
        self.n_stages = sched.n_stages
        self.msgs: dict[Action, Msg] = {}
        self.local: dict[tuple[int, int], Msg] = {}
        self.waits: set[Action] = set()

    def _msg(self, a: Action) -> Msg:
        if a not in self.msgs:
            q = self.sched.rank_of(a.peer_stage)
            self.msgs[a] = Msg(a, q, self.name(q))
        return self.msgs[a]

    def _box(self, s: int, i: int) -> Msg:
        if (s, i) not in self.local:
            self.local[(s, i)] = Msg(None, self.rank)
        return self.local[(s, i)]

    def compile(self) -> Compiled:
        out: list[Instruction] = []
        waited: Msg | None = None
        for x in self.sched.program(self.rank):
            if isinstance(x, Post):
                sends, recvs = [self._msg(a) for a in x.sends], [self._msg(a) for a in x.recvs]
                out.append((None, self._bind_block(sends, recvs)))
            elif isinstance(x, Wait):
                waited = self._msg(x.recv)  # taken by the compute that follows
            elif isinstance(x, Free):
                sends = [self._msg(a) for a in x.sends]
                if waited is not None:  # proven by the receive just waited for: freed as it is taken
                    waited.reap += sends
                else:
                    out.append((None, self._bind_free(sends)))
            elif isinstance(x, Action):
                out.append((x, self._bind(x)))
                waited = None
        return Compiled(out, self.msgs, self.local, self.waits)

    def _bind(self, a: Action) -> Callable[[], None]:
        s, i, stage, host = a.stage, a.microbatch, self.stages[a.stage], self.host
        first, last = s == 0, s == self.n_stages - 1
        next_local = not last and self.sched.rank_of(s + 1) == self.rank
        prev_local = not first and self.sched.rank_of(s - 1) == self.rank
        if a.kind is Kind.F:
            src = None if first else self._box(s, i) if prev_local else self._msg(Action(s, Kind.RECV_F, i))
            if src is not None and src.action is not None:
                self.waits.add(a)
            dst = (
                None if last else self._box(s + 1, i) if next_local else self._msg(Action(s, Kind.SEND_F, i))
            )

            def forward() -> None:
                x = host.inputs[i] if src is None else host.take(src)
                out = stage.forward(i, x, host.targets[i] if last else None)
                if dst is not None:
                    dst.value = out

            return forward
        if a.kind is Kind.B:
            gsrc = None if last else self._box(s, i) if next_local else self._msg(Action(s, Kind.RECV_B, i))
            if gsrc is not None and gsrc.action is not None:
                self.waits.add(a)
            gdst = (
                None if first else self._box(s - 1, i) if prev_local else self._msg(Action(s, Kind.SEND_B, i))
            )

            def backward() -> None:
                g = None if gsrc is None else host.take(gsrc)
                gin = stage.backward(i, g)
                if gdst is not None:
                    gdst.value = gin

            return backward

        def weight() -> None:
            stage.weight(i)

        return weight

    def _bind_free(self, sends: list[Msg]) -> Callable[[], None]:
        host = self.host

        def free() -> None:
            host.release(sends)

        return free

    def _bind_block(self, sends: list[Msg], recvs: list[Msg]) -> Callable[[], None]:
        what, host = (sends or recvs)[0].what, self.host

        def block() -> None:
            host.post(sends, recvs, what)

        return block
