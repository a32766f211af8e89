"""Validate a schedule before it runs: every check raises ``ScheduleError`` with a rank x step grid.

    # p: ranks, k: stages, s: stage, i: micro-batch, r: rank, t: step (position in a rank's list)

Checks, in order, each with its own message:

1. shape: one line per rank, stages and micro-batches in range, stage s on its rank
   (``rank_of``: s % p for the "loop" placement, the V for "v");
2. missing or duplicated actions: every (s, i) has one F and one B, and one W exactly
   when the schedule splits the backward;
3. broken dependency on one rank: an action placed before something it needs that the
   same rank runs (F(s, i) before B(s, i) before W(s, i); a neighbour stage on the same
   rank: F(s-1, i) before F(s, i), B(s+1, i) before B(s, i));
4. order mismatch: for every pair of ranks src -> dst, the sends of src to dst and the
   receives of dst from src, in the order each rank's program posts them, name the same
   messages (NCCL and gloo match point-to-point messages in posting order);
5. collective order: every rank of a group (tied weights' ranks, the whole pipeline for
   the loss) runs the same collectives on it in the same order (NCCL matches a
   communicator's collectives by their order: a mismatch hangs or mixes data);
6. deadlock: every rank's program (program.py: what the executor runs), with sends that
   never block, a ``wait`` that blocks until its message is sent, and a collective that
   blocks until every rank of its group reaches it, finishes.  The grid brackets the
   instruction each rank is stuck at::

       step   0   1                      2        3     4    5                      ...
       rank 0 0F0 post 0SEND_F0 0RECV_B0 [wait 0RECV_B0]  0B0  0F1 post 0SEND_F1 0RECV_B1 ...
       rank 1 post 1RECV_F0 wait 1RECV_F0 1F0 post 1RECV_F1 [wait 1RECV_F1] 1F1 ...

   (rank 0 waits for a gradient that rank 1 computes only after an activation
   that rank 0 sends only after that gradient.)  ``blocking_sends=True`` checks
   instead the lowered lists under a stricter executor, one that posts each block
   between two computes as a batch and waits for all of it, sends included;
7. drain (``check_drain``, also run on forward-only schedules): a device-wide
   synchronisation while a rank's host queues any of its computes (the caching
   allocator's retry, a lazily loaded kernel's first launch) must return: every
   transfer that rank posted completes while it is held there and the others run on
   (program.py, ``drain_hazards``).  The grid brackets the held compute and where
   the peer stops::

       step   ...  3                       4      ...  9     ...
       rank 0 ...  post 0SEND_F2 0RECV_B0  [0F3]
       rank 1 ...                                      [wait 1RECV_F3]  1F3  1B0 ...

   (rank 0's 0RECV_B0 needs rank 1's 1B0, which comes after 1F3, whose input rank 0
   posts only once 0F3 is queued and the sync has returned.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.program import Collective, Post, Program, drain_hazards, play, sender

__all__ = ["ScheduleError", "check_drain", "render_program", "validate"]


class ScheduleError(ValueError):
    """A schedule that cannot run: missing or duplicated actions, broken dependencies, deadlock."""


class Schedule(Protocol):
    """What the validator reads of a ``schedule.Schedule`` (structural: this module imports no other)."""

    @property
    def name(self) -> str: ...
    @property
    def n_stages(self) -> int: ...
    @property
    def n_ranks(self) -> int: ...
    @property
    def n_microbatches(self) -> int: ...
    @property
    def split_backward(self) -> bool: ...
    @property
    def compute(self) -> tuple[tuple[Action, ...], ...]: ...
    @property
    def placement(self) -> str: ...

    def rank_of(self, stage: int) -> int: ...

    def lowered(self) -> tuple[tuple[Action, ...], ...]: ...

    def programs(self, *, dp: int = 1, ties: Sequence[Sequence[int]] = ()) -> tuple[Program, ...]: ...


_MAX_COLUMNS = 16  # wider grids keep only the columns around the marked steps


def render_program(program: Sequence[Sequence[object]], marks: set[tuple[int, int]] | None = None) -> str:
    """A rank x step grid of ``program``; the (rank, step) cells in ``marks`` are bracketed."""
    marks = marks or set()
    n_steps = max((len(row) for row in program), default=0)
    cols = list(range(n_steps))
    if n_steps > _MAX_COLUMNS and marks:
        keep = {t for _, step in marks for t in range(step - 3, step + 3)}
        cols = [t for t in cols if t in keep]
    elif n_steps > _MAX_COLUMNS:
        cols = cols[:_MAX_COLUMNS]

    def cell(r: int, t: int) -> str:
        if t >= len(program[r]):
            return ""
        text = str(program[r][t])
        return f"[{text}]" if (r, t) in marks else text

    widths = {t: max([len(str(t)), *(len(cell(r, t)) for r in range(len(program)))]) for t in cols}
    header: list[str] = ["step  "]
    rows: list[list[str]] = [[f"rank {r}"] for r in range(len(program))]
    prev = -1
    for t in cols:
        if t != prev + 1:  # elided columns
            header.append("...")
            for row in rows:
                row.append("...")
        header.append(str(t).ljust(widths[t]))
        for r, row in enumerate(rows):
            row.append(cell(r, t).ljust(widths[t]))
        prev = t
    if cols and prev != n_steps - 1:
        header.append("...")
        for row in rows:
            row.append("...")
    return "\n".join(" ".join(line).rstrip() for line in [header, *rows])


def _fail(
    sched: Schedule, what: str, program: Sequence[Sequence[object]], marks: set[tuple[int, int]]
) -> None:
    grid = render_program(program, marks)
    raise ScheduleError(
        f"schedule {sched.name!r} (p={sched.n_ranks}, m={sched.n_microbatches}): {what}\n{grid}"
    )


def _check_shape(sched: Schedule) -> None:
    p, k, m = sched.n_ranks, sched.n_stages, sched.n_microbatches
    if p < 1 or k < 1 or m < 1:
        raise ScheduleError(
            f"schedule {sched.name!r}: n_ranks ({p}), n_stages ({k}) and n_microbatches ({m}) "
            "must all be >= 1"
        )
    if k % p != 0:
        raise ScheduleError(
            f"schedule {sched.name!r}: n_stages ({k}) must be a multiple of n_ranks ({p}), "
            "so that every rank holds the same number of stages"
        )
    if len(sched.compute) != p:
        raise ScheduleError(
            f"schedule {sched.name!r} has {len(sched.compute)} rank programs but n_ranks is {p}"
        )
    for r, actions in enumerate(sched.compute):
        for t, a in enumerate(actions):
            problem = ""
            if not a.kind.is_compute:
                problem = "is a communication action; compute programs hold only F, B and W"
            elif not 0 <= a.stage < k:
                problem = f"names stage {a.stage}, outside 0..{k - 1}"
            elif not 0 <= a.microbatch < m:
                problem = f"names micro-batch {a.microbatch}, outside 0..{m - 1}"
            elif sched.rank_of(a.stage) != r:
                problem = (
                    f"is on rank {r} but stage {a.stage} lives on rank {sched.rank_of(a.stage)} "
                    f"(placement {sched.placement!r}); move it there or pass the schedule's placement"
                )
            elif a.kind is Kind.W and not sched.split_backward:
                problem = "is a W but split_backward is False: B already holds the whole backward"
            if problem:
                _fail(sched, f"action {a} at rank {r} step {t} {problem}", sched.compute, {(r, t)})


def _check_once(sched: Schedule) -> None:
    where: dict[Action, list[tuple[int, int]]] = {}
    for r, actions in enumerate(sched.compute):
        for t, a in enumerate(actions):
            where.setdefault(a, []).append((r, t))
    dups = {a: at for a, at in where.items() if len(at) > 1}
    if dups:
        names = ", ".join(str(a) for a in sorted(dups))
        marks = {rk for at in dups.values() for rk in at}
        _fail(sched, f"duplicated action(s) {names}: each must appear exactly once", sched.compute, marks)
    kinds = (Kind.F, Kind.B, Kind.W) if sched.split_backward else (Kind.F, Kind.B)
    missing = [
        Action(s, kind, i)
        for s in range(sched.n_stages)
        for i in range(sched.n_microbatches)
        for kind in kinds
        if Action(s, kind, i) not in where
    ]
    if missing:
        shown = ", ".join(str(a) for a in missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        _fail(sched, f"missing action(s) {shown}: each must appear exactly once", sched.compute, set())


def _check_local_order(sched: Schedule) -> None:
    for r, actions in enumerate(sched.compute):
        step = {a: t for t, a in enumerate(actions)}
        for t, a in enumerate(actions):
            for d in a.needs:
                if d in step and step[d] > t:
                    _fail(
                        sched,
                        f"broken dependency: {a} at rank {r} step {t} runs before {d} (step {step[d]}), "
                        "which it needs",
                        sched.compute,
                        {(r, t), (r, step[d])},
                    )


def _message(sched: Schedule, a: Action) -> tuple[int, int, Action]:
    """(src rank, dst rank, the SEND naming the message) of a send or receive."""
    send = a if a.kind.is_send else sender(a)
    return sched.rank_of(send.stage), sched.rank_of(send.peer_stage), send


def _check_channels(sched: Schedule, programs: Sequence[Program]) -> None:
    sent: dict[tuple[int, int], list[tuple[Action, int]]] = {}
    recv: dict[tuple[int, int], list[tuple[Action, int]]] = {}
    for program in programs:
        for t, x in enumerate(program):
            if isinstance(x, Post):
                for a in (*x.sends, *x.recvs):
                    src, dst, msg = _message(sched, a)
                    (sent if a.kind.is_send else recv).setdefault((src, dst), []).append((msg, t))
    for src, dst in sorted(set(sent) | set(recv)):
        sends, recvs = sent.get((src, dst), []), recv.get((src, dst), [])
        for n in range(max(len(sends), len(recvs))):
            s_msg = sends[n][0] if n < len(sends) else None
            r_msg = recvs[n][0] if n < len(recvs) else None
            if s_msg != r_msg:
                marks = ({(src, sends[n][1])} if n < len(sends) else set()) | (
                    {(dst, recvs[n][1])} if n < len(recvs) else set()
                )
                _fail(
                    sched,
                    f"order mismatch on rank {src} -> rank {dst}: message {n} is sent as {s_msg} but "
                    f"received as the one of {r_msg}; sends and receives between two ranks must be posted in "
                    "the same order",
                    _rows(programs),
                    marks,
                )


def _rows(programs: Sequence[Program]) -> list[tuple[object, ...]]:
    return [program.instructions for program in programs]


def _collectives(programs: Sequence[Program]) -> dict[tuple[int, ...], list[list[tuple[Collective, int]]]]:
    """Per group of pipeline ranks, per member, its collectives on the group (with their steps);
    collectives over the replicas are left out: every replica runs the same program."""
    out: dict[tuple[int, ...], list[list[tuple[Collective, int]]]] = {}
    for r, program in enumerate(programs):
        for t, x in enumerate(program):
            if isinstance(x, Collective) and x.ranks:
                members = out.setdefault(x.ranks, [[] for _ in x.ranks])
                if r not in x.ranks:
                    raise ScheduleError(f"rank {r}'s program runs {x}, a collective of a group without it")
                members[x.ranks.index(r)].append((x, t))
    return out


def _check_collective_order(sched: Schedule, programs: Sequence[Program]) -> None:
    for group, seqs in _collectives(programs).items():
        for n in range(max(len(seq) for seq in seqs)):
            seen = [seq[n] if n < len(seq) else None for seq in seqs]
            ops = {x for x, _ in (c for c in seen if c is not None)}
            if len(ops) == 1 and None not in seen:
                continue
            each = "; ".join(
                f"rank {q} runs {c[0] if c is not None else 'none'}" for q, c in zip(group, seen, strict=True)
            )
            marks = {(q, c[1]) for q, c in zip(group, seen, strict=True) if c is not None}
            _fail(
                sched,
                f"collective order mismatch on ranks {','.join(map(str, group))}: as its collective {n} on "
                f"them, {each}; every rank of a group must run its collectives in the same order",
                _rows(programs),
                marks,
            )


def _check_program_deadlock(sched: Schedule, programs: Sequence[Program]) -> None:
    # played at no cost (program.play: a wait blocks until its message is posted, a collective until
    # its whole group reaches it; the order check made each rank's n-th collective on a group the same)
    stuck = set(play(programs).stuck(programs))
    if stuck:
        waits = "; ".join(f"rank {r} is stuck at {programs[r].instructions[t]}" for r, t in sorted(stuck))
        _fail(
            sched,
            f"deadlock: with sends that never block, waits that block until their message is sent and "
            f"collectives that block until their whole group reaches them, no rank can proceed ({waits})",
            _rows(programs),
            stuck,
        )


def check_drain(sched: Schedule, *, dp: int = 1, ties: Sequence[Sequence[int]] = ()) -> None:
    """Raise ``ScheduleError`` if a device-wide synchronisation on some rank, while its host queues
    one of its computes, would never return (check 7 of the module docstring): for training and
    forward-only schedules alike (``forward_only`` runs it on what evaluation runs)."""
    programs = sched.programs(dp=dp, ties=ties)
    hazards = drain_hazards(programs, sched.rank_of)
    if not hazards:
        return
    h = hazards[0]
    held, stop = programs[h.rank].instructions[h.at], programs[h.peer]
    where = (
        f"rank {h.peer} stops at {stop.instructions[h.peer_at]} (step {h.peer_at})"
        if h.peer_at < len(stop)
        else f"rank {h.peer} finished its program without it"
    )
    more = f" ({len(hazards) - 1} more rank(s) likewise)" if len(hazards) > 1 else ""
    _fail(
        sched,
        f"device-wide sync hazard: with rank {h.rank}'s host held at {held} (step {h.at}: a device-wide "
        f"synchronisation there, such as the caching allocator's retry or a kernel's first launch, "
        f"waits for every queued kernel), its posted {h.transfer} never completes: {where}, waiting "
        f"for what rank {h.rank} posts only after {held}{more}. A receive must not be posted before the "
        "sends its sender needs (program.py posts such a receive with its own block)",
        _rows(programs),
        {(h.rank, h.at), (h.peer, h.peer_at)},
    )


def _check_blocking_deadlock(sched: Schedule, lowered: Sequence[Sequence[Action]]) -> None:
    # A rank posts a whole block of sends and receives at once and leaves it only when every op
    # in it is matched (a send also waits for its receive to be posted).
    posted: dict[bool, Counter[tuple[int, int]]] = {True: Counter(), False: Counter()}  # is_send -> count
    pending: list[list[tuple[int, bool, tuple[int, int], int]]] = [[] for _ in lowered]  # (step, send, ch, n)
    pos = [0] * len(lowered)

    def matched(op: tuple[int, bool, tuple[int, int], int]) -> bool:
        _, is_send, channel, n = op
        return posted[not is_send][channel] > n

    progressed = True
    while progressed:
        progressed = False
        for r, actions in enumerate(lowered):
            while True:
                if pending[r]:
                    if not all(matched(op) for op in pending[r]):
                        break
                    pending[r] = []
                if pos[r] == len(actions):
                    break
                if actions[pos[r]].kind.is_compute:
                    pos[r] += 1
                else:
                    while pos[r] < len(actions) and not actions[pos[r]].kind.is_compute:
                        op = actions[pos[r]]
                        channel = _message(sched, op)[:2]
                        n = posted[op.kind.is_send][channel]
                        posted[op.kind.is_send][channel] += 1
                        pending[r].append((pos[r], op.kind.is_send, channel, n))
                        pos[r] += 1
                progressed = True
    stuck = {
        (r, next(op[0] for op in pending[r] if not matched(op))) for r in range(len(lowered)) if pending[r]
    }
    if stuck:
        waits = "; ".join(f"rank {r} waits at {lowered[r][t]}" for r, t in sorted(stuck))
        _fail(
            sched,
            f"deadlock: with blocking sends (a batch waits for all its ops) no rank can proceed ({waits})",
            lowered,
            stuck,
        )


def validate(
    schedule: Schedule, *, blocking_sends: bool = False, dp: int = 1, ties: Sequence[Sequence[int]] = ()
) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` can run; see the module docstring for the checks.

    The programs checked are those for ``dp`` replicas and the weights tied across ``ties`` (one
    sequence of stages per tied parameter). ``blocking_sends`` checks the lowered lists under the
    stricter model of an executor that waits for a whole send/receive block, sends included.
    """
    _check_shape(schedule)
    _check_once(schedule)
    _check_local_order(schedule)
    programs = schedule.programs(dp=dp, ties=ties)
    _check_channels(schedule, programs)
    _check_collective_order(schedule, programs)
    if blocking_sends:
        _check_blocking_deadlock(schedule, schedule.lowered())
    else:
        _check_program_deadlock(schedule, programs)
    check_drain(schedule, dp=dp, ties=ties)
