"""A rank's step as data: the one order that the executor runs and the memory model walks.

    # s: stage, i: micro-batch, r: this rank, q: a peer rank

A ``Program`` is derived once from a schedule's lowered lists (``Schedule.program(r)``). It holds,
in run order, every event of rank r's step that decides what runs and what is held:

    post 0SEND_F1 0RECV_B0   post a comm block: the previous compute's sends, and the receives of
                             the block after it (one block ahead, so a transfer overlaps compute);
                             the first block's receives are posted at the step's start
    wait 0RECV_B0            the next compute's input: ordered after its receive; the buffer is
                             held from its post to the end of that compute
    free 0SEND_F0            sends proven delivered: the tensors they hold go
    0B0                      compute: F, B (the input-gradient part when split), W
    reduce 0                 stage 0's gradients are final: its data-parallel reduction starts

A send X to rank q is delivered once q has received it; so if q, after the compute that consumes
X, sends some Y back, X is delivered by the time Y arrives here. X is freed at the wait for the
first such Y (read off q's lowered list); sends with none are freed at the step's end:

    rank r:  post SEND_F(s,i) ................. wait RECV_B(s,i)  free SEND_F(s,i)
    rank q:       wait RECV_F(s+1,i)  F(s+1,i) ... B(s+1,i)  post SEND_B(s+1,i)

The text form is one instruction per line (``print(schedule.program(r))``). Plain data: no torch,
no runtime; ``pipeline.runtime.program`` binds it to stages and channels, and
``partitioner.memory`` walks it for the predicted peak, so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from pipeline.schedules.actions import Action, Kind

__all__ = ["Free", "Instruction", "Post", "Program", "Reduce", "Wait", "derive"]


@dataclass(frozen=True, slots=True)
class Post:
    """Post one comm block: ``sends`` and ``recvs`` (the receives one block ahead)."""

    sends: tuple[Action, ...]
    recvs: tuple[Action, ...]

    def __str__(self) -> str:
        return "post " + " ".join(str(a) for a in (*self.sends, *self.recvs))


@dataclass(frozen=True, slots=True)
class Wait:
    """The next compute's input: order it after receive ``recv``."""

    recv: Action

    def __str__(self) -> str:
        return f"wait {self.recv}"


@dataclass(frozen=True, slots=True)
class Free:
    """``sends`` are delivered: what they hold is released."""

    sends: tuple[Action, ...]

    def __str__(self) -> str:
        return "free " + " ".join(str(a) for a in self.sends)


@dataclass(frozen=True, slots=True)
class Reduce:
    """Stage ``stage``'s gradients are final: its reduction across replicas starts here (dp > 1)."""

    stage: int

    def __str__(self) -> str:
        return f"reduce {self.stage}"


class Lowered(Protocol):
    """What a program is derived from (a ``Schedule``; named here, not imported: it imports this)."""

    @property
    def n_ranks(self) -> int: ...

    @property
    def split_backward(self) -> bool: ...

    def rank_of(self, stage: int) -> int: ...

    def lowered(self) -> tuple[tuple[Action, ...], ...]: ...


# a compute instruction is its Action (F, B or W)
Instruction = Action | Post | Wait | Free | Reduce


@dataclass(frozen=True)
class Program:
    """Rank ``rank``'s step, one instruction after another."""

    rank: int
    instructions: tuple[Instruction, ...]

    def __iter__(self) -> Iterator[Instruction]:
        return iter(self.instructions)

    def __len__(self) -> int:
        return len(self.instructions)

    def compute(self) -> list[Action]:
        """The compute actions, in order (the schedule's row for this rank)."""
        return [x for x in self.instructions if isinstance(x, Action)]

    def to_text(self) -> str:
        return "\n".join(str(x) for x in self.instructions)

    def __str__(self) -> str:
        return self.to_text()


def derive(sched: Lowered) -> tuple[Program, ...]:
    """Every rank's program of ``sched`` (see the module docstring for the rules)."""
    lowered = sched.lowered()
    frees = _frees(sched, lowered)
    return tuple(_rank_program(sched, r, lowered[r], frees[r]) for r in range(sched.n_ranks))


def _rank_program(
    sched: Lowered, r: int, mine: Sequence[Action], frees: dict[Action, list[Action]]
) -> Program:
    # the lowered list as computes and comm blocks (the sends of one compute, the receives of the next)
    items: list[Action | list[Action]] = []
    for a in mine:
        if a.kind.is_compute:
            items.append(a)
        elif items and isinstance(items[-1], list):
            items[-1].append(a)
        else:
            items.append([a])
    blocks = [b for b in items if isinstance(b, list)]
    recvs = [tuple(a for a in b if a.kind.is_recv) for b in blocks]
    final = _final_gradients(sched, mine)
    out: list[Instruction] = []
    if recvs and recvs[0]:
        out.append(Post((), recvs[0]))  # the first block's receives, at the step's start
    posted: set[Action] = set()
    received = set(mine)
    k = 0
    for item in items:
        if isinstance(item, list):
            sends = tuple(a for a in item if a.kind.is_send)
            ahead = recvs[k + 1] if k + 1 < len(blocks) else ()
            if sends or ahead:
                out.append(Post(sends, ahead))
            posted.update(sends)
            k += 1
            continue
        a = item
        got = Action(a.stage, Kind.RECV_F if a.kind is Kind.F else Kind.RECV_B, a.microbatch)
        if a.kind is not Kind.W and got in received:
            out.append(Wait(got))
            done = tuple(x for x in frees.get(got, ()) if x in posted)
            if done:
                out.append(Free(done))
                posted.difference_update(done)
        out.append(a)
        if final.get(a.stage) == a:
            out.append(Reduce(a.stage))
    left = tuple(a for a in mine if a in posted)
    if left:
        out.append(Free(left))  # no receive proves them delivered: the step's end does
    return Program(r, tuple(out))


def _final_gradients(sched: Lowered, mine: Sequence[Action]) -> dict[int, Action]:
    """Per stage of this rank, the compute after which its gradients are final: its last W on a
    split-backward schedule, else its last B (none for a forward-only schedule)."""
    kind = Kind.W if sched.split_backward else Kind.B
    last: dict[int, Action] = {}
    for a in mine:
        if a.kind is kind:
            last[a.stage] = a
    return last


def _frees(sched: Lowered, lowered: Sequence[Sequence[Action]]) -> list[dict[Action, list[Action]]]:
    """Per rank r, per receive there: the sends of r it proves delivered (the module docstring's rule).

    For each rank q, ``ahead[q][t][k]`` is the position of q's first send to rank t at or after
    position k, so that each send's proof is found in constant time (planning walks many schedules
    of thousands of actions)."""
    p = sched.n_ranks
    position = [{a: k for k, a in enumerate(acts)} for acts in lowered]
    ahead: list[dict[int, list[int]]] = []
    for acts in lowered:
        targets = {sched.rank_of(a.peer_stage) for a in acts if a.kind.is_send}
        table: dict[int, list[int]] = {}
        for t in targets:
            nxt, col = len(acts), [0] * (len(acts) + 1)
            col[len(acts)] = nxt
            for k in range(len(acts) - 1, -1, -1):
                a = acts[k]
                if a.kind.is_send and sched.rank_of(a.peer_stage) == t:
                    nxt = k
                col[k] = nxt
            table[t] = col
        ahead.append(table)
    out: list[dict[Action, list[Action]]] = [{} for _ in range(p)]
    for r, acts in enumerate(lowered):
        for a in acts:
            if not a.kind.is_send:
                continue
            q = sched.rank_of(a.peer_stage)
            at = position[q].get(_consumer(a))
            if at is None or r not in ahead[q]:
                continue
            j = ahead[q][r][at + 1]
            if j == len(lowered[q]):
                continue
            back = _receiver(lowered[q][j])
            if back in position[r]:
                out[r].setdefault(back, []).append(a)
    return out


def _consumer(send: Action) -> Action:
    """The compute action on the peer that takes what ``send`` carries."""
    if send.kind is Kind.SEND_F:
        return Action(send.stage + 1, Kind.F, send.microbatch)
    return Action(send.stage - 1, Kind.B, send.microbatch)


def _receiver(send: Action) -> Action:
    """The receive on the peer that matches ``send``."""
    if send.kind is Kind.SEND_F:
        return Action(send.stage + 1, Kind.RECV_F, send.microbatch)
    return Action(send.stage - 1, Kind.RECV_B, send.microbatch)
