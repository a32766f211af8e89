"""Compile one rank's lowered action list into messages and bound instructions.

    # s: stage, i: micro-batch, r: this rank, q: a peer rank

The rank's lowered list is compiled once, at the executor's construction:

    lowered:   0F1 | 0SEND_F1 0RECV_B0 | 0B0 | 0SEND_B0 ... | ...
    program:   [F(0,1)] [block: post sends + receives, and the next block's
                         receives ahead of need] [B(0,0)] ...

Each compute instruction takes its input from a mailbox, filled either locally
(the neighbour stage is on this rank: no copy, no comm) or by a receive that it
waits for only now (posted one block earlier when lookahead is on, so the
transfer overlaps the compute in between). Every message of the step is a
``Msg`` made here, bound into the instructions that fill, post and consume it,
with its peer and its description for errors: the step itself does no lookups
and formats no strings.

Sends are never waited for inside the step except where they are known to be
done. A send X to rank q is done once q has waited for it; so if q, after the
compute that consumes X, sends some Y back, X is done by the time Y arrives
here. Each send is attached here to the first such receive (read off q's
lowered list), and ordered just after it (it frees the send's tensors; on gloo
the wait returns at once, on NCCL the compute stream waits for an event the
device has passed already):

    rank r:  SEND_F(s,i) ......................... RECV_B(s,i) -> reap SEND_F(s,i)
    rank q:       RECV_F(s+1,i) -> F(s+1,i) ... B(s+1,i) -> SEND_B(s+1,i)

Sends with no such receive (the last ones of the step) are ordered at the
step's end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pipeline.runtime.microbatch import Batch, Signature
from pipeline.runtime.stage import StageRuntime
from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.schedule import Schedule

__all__ = ["Compiled", "Host", "Instruction", "Msg", "compile_rank"]


class Msg:
    """One message of the step (or a local hand-over, with ``action`` None), made at compile time.

    ``value``: what the producing compute left (a batch or grads); ``tensors``: what
    was posted (sent tensors or receive buffers); ``works``: their works until
    waited for; ``spec``: the (shape, dtype) expected or allocated, set at setup;
    ``mask``: for gradients, which tensors of the batch take one; ``reap``: sends
    known to be done once this receive is.
    """

    __slots__ = ("action", "like_tuple", "mask", "peer", "reap", "spec", "tensors", "value", "what", "works")

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


class Host(Protocol):
    """What the bound instructions call back into at run time (the executor)."""

    inputs: list[Batch]
    targets: list[Any]

    def take(self, m: Msg) -> Any: ...

    def post(self, sends: list[Msg], recvs: list[Msg], what: str) -> None: ...


# (action, callable) per instruction; a comm block's action is None
Instruction = tuple[Action | None, Callable[[], None]]


@dataclass
class Compiled:
    """A rank's program and the messages bound into it."""

    program: list[Instruction]
    msgs: dict[Action, Msg] = field(default_factory=dict)  # by comm action on this rank
    local: dict[tuple[int, int], Msg] = field(default_factory=dict)  # (receiving stage, i) -> hand-over
    first_recvs: list[Msg] = field(default_factory=list)  # posted at the step's start (lookahead)


def compile_rank(
    sched: Schedule,
    rank: int,
    stages: dict[int, StageRuntime],
    host: Host,
    lookahead: bool,
    name: Callable[[int], int] | None = None,
) -> Compiled:
    """Compile rank ``rank``'s part of ``sched.lowered()`` over ``stages``, calling back into ``host``;
    ``name(q)``: how errors name rank q (default: q)."""
    return _Compiler(sched, rank, stages, host, name).compile(sched.lowered(), lookahead)


def _same(q: int) -> int:
    return q


def _consumer(a: Action) -> Action:
    """The compute action on the peer that takes what send ``a`` carries."""
    if a.kind is Kind.SEND_F:
        return Action(a.stage + 1, Kind.F, a.microbatch)
    return Action(a.stage - 1, Kind.B, a.microbatch)


def _receiver(a: Action) -> Action:
    """The receive that matches send ``a``, on the peer."""
    if a.kind is Kind.SEND_F:
        return Action(a.stage + 1, Kind.RECV_F, a.microbatch)
    return Action(a.stage - 1, Kind.RECV_B, a.microbatch)


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

    def _msg(self, a: Action) -> Msg:
        if a not in self.msgs:
            q = self.sched.rank_of(a.peer_stage)
            self.msgs[a] = Msg(a, q, self.name(q))
        return self.msgs[a]

    def _box(self, s: int, i: int) -> Msg:
        if (s, i) not in self.local:
            self.local[(s, i)] = Msg(None, self.rank)
        return self.local[(s, i)]

    def compile(self, lowered: tuple[tuple[Action, ...], ...], lookahead: bool) -> Compiled:
        mine = lowered[self.rank]
        blocks: list[list[Action]] = []
        program: list[tuple[Action | None, Any]] = []
        for act in mine:
            if act.kind.is_compute:
                program.append((act, self._bind(act)))
            elif program and program[-1][0] is None:
                program[-1][1].append(act)
            else:
                blocks.append([act])
                program.append((None, blocks[-1]))
        self._attach_reaps(mine, lowered)
        # receives of block k+1 are posted with block k (lookahead), the first block's at step start
        recvs = [[self._msg(a) for a in b if a.kind.is_recv] for b in blocks]
        first_recvs = recvs[0] if recvs and lookahead else []
        out: list[Instruction] = []
        k = 0
        for a, item in program:
            if a is not None:
                out.append((a, item))
                continue
            ahead = recvs[k + 1] if lookahead and k + 1 < len(blocks) else []
            own = [] if lookahead else recvs[k]
            sends = [self._msg(b) for b in blocks[k] if b.kind.is_send]
            if sends or own or ahead:
                out.append((None, self._bind_block(sends, own + ahead)))
            k += 1
        return Compiled(out, self.msgs, self.local, first_recvs)

    def _attach_reaps(self, mine: tuple[Action, ...], lowered: tuple[tuple[Action, ...], ...]) -> None:
        """Attach each send to the first receive here that proves it done (see the module docstring)."""
        for a in mine:
            if not a.kind.is_send:
                continue
            q = self.sched.rank_of(a.peer_stage)
            theirs = lowered[q]
            consumer = _consumer(a)
            if consumer not in theirs:
                continue
            for b in theirs[theirs.index(consumer) + 1 :]:
                if b.kind.is_send and self.sched.rank_of(b.peer_stage) == self.rank:
                    back = _receiver(b)
                    if back in mine:
                        self._msg(back).reap.append(self._msg(a))
                    break

    def _bind(self, a: Action) -> Callable[[], None]:
        s, i, stage, host = a.stage, a.microbatch, self.stages[a.stage], self.host
        first, last = s == 0, s == self.n_stages - 1
        next_local = not last and self.sched.rank_of(s + 1) == self.rank
        prev_local = not first and self.sched.rank_of(s - 1) == self.rank
        if a.kind is Kind.F:
            src = None if first else self._box(s, i) if prev_local else self._msg(Action(s, Kind.RECV_F, i))
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

    def _bind_block(self, sends: list[Msg], recvs: list[Msg]) -> Callable[[], None]:
        what, host = (sends or recvs)[0].what, self.host

        def block() -> None:
            host.post(sends, recvs, what)

        return block
