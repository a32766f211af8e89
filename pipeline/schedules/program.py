"""A rank's step as data: the one order that the executor runs and the memory model walks.

    # s: stage, i: micro-batch, r: this rank, q: a peer rank

A ``Program`` is derived once from a schedule's lowered lists, the number of replicas ``dp`` and
the tied weights' stages (``Schedule.program(r, dp=..., ties=...)``, ``Plan.program(r)``). It
holds, in run order, every event of rank r's step that decides what runs and what is held:

    post 0SEND_F1 0RECV_B0   post a comm block: the previous compute's sends, and the receives of
                             the block after it (one block ahead, so a transfer overlaps compute;
                             a receive that may not go ahead, below, is posted with its own block);
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

A receive posted ahead must never wait on this rank's own future. On a GPU a posted receive is a
kernel queued at once, and a device-wide synchronisation (the caching allocator's retry after a
failed cudaMalloc, a lazily loaded kernel's first launch) holds the host inside the compute it is
queuing until every queued kernel is done. A receive R posted ahead of the compute Z that ends the
window before R's own block would then wait for ever if R's sender needs what Z sends:

    rank 0:  0F2  post 0SEND_F2 0RECV_B0  [0F3: the host is held in a device-wide sync]
    rank 1:  1F2  ...  wait 1RECV_F3 (0SEND_F3 comes after 0F3: never)  1F3  1B0  post 1SEND_B0
             so 0RECV_B0, queued on rank 0's device, never completes, and the sync never returns

So R goes ahead only when Z is not an ancestor of R's producer (the compute whose output it is),
over the computes' dependencies: each rank's order, and each remote input (``_late_receives``);
else it is posted with its own block, right before the compute that takes it. ``validate`` proves
the rule on the programs themselves, freezing each rank at each compute (its drain check).

The text form is one instruction per line (``print(schedule.program(r))``). Plain data: no torch,
no runtime; ``pipeline.runtime.step.program`` binds it to stages and channels, ``Pipeline.step`` runs
its tail, ``validate`` and ``simulate`` read it and ``partitioner.memory`` walks it for the
predicted peak, so none of them can disagree. (``clip_grad_norm_`` and ``grads_finite`` are
calls of their own after the step, one all-reduce each over every rank, not part of it.)
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.schedules.actions import Action, Kind

__all__ = [
    "Collective",
    "Free",
    "Game",
    "Hazard",
    "Instruction",
    "Mark",
    "Played",
    "Post",
    "Program",
    "Reduce",
    "ReduceWait",
    "Wait",
    "derive",
    "drain_hazards",
    "gc_paused",
    "options",
    "play",
    "sender",
    "tie_groups",
]


# Post, Wait and Free write their slots through the slots' own setters, not the frozen class's
# setattr as a dataclass's __init__ does: 0.27 against 0.44 us each, and planning makes tens of
# thousands (20,000 at p = 64, m = 64)


@dataclass(frozen=True, slots=True, init=False)
class Post:
    """Post one comm block: ``sends`` and ``recvs`` (the receives one block ahead)."""

    sends: tuple[Action, ...]
    recvs: tuple[Action, ...]

    def __init__(self, sends: tuple[Action, ...], recvs: tuple[Action, ...]) -> None:
        _POST_SENDS(self, sends)
        _POST_RECVS(self, recvs)

    def __str__(self) -> str:
        return "post " + " ".join(str(a) for a in (*self.sends, *self.recvs))


@dataclass(frozen=True, slots=True, init=False)
class Wait:
    """The next compute's input: order it after receive ``recv``."""

    recv: Action

    def __init__(self, recv: Action) -> None:
        _WAIT_RECV(self, recv)

    def __str__(self) -> str:
        return f"wait {self.recv}"


@dataclass(frozen=True, slots=True, init=False)
class Free:
    """``sends`` are delivered: what they hold is released."""

    sends: tuple[Action, ...]

    def __init__(self, sends: tuple[Action, ...]) -> None:
        _FREE_SENDS(self, sends)

    def __str__(self) -> str:
        return "free " + " ".join(str(a) for a in self.sends)


_POST_SENDS: Callable[[Post, tuple[Action, ...]], None] = Post.__dict__["sends"].__set__
_POST_RECVS: Callable[[Post, tuple[Action, ...]], None] = Post.__dict__["recvs"].__set__
_WAIT_RECV: Callable[[Wait, Action], None] = Wait.__dict__["recv"].__set__
_FREE_SENDS: Callable[[Free, tuple[Action, ...]], None] = Free.__dict__["sends"].__set__


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
    with gc_paused():
        lowered = sched.lowered()
        frees = _frees(sched, lowered)
        late = _late_receives(sched, lowered)
        return tuple(
            _rank_program(sched, r, lowered[r], frees[r], late, replicated, groups)
            for r in range(sched.n_ranks)
        )


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cycle collector off while a schedule's lists and programs are built (and walked:
    ``peaks.coefficients``).

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
    frees: dict[tuple[int, Kind, int], list[Action]],
    late: set[Action],
    replicated: bool,
    ties: Sequence[tuple[int, ...]],
) -> Program:
    # each block's receives; each receive by (stage, kind, micro-batch): a compute finds its own
    # with no Action built
    items, recvs, received = _items(mine)
    final = _final_gradients(sched, mine) if replicated else {}
    out: list[Instruction] = []
    append = out.append  # one lookup: tens of thousands of instructions per schedule
    first = tuple(a for a in recvs[0] if a not in late) if recvs else ()
    if first:
        append(Post((), first))  # the first block's receives, at the step's start
    # the sends posted and not yet freed, in posting order (the lowered order), by identity: a
    # proof lists the very actions of ``mine`` (``_frees``), and ints hash without a Python call
    posted: dict[int, Action] = {}
    k, n_blocks = 0, len(recvs)
    for item in items:
        if isinstance(item, tuple):
            sends = item[0]
            # a block with no late receive (a disjoint set: one C call) is taken whole
            now = () if not late or late.isdisjoint(recvs[k]) else tuple(a for a in recvs[k] if a in late)
            ahead = () if k + 1 >= n_blocks else recvs[k + 1]
            if late and ahead and not late.isdisjoint(ahead):  # not posted ahead: posted with its own
                ahead = tuple(a for a in ahead if a not in late)
            if sends or now or ahead:
                append(Post(sends, now + ahead))  # in posting order: each channel's is the lowered one
            for x in sends:
                posted[id(x)] = x
            k += 1
            continue
        a = item
        key = (a.stage, _RECEIVED_BY[a.kind], a.microbatch)
        got = received.get(key)
        if got is not None:
            append(Wait(got))
            proven = frees.get(key)
            if proven:
                done = tuple([x for x in proven if id(x) in posted])
                if done:
                    append(Free(done))
                    for x in done:
                        del posted[id(x)]
        append(a)
        if replicated and final.get(a.stage) == a:
            append(Reduce(a.stage))
    left = tuple(posted.values())
    if left:
        append(Free(left))  # no receive proves them delivered: the step's end does
    if replicated:  # in the order the reductions started
        out += [ReduceWait(x.stage) for x in out if isinstance(x, Reduce)]
    out += [Collective("all_reduce", "ties", ranks) for ranks in ties if r in ranks]
    if sched.n_ranks > 1:
        last = sched.rank_of(sched.n_stages - 1)
        append(Collective("broadcast", "loss", tuple(range(sched.n_ranks)), root=last))
    if replicated:
        append(Collective("all_reduce", "loss", ()))
    return Program(r, tuple(out))


# the receive a compute's input comes by (a W's: itself, no receive's kind, so none is found)
_RECEIVED_BY = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B, Kind.W: Kind.W}

_Block = tuple[tuple[Action, ...], tuple[Action, ...]]


def _items(
    mine: Sequence[Action],
) -> tuple[list[Action | _Block], list[tuple[Action, ...]], dict[tuple[int, Kind, int], Action]]:
    """A lowered list as computes and comm blocks (a block: one compute's sends and the next's
    receives, each as a tuple in the lowered order); each block's receives; each receive by its
    (stage, kind, micro-batch). One pass: planning splits tens of thousands of actions."""
    items: list[Action | _Block] = []
    blocks: list[tuple[Action, ...]] = []
    received: dict[tuple[int, Kind, int], Action] = {}
    sends: list[Action] = []
    recvs: list[Action] = []
    for a in mine:
        kind = a.kind
        if kind.is_compute:
            if sends or recvs:
                got = tuple(recvs)
                items.append((tuple(sends), got))
                blocks.append(got)
                sends, recvs = [], []
            items.append(a)
        elif kind.is_send:
            sends.append(a)
        else:
            recvs.append(a)
            received[(a.stage, kind, a.microbatch)] = a
    if sends or recvs:
        got = tuple(recvs)
        items.append((tuple(sends), got))
        blocks.append(got)
    return items, blocks, received


def _late_receives(
    sched: Lowered, lowered: Sequence[Sequence[Action]], *, direct: bool = True
) -> set[Action]:
    """The receives that may not be posted one block ahead (the module docstring's rule): R, in the
    block that follows compute Z on its rank, whose producer X has Z among its ancestors.

    The ancestry is over the computes' dependencies: each rank's order, and each remote input. Z's
    successors are the next compute on its rank, C (R's consumer, which X precedes: no path to X
    goes through it), and Y, the peer compute that takes what Z sends (Z asks only when a send of
    its own follows it). So Z is an ancestor of X exactly when Y is an ancestor of X or X itself,
    by a path that never meets Z's rank (a compute there is before Z or at C and after: either
    closes a cycle). ``direct`` answers from that, with no pass: Y on X's rank is an ancestor when
    it comes first there, and Y on a rank that the rank graph (ranks that exchange messages), less
    Z's rank, leaves apart from X's is none (1F1B's every receive, p = 64: 8,000 in milliseconds).
    The argument holds where X is reached (all its ancestors are, in a topological order), so a
    receive found late so is late only once the pass below reaches its X (a deadlock's is not).

    The rest (and every ask, ``direct=False``, the definition the tests check ``direct`` against)
    take one topological pass over the computes (each rank's in order, each once its remote input's
    producer is done: the order a play at no cost runs them in), which carries each compute's
    ancestry as an int, one bit per Z met so far: a compute's is its rank-predecessor's, or its
    remote producer's, and its own bit. X answers its questions as it is reached; a Z not reached by
    then is no ancestor. A Z's bit is dropped (shifted out) once every question about it is
    answered, so the ints stay about p bits wide: planning derives many programs of thousands of
    computes. A schedule that deadlocks leaves the rest unasked (``validate`` refuses it)."""
    p, k = sched.n_ranks, sched.n_stages
    rank_of = [sched.rank_of(s) for s in range(k)]
    in_remote = [s > 0 and rank_of[s - 1] != rank_of[s] for s in range(k)]  # F(s)'s input comes by message
    gin_remote = [s + 1 < k and rank_of[s + 1] != rank_of[s] for s in range(k)]  # B(s)'s likewise
    Key = tuple[int, Kind, int]
    # per rank, per compute: itself; per ask: (Z's rank, Z, R), Z the compute whose send R follows
    computes: list[list[Key]] = []
    pending: list[tuple[int, Key, Action]] = []
    where: dict[Key, tuple[int, int]] = {}  # direct: each compute's (rank, place in its order)
    for r, acts in enumerate(lowered):
        mine: list[Key] = []
        z: Key | None = None  # the last compute, once a send follows it
        for a in acts:
            kind = a.kind
            if kind.is_send:
                z = mine[-1] if mine else None
            elif kind.is_recv:
                if z is not None:  # posted ahead from Z's block: asked at its producer
                    pending.append((r, z, a))
            else:
                c = (a.stage, kind, a.microbatch)
                if direct:
                    where[c] = (r, len(mine))
                mine.append(c)
                z = None
        computes.append(mine)
    late: set[Action] = set()
    asks: dict[Key, list[tuple[Key, Action]]] = {}  # X -> (Z, R) to answer at X
    questions: dict[Key, int] = {}  # Z -> how many receives ask about it
    near: list[set[int]] = [set() for _ in range(p)]  # the rank graph: neighbouring stages' ranks
    for s in range(k - 1):
        if rank_of[s] != rank_of[s + 1]:
            near[rank_of[s]].add(rank_of[s + 1])
            near[rank_of[s + 1]].add(rank_of[s])
    apart: dict[int, list[int]] = {}  # Z's rank -> each rank's part of the rank graph less Z's rank
    confirm: list[tuple[tuple[int, int], Action]] = []  # late if the pass reaches X (at (rank, t))
    source, forward = _SOURCE, Kind.F
    for r, z, recv in pending:
        step, made_by = source[recv.kind]  # X, R's producer (no call per receive)
        x = (recv.stage + step, made_by, recv.microbatch)
        if direct:
            s, kind, i = z
            wy, wx = where.get((s + 1, kind, i) if kind is forward else (s - 1, kind, i)), where.get(x)
            if wy is not None and wx is not None:
                if wy[0] == wx[0]:  # on one rank: Y is X's ancestor (or X) when it comes first
                    if wy[1] <= wx[1]:
                        confirm.append((wx, recv))
                    continue
                if r not in apart:
                    apart[r] = _parts(near, r)
                if apart[r][wy[0]] != apart[r][wx[0]]:  # no path from Y to X avoids Z's rank
                    continue
        asks.setdefault(x, []).append((z, recv))
        questions[z] = questions.get(z, 0) + 1
    if not asks and not confirm:
        return late
    # per rank, per compute: (itself, its remote input's producer or None, whether it sends out)
    rows: list[list[tuple[Key, Key | None, bool]]] = []
    for mine in computes:
        row: list[tuple[Key, Key | None, bool]] = []
        for c in mine:
            s, kind, i = c
            src = (s - 1, Kind.F, i) if kind is Kind.F and in_remote[s] else (
                (s + 1, Kind.B, i) if kind is Kind.B and gin_remote[s] else None)  # fmt: skip
            out = (kind is Kind.F and s + 1 < k and in_remote[s + 1]) or (
                kind is Kind.B and s > 0 and gin_remote[s - 1])  # fmt: skip
            row.append((c, src, out))
        rows.append(row)
    pos, chain = [0] * p, [0] * p  # per rank: its next compute, the ancestry of its last one done
    made: dict[Key, int] = {}  # a remote input's producer -> its ancestry, until taken
    bit: dict[Key, int] = {}  # Z -> its bit (counted from the first ever), while questions remain
    base = n_bits = 0  # the bit that bit 0 of the ints stands for; bits handed out
    checked = 0  # n_bits when the bits were last shifted out (or found still asked about)
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            row, t, anc = rows[r], pos[r], chain[r]
            while t < len(row):
                me, src, out = row[t]
                if src is not None:
                    got = made.pop(src, None)
                    if got is None:
                        break
                    anc |= got
                if questions.get(me):  # some receive still asks about this Z
                    bit[me] = n_bits
                    anc |= 1 << (n_bits - base)
                    n_bits += 1
                for zk, recv in asks.get(me, ()):
                    questions[zk] -= 1  # answered here: a Z not reached yet is no ancestor
                    b = bit.get(zk)
                    if b is None:
                        continue
                    if anc >> (b - base) & 1:
                        late.add(recv)
                    if not questions[zk]:
                        del bit[zk]
                if out:
                    made[me] = anc
                t += 1
            if t != pos[r]:
                pos[r], chain[r], progressed = t, anc, True
            if n_bits - checked > 256:  # shift out the bits no question needs (256 bits on at most)
                checked = n_bits
                lo = min(bit.values(), default=n_bits)
                shift, base = lo - base, lo
                chain = [c >> shift for c in chain]
                made = {key: c >> shift for key, c in made.items()}
    late.update(recv for (q, t), recv in confirm if t < pos[q])
    return late


def _parts(near: Sequence[set[int]], gone: int) -> list[int]:
    """Per rank, a label of its part of the rank graph (``near[q]``: the ranks q exchanges messages
    with) with rank ``gone`` taken out (its own label: -1)."""
    label = [-1] * len(near)
    for start in range(len(near)):
        if start == gone or label[start] >= 0:
            continue
        label[start], todo = start, [start]
        while todo:
            for q in near[todo.pop()]:
                if q != gone and label[q] < 0:
                    label[q] = start
                    todo.append(q)
    return label


# a receive's producer, the compute on the peer whose output it takes: (its stage's offset to the
# peer's, that compute's kind)
_SOURCE = {Kind.RECV_F: (-1, Kind.F), Kind.RECV_B: (1, Kind.B)}


def _final_gradients(sched: Lowered, mine: Sequence[Action]) -> dict[int, Action]:
    """Per stage of this rank, the compute after which its gradients are final: its last W on a
    split-backward schedule, else its last B (none for a forward-only schedule)."""
    kind = Kind.W if sched.split_backward else Kind.B
    last: dict[int, Action] = {}
    for a in mine:
        if a.kind is kind:
            last[a.stage] = a
    return last


def _frees(
    sched: Lowered, lowered: Sequence[Sequence[Action]]
) -> list[dict[tuple[int, Kind, int], list[Action]]]:
    """Per rank r, per receive there (by its (stage, kind, micro-batch)): the sends of r it proves
    delivered (the module docstring's rule).

    For each rank q, ``sends_to[q][t]`` lists the positions of q's sends to rank t, in order, so that
    each send's proof (q's first send to r after the compute that consumes it) is one bisection
    (planning walks many schedules of thousands of actions)."""
    p = sched.n_ranks
    rank_of = [sched.rank_of(s) for s in range(sched.n_stages)]
    # computes and receives keyed by plain tuples (what is looked up): tens of thousands of lookups,
    # and a tuple is cheaper to build; per rank its sends with their destination ranks and the
    # computes that consume them there, and per destination its sends' positions and the receives
    # that match them (read off ``_PEER``: no call per send)
    position: list[dict[tuple[int, Kind, int], int]] = []
    sends_to: list[dict[int, tuple[list[int], list[tuple[int, Kind, int]]]]] = []
    sends: list[list[tuple[Action, int, tuple[int, Kind, int]]]] = []
    for acts in lowered:
        where: dict[tuple[int, Kind, int], int] = {}
        table: dict[int, tuple[list[int], list[tuple[int, Kind, int]]]] = {}
        mine: list[tuple[Action, int, tuple[int, Kind, int]]] = []
        for k, a in enumerate(acts):
            kind = a.kind
            if kind.is_send:
                step, consumes, matches = _PEER[kind]
                t, i = a.stage + step, a.microbatch
                q = rank_of[t]
                row = table.get(q)
                if row is None:
                    row = table[q] = ([], [])
                row[0].append(k)
                row[1].append((t, matches, i))
                mine.append((a, q, (t, consumes, i)))
            else:
                where[(a.stage, kind, a.microbatch)] = k
        position.append(where)
        sends_to.append(table)
        sends.append(mine)
    out: list[dict[tuple[int, Kind, int], list[Action]]] = [{} for _ in range(p)]
    for r in range(p):
        here, proofs = position[r], out[r]
        for a, q, consumer in sends[r]:
            at = position[q].get(consumer)
            back_to = sends_to[q].get(r)
            if at is None or back_to is None:
                continue
            j = bisect.bisect_right(back_to[0], at)
            if j == len(back_to[0]):
                continue
            # q's next send to r: its receive on r proves ``a`` delivered
            proof = back_to[1][j]
            if proof in here:
                got = proofs.get(proof)
                if got is None:
                    proofs[proof] = [a]
                else:
                    got.append(a)
    return out


# a send's peer: (its stage's offset to the peer's, the compute there that takes what it carries
# (its consumer), the receive there that matches it)
_PEER = {Kind.SEND_F: (1, Kind.F, Kind.RECV_F), Kind.SEND_B: (-1, Kind.B, Kind.RECV_B)}


def sender(recv: Action) -> Action:
    """The send on the peer that ``recv`` matches (the inverse of ``_receiver``)."""
    if recv.kind is Kind.RECV_F:
        return Action(recv.stage - 1, Kind.SEND_F, recv.microbatch)
    return Action(recv.stage + 1, Kind.SEND_B, recv.microbatch)


def _receiver(send: Action) -> tuple[int, Kind, int]:
    """The receive on the peer that matches ``send``, as (stage, kind, micro-batch)."""
    step, _, kind = _PEER[send.kind]
    return (send.stage + step, kind, send.microbatch)


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
    game = Game(programs, compute, comm=comm, reduce=reduce, collective=collective)
    game.run()
    return game.played


@dataclass(frozen=True, slots=True)
class Mark:
    """Where something happened in a game with clocks: on ``rank``, once ``count`` of its instructions
    had run, which needed ``need[q]`` instructions of each rank q (its vector clock then)."""

    need: list[int]
    rank: int
    count: int

    def on(self, r: int) -> int:
        """How many of rank r's instructions must run before it happens."""
        return self.count if r == self.rank else self.need[r]

    def joined(self, need: list[int]) -> list[int]:
        """``need`` that must also wait for this: each rank's count the larger of the two (a new list:
        a Mark keeps the one it holds)."""
        out = list(map(max, need, self.need))
        if out[self.rank] < self.count:
            out[self.rank] = self.count
        return out


class Game:
    """``play``'s state, which can be run in steps: ``run(hold=(r, t))`` runs every rank as far as it
    can go with rank r held before its instruction t; a later ``run`` goes on from there (what a
    held rank has not run has not happened: a frozen host). ``posted`` holds each send posted, with
    its time, and ``ready`` each receive posted. With ``clocks``, ``sent_at`` and ``ready_at`` hold
    where each was posted and what that needed of every rank (``Mark``): a rank waits only for given
    instructions of others (a wait for one post, a collective for its group's arrivals), so an
    instruction runs under a hold on rank r exactly when what it needs of r lies below the hold."""

    def __init__(
        self,
        programs: Sequence[Program],
        compute: Callable[[Action], float] = _free,
        *,
        comm: float = 0.0,
        reduce: Callable[[int], float] = _free,
        collective: float = 0.0,
        clocks: bool = False,
    ) -> None:
        self.programs, self.compute, self.comm = programs, compute, comm
        self.reduce, self.collective = reduce, collective
        p = len(programs)
        self.now, self.pos, self.lane = [0.0] * p, [0] * p, [0.0] * p  # per rank: clock, next, reducer
        self.posted: dict[Action, float] = {}  # send -> when its rank posted it
        self.ready: set[Action] = set()  # receives posted
        self.reduced: dict[tuple[int, int], float] = {}  # (rank, stage) -> when its reduction ends
        self.arrived: dict[tuple[tuple[int, ...], int], dict[int, float]] = {}  # (group, n) -> rank -> time
        self.done: list[dict[tuple[int, ...], int]] = [{} for _ in range(p)]  # collectives passed, per group
        self.played = Played(self.pos, self.now)
        self._waiting: dict[object, list[int]] = {}  # a send, or (group, n): the ranks blocked on it
        self._todo: deque[int] = deque(range(p))  # the ranks that may go on
        # clocks: per rank, how many instructions of each rank its run so far needs (a vector clock);
        # per send and receive posted, and per collective's arrival, the Mark of where that happened
        self.clocks = clocks
        self._need: list[list[int]] = [[0] * p for _ in range(p)]
        self.sent_at: dict[Action, Mark] = {}
        self.ready_at: dict[Action, Mark] = {}
        self._arrivals: dict[tuple[tuple[int, ...], int], list[Mark]] = {}

    def run(self, hold: tuple[int, int] | None = None) -> None:
        programs, now, pos, out = self.programs, self.now, self.pos, self.played
        posted, waiting, todo = self.posted, self._waiting, self._todo
        if hold is not None:
            todo.append(hold[0])
        while todo:  # only the ranks that may go on are visited: a game is played in steps
            r = todo.popleft()
            program = programs[r]
            end = hold[1] if hold is not None and hold[0] == r else len(program)
            while pos[r] < end:
                x = program.instructions[pos[r]]
                if isinstance(x, Action):
                    start = now[r]
                    now[r] += self.compute(x)
                    out.computes.append((r, x, start, now[r]))
                elif isinstance(x, Post):
                    for a in x.sends:
                        posted[a] = now[r]
                        if a in waiting:
                            todo.extend(waiting.pop(a))
                    self.ready.update(x.recvs)
                    if self.clocks:
                        mark = Mark(self._need[r], r, pos[r] + 1)
                        self.sent_at.update((a, mark) for a in x.sends)
                        self.ready_at.update((a, mark) for a in x.recvs)
                elif isinstance(x, Wait):
                    send = sender(x.recv)
                    if send not in posted:
                        waiting.setdefault(send, []).append(r)
                        break
                    now[r] = max(now[r], posted[send] + self.comm)
                    if self.clocks:
                        self._need[r] = self.sent_at[send].joined(self._need[r])
                elif isinstance(x, Reduce):
                    start = max(now[r], self.lane[r])
                    self.lane[r] = self.reduced[(r, x.stage)] = start + self.reduce(x.stage)
                    out.reductions.append((r, x.stage, start, self.lane[r]))
                elif isinstance(x, ReduceWait):
                    now[r] = max(now[r], self.reduced[(r, x.stage)])
                elif isinstance(x, Collective) and not x.ranks:
                    now[r] += self.collective
                elif isinstance(x, Collective):
                    key = (x.ranks, self.done[r].get(x.ranks, 0))
                    at = self.arrived.setdefault(key, {})
                    if r not in at:
                        at[r] = now[r]
                        if self.clocks:  # arriving is reaching it: a held rank reaches only below its hold
                            self._arrivals.setdefault(key, []).append(Mark(self._need[r], r, pos[r] + 1))
                    if len(at) < len(x.ranks):
                        waiting.setdefault(key, []).append(r)
                        break
                    if key in waiting:  # the last to arrive: the others go on
                        todo.extend(waiting.pop(key))
                    now[r] = max(at.values()) + self.collective
                    if self.clocks:
                        for mark in self._arrivals[key]:
                            self._need[r] = mark.joined(self._need[r])
                    self.done[r][x.ranks] = key[1] + 1
                pos[r] += 1


@dataclass(frozen=True)
class Hazard:
    """A transfer that a device-wide sync on rank ``rank``, held at its instruction ``at`` (a
    compute), would wait on for ever: ``transfer`` (a send or receive it posted) is never matched,
    because its peer stops at its instruction ``peer_at`` (its program's length: it finished)."""

    rank: int
    at: int
    transfer: Action
    peer: int
    peer_at: int


def drain_hazards(programs: Sequence[Program], rank_of: Callable[[int], int]) -> list[Hazard]:
    """Every (rank, compute) at which a device-wide synchronisation would never return (the module
    docstring's rule), first per rank.

    Rank r's host is held at each compute t in turn, with t queued (its device runs everything up to
    it) and every other rank running on: r runs up to t + 1 and the others as far as they go. Every
    transfer r posted before t must then be matched: a receive by its send's post (the producing
    compute done), a send by the receive its peer posted (NCCL's send of a large message waits for
    it). The others are played as the host of gloo runs (a wait blocks the host), which never lets a
    rank post more than NCCL's run-ahead does: a program that passes here passes there.

    One game with clocks answers every hold (``Game``): the transfer is matched under the hold
    exactly when its match needs at most t + 1 of r's instructions. (Holding each rank at each
    compute in turn played every program p times: 4 s at p = 64, m = 64.) Where one is not, a game
    held there says where the peer stops."""
    game = Game(programs, clocks=True)
    game.run()
    out: list[Hazard] = []
    for r, program in enumerate(programs):
        mine: list[Action] = []  # what r posted since its last compute, in order
        for t, x in enumerate(program.instructions):
            if isinstance(x, Post):
                mine += (*x.sends, *x.recvs)
                continue
            if not isinstance(x, Action):
                continue
            open_ = [a for a in mine if _needs(game, a, r) > t + 1]
            if open_:
                a = open_[0]
                q = rank_of(a.peer_stage)
                held = Game(programs)
                held.run(hold=(r, t + 1))
                out.append(Hazard(r, t, a, q, held.pos[q]))
                break
            mine = []
    return out


def _needs(game: Game, a: Action, r: int) -> float:
    """How many of rank r's instructions must run before transfer ``a``, which r posted, is matched
    (in a game with clocks, played through); never matched there: infinity."""
    mark = game.sent_at.get(sender(a)) if a.kind.is_recv else game.ready_at.get(Action(*_receiver(a)))
    return math.inf if mark is None else mark.on(r)
