"""A rank's step as data: the one order that the executor runs and the memory model walks.

    # s: stage, i: micro-batch, r: this rank, q: a peer rank

A ``Program`` is derived once from a schedule's lowered lists, the number of replicas ``dp`` and
the tied weights' stages (``Schedule.program(r, dp=..., ties=...)``, ``Plan.program(r)``). It
holds, in run order, every event of rank r's step that decides what runs and what is held:

    post 0SEND_F1 0RECV_B0   post a comm block: the previous compute's sends, and the receives of
                             the block after it (one block ahead, so a transfer overlaps compute);
                             the first block's receives are posted at the step's start
    wait 0RECV_B0            the next compute's input: ordered after its receive; the buffer is
                             held from its post to the end of that compute
    free 0SEND_F0            sends proven delivered: the tensors they hold go
    0B0                      compute: F, B (the input-gradient part when split), W
    reduce 0                 stage 0's gradients are final: its reduction over the replicas
                             starts (dp > 1), overlapping the computes after it

and, once the computes are done, the step's tail: the collectives, in the order every rank
of each group runs them (NCCL matches collectives on a communicator by their order)::

    wait reduce 0            stage 0's reduction over the replicas is done (dp > 1; in the order
                             the reductions started)
    all_reduce ties 0,3      this step's gradients of the weights tied across ranks 0 and 3
    broadcast loss 1 0,1     the loss, from the last stage's rank 1 to ranks 0 and 1
    all_reduce loss replicas the loss over the replicas: the global batch's mean (dp > 1)

``play`` runs every rank's program against the others: the one statement of how they wait on
each other. The validator plays them at no cost (a rank that cannot go on is a deadlock), the
simulator with costs (reductions overlapping the computes after them); the executor runs them
and the memory model walks them.

A send X to rank q is delivered once q has received it; so if q, after the compute that consumes
X, sends some Y back, X is delivered by the time Y arrives here. X is freed at the wait for the
first such Y (read off q's lowered list); sends with none are freed at the step's end:

    rank r:  post SEND_F(s,i) ................. wait RECV_B(s,i)  free SEND_F(s,i)
    rank q:       wait RECV_F(s+1,i)  F(s+1,i) ... B(s+1,i)  post SEND_B(s+1,i)

The text form is one instruction per line (``print(schedule.program(r))``). Plain data: no torch,
no runtime; ``pipeline.runtime.program`` binds it to stages and channels, ``Pipeline.step`` runs
its tail, ``validate`` and ``simulate`` read it and ``partitioner.memory`` walks it for the
predicted peak, so none of them can disagree. (``clip_grad_norm_`` and ``grads_finite`` are
calls of their own after the step, one all-reduce each over every rank, not part of it.)
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.schedules.actions import Action, Kind

__all__ = [
    "Collective",
    "Free",
    "Instruction",
    "Played",
    "Post",
    "Program",
    "Reduce",
    "ReduceWait",
    "Wait",
    "derive",
    "options",
    "play",
    "sender",
    "tie_groups",
]


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


@dataclass(frozen=True, slots=True)
class ReduceWait:
    """Stage ``stage``'s reduction across replicas is done: its gradients are the replicas' mean."""

    stage: int

    def __str__(self) -> str:
        return f"wait reduce {self.stage}"


@dataclass(frozen=True, slots=True)
class Collective:
    """A collective over pipeline ranks ``ranks`` (empty: this rank's replicas), which each member
    runs at the same place of its sequence of collectives on that group.

    ``op`` is "all_reduce" or "broadcast" (from ``root``); ``what`` names the data ("ties",
    "loss")."""

    op: str
    what: str
    ranks: tuple[int, ...]
    root: int = -1

    @property
    def group(self) -> str:
        """The group's name: its ranks, or "replicas"."""
        return ",".join(map(str, self.ranks)) if self.ranks else "replicas"

    def __str__(self) -> str:
        root = f" {self.root}" if self.op == "broadcast" else ""
        return f"{self.op} {self.what}{root} {self.group}"


class Lowered(Protocol):
    """What a program is derived from (a ``Schedule``; named here, not imported: it imports this)."""

    @property
    def n_ranks(self) -> int: ...

    @property
    def n_stages(self) -> int: ...

    @property
    def split_backward(self) -> bool: ...

    def rank_of(self, stage: int) -> int: ...

    def lowered(self) -> tuple[tuple[Action, ...], ...]: ...


# a compute instruction is its Action (F, B or W)
Instruction = Action | Post | Wait | Free | Reduce | ReduceWait | Collective


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

    def tail(self) -> tuple[Instruction, ...]:
        """The step's tail: the reductions' waits and the collectives, after the last compute's
        sends are freed (what ``Pipeline.step`` runs once the executor is done)."""
        at = len(self.instructions)
        while at and isinstance(self.instructions[at - 1], ReduceWait | Collective):
            at -= 1
        return self.instructions[at:]

    def to_text(self) -> str:
        return "\n".join(str(x) for x in self.instructions)

    def __str__(self) -> str:
        return self.to_text()


def derive(sched: Lowered, *, dp: int = 1, ties: Sequence[Sequence[int]] = ()) -> tuple[Program, ...]:
    """Every rank's program of ``sched`` (see the module docstring for the rules), for ``dp``
    replicas of the pipeline and the weights tied across ``ties`` (one sequence of stages per tied
    parameter, in the order every rank finds them)."""
    replicated, stage_sets = options(sched, dp, ties)
    groups = tie_groups(sched.rank_of, stage_sets)
    with _gc_paused():
        lowered = sched.lowered()
        frees = _frees(sched, lowered)
        return tuple(
            _rank_program(sched, r, lowered[r], frees[r], replicated, groups) for r in range(sched.n_ranks)
        )


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cycle collector off while a schedule's lists and programs are built.

    They are tens of thousands of small objects that form no cycle, and each burst of allocations
    sets off a collection that walks every object the caller holds (a 1000-layer model and its
    graph cost 70 of the 250 ms of a cold refusal at p = 64, m = 64). Nothing is left uncollected:
    the collector runs again, as it was, on the way out."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def options(
    sched: Lowered, dp: int, ties: Sequence[Sequence[int]]
) -> tuple[bool, tuple[tuple[int, ...], ...]]:
    """``dp`` and ``ties`` checked: (whether the pipeline is replicated, the ties as stage tuples);
    all that a program depends on besides the schedule."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp ({dp!r}) must be an integer >= 1: the number of pipeline replicas")
    k = sched.n_stages
    out: list[tuple[int, ...]] = []
    for stages in ties if isinstance(ties, Sequence) and not isinstance(ties, str | bytes) else [ties]:
        if (
            not isinstance(stages, Sequence)
            or isinstance(stages, str | bytes)
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < k for s in stages)
        ):
            raise ValueError(
                f"tie {stages!r} must be a sequence of stage indices in [0, {k}): the stages that hold "
                "one tied parameter (ties: one such sequence per tied parameter)"
            )
        out.append(tuple(stages))
    return dp > 1, tuple(out)


def tie_groups(rank_of: Callable[[int], int], ties: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The sets of ranks that tied weights span (``rank_of``: a stage's rank), each once, in the
    order of ``ties`` (stage tuples); a tie within one rank needs no collective (autograd sums
    both uses). The program's tie collectives and the runtime's tie groups are these."""
    groups: list[tuple[int, ...]] = []
    for stages in ties:
        ranks = tuple(sorted({rank_of(s) for s in stages}))
        if len(ranks) > 1 and ranks not in groups:
            groups.append(ranks)
    return groups


def _rank_program(
    sched: Lowered,
    r: int,
    mine: Sequence[Action],
    frees: dict[Action, list[Action]],
    replicated: bool,
    ties: Sequence[tuple[int, ...]],
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
        got = None if a.kind is Kind.W else Action(a.stage, _RECEIVED_BY[a.kind], a.microbatch)
        if got is not None and got in received:
            out.append(Wait(got))
            done = tuple(x for x in frees.get(got, ()) if x in posted)
            if done:
                out.append(Free(done))
                posted.difference_update(done)
        out.append(a)
        if replicated and final.get(a.stage) == a:
            out.append(Reduce(a.stage))
    left = tuple(a for a in mine if a in posted)
    if left:
        out.append(Free(left))  # no receive proves them delivered: the step's end does
    if replicated:  # in the order the reductions started
        out += [ReduceWait(x.stage) for x in out if isinstance(x, Reduce)]
    out += [Collective("all_reduce", "ties", ranks) for ranks in ties if r in ranks]
    if sched.n_ranks > 1:
        last = sched.rank_of(sched.n_stages - 1)
        out.append(Collective("broadcast", "loss", tuple(range(sched.n_ranks)), root=last))
    if replicated:
        out.append(Collective("all_reduce", "loss", ()))
    return Program(r, tuple(out))


_RECEIVED_BY = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B}  # the receive a compute's input comes by


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
    rank_of = [sched.rank_of(s) for s in range(sched.n_stages)]
    # actions keyed by plain tuples: tens of thousands of lookups, and a tuple is cheaper to build
    position = [{(a.stage, a.kind, a.microbatch): k for k, a in enumerate(acts)} for acts in lowered]
    ahead: list[dict[int, list[int]]] = []
    for acts in lowered:
        dest = [  # each send's destination rank, -1 for any other action
            -1 if not a.kind.is_send else rank_of[a.stage + 1 if a.kind is Kind.SEND_F else a.stage - 1]
            for a in acts
        ]
        table: dict[int, list[int]] = {}
        for t in set(dest) - {-1}:
            nxt, col = len(acts), [0] * (len(acts) + 1)
            col[len(acts)] = nxt
            for k in range(len(acts) - 1, -1, -1):
                if dest[k] == t:
                    nxt = k
                col[k] = nxt
            table[t] = col
        ahead.append(table)
    out: list[dict[Action, list[Action]]] = [{} for _ in range(p)]
    for r, acts in enumerate(lowered):
        for a in acts:
            if not a.kind.is_send:
                continue
            q = rank_of[a.stage + 1 if a.kind is Kind.SEND_F else a.stage - 1]
            at = position[q].get(_consumer(a))
            if at is None or r not in ahead[q]:
                continue
            j = ahead[q][r][at + 1]
            if j == len(lowered[q]):
                continue
            # q's next send to r: its receive on r proves ``a`` delivered
            back = position[r].get(_receiver(lowered[q][j]))
            if back is not None:
                out[r].setdefault(acts[back], []).append(a)
    return out


def _consumer(send: Action) -> tuple[int, Kind, int]:
    """The compute action on the peer that takes what ``send`` carries, as (stage, kind, micro-batch)."""
    if send.kind is Kind.SEND_F:
        return (send.stage + 1, Kind.F, send.microbatch)
    return (send.stage - 1, Kind.B, send.microbatch)


def sender(recv: Action) -> Action:
    """The send on the peer that ``recv`` matches (the inverse of ``_receiver``)."""
    if recv.kind is Kind.RECV_F:
        return Action(recv.stage - 1, Kind.SEND_F, recv.microbatch)
    return Action(recv.stage + 1, Kind.SEND_B, recv.microbatch)


def _receiver(send: Action) -> tuple[int, Kind, int]:
    """The receive on the peer that matches ``send``, as (stage, kind, micro-batch)."""
    if send.kind is Kind.SEND_F:
        return (send.stage + 1, Kind.RECV_F, send.microbatch)
    return (send.stage - 1, Kind.RECV_B, send.microbatch)


@dataclass
class Played:
    """What ``play`` found. Per rank: where it stopped (its program's length when it finished) and
    its clock then; each compute's (rank, action, start, end); each reduction's (rank, stage, start,
    end)."""

    stopped: list[int]
    ends: list[float]
    computes: list[tuple[int, Action, float, float]] = field(default_factory=list)
    reductions: list[tuple[int, int, float, float]] = field(default_factory=list)

    def stuck(self, programs: Sequence[Program]) -> list[tuple[int, int]]:
        """(rank, position) of each rank that could not finish."""
        return [(r, t) for r, t in enumerate(self.stopped) if t < len(programs[r])]


def _free(_: object) -> float:
    return 0.0


def play(
    programs: Sequence[Program],
    compute: Callable[[Action], float] = _free,
    *,
    comm: float = 0.0,
    reduce: Callable[[int], float] = _free,
    collective: float = 0.0,
) -> Played:
    """Run every rank's program against the others, the one interpreter of how they wait on each
    other (the validator plays them at no cost, the simulator with costs, in seconds):

        compute      takes ``compute(action)``
        post         its sends are out at once (they never block)
        wait         until the peer posted the message, plus ``comm``
        reduce s     starts stage s's reduction, ``reduce(s)`` long, after this rank's previous one
                     (one reducer per rank), beside the computes that follow
        wait reduce  until that reduction ends
        collective   until every rank of its group reached it, plus ``collective`` (a collective
                     over the replicas: each replica runs the same program, so only the cost)

    A rank that cannot go on stops where it waits; ``Played.stuck`` lists them."""
    p = len(programs)
    now, pos, lane = [0.0] * p, [0] * p, [0.0] * p  # per rank: its clock, next instruction, reducer
    posted: dict[Action, float] = {}  # send -> when its rank posted it
    reduced: dict[tuple[int, int], float] = {}  # (rank, stage) -> when its reduction ends
    arrived: dict[tuple[tuple[int, ...], int], dict[int, float]] = {}  # (group, n) -> rank -> time
    done: list[dict[tuple[int, ...], int]] = [{} for _ in range(p)]  # collectives passed, per group
    out = Played(pos, now)
    progressed = True
    while progressed:
        progressed = False
        for r, program in enumerate(programs):
            while pos[r] < len(program):
                x = program.instructions[pos[r]]
                if isinstance(x, Action):
                    start = now[r]
                    now[r] += compute(x)
                    out.computes.append((r, x, start, now[r]))
                elif isinstance(x, Post):
                    posted.update((a, now[r]) for a in x.sends)
                elif isinstance(x, Wait):
                    send = sender(x.recv)
                    if send not in posted:
                        break
                    now[r] = max(now[r], posted[send] + comm)
                elif isinstance(x, Reduce):
                    start = max(now[r], lane[r])
                    lane[r] = reduced[(r, x.stage)] = start + reduce(x.stage)
                    out.reductions.append((r, x.stage, start, lane[r]))
                elif isinstance(x, ReduceWait):
                    now[r] = max(now[r], reduced[(r, x.stage)])
                elif isinstance(x, Collective) and not x.ranks:
                    now[r] += collective
                elif isinstance(x, Collective):
                    k = done[r].get(x.ranks, 0)
                    at = arrived.setdefault((x.ranks, k), {})
                    at.setdefault(r, now[r])
                    if len(at) < len(x.ranks):
                        break
                    now[r] = max(at.values()) + collective
                    done[r][x.ranks] = k + 1
                pos[r] += 1
                progressed = True
    return out
