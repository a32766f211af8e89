"""Schedules as plain data: per-rank compute orders, their text form, lowering and the name registry.

    # p: ranks, v: virtual stages per rank, m: micro-batches, s: stage, i: micro-batch, r: rank

A ``Schedule`` holds, for every rank, the ordered compute actions (F, B, W) it runs.
Where stage s lives is the schedule's ``placement`` (``rank_of``, the one statement of the rule):
"loop" puts it on rank s % p, so rank r owns stages r, r + p, r + 2p, ...; "v" (ZB-V) puts
chunk c = s // p on rank s % p going down for even c and p - 1 - s % p coming back for odd c, so
rank r owns stages r and 2p - 1 - r (v = 2).  The text form is one line per rank::

    0F0 0F1 0B0 0B1
    1F0 1B0 1F1 1B1

Lowering adds the communication each rank must run.  Around every compute action
of stage s on rank r:

    RECV_F (s, i)  before F,  when stage s - 1 is on another rank  (activation in)
    SEND_F (s, i)  after F,   when stage s + 1 is on another rank  (activation out)
    RECV_B (s, i)  before B,  when stage s + 1 is on another rank  (gradient in)
    SEND_B (s, i)  after B,   when stage s - 1 is on another rank  (gradient out)

so between two compute actions a rank's lowered list holds the sends of the previous
one followed by the receives of the next one: one contiguous block that the executor
posts as a single batch.  W actions never communicate.  A neighbour stage on the
same rank gets no communication at all: the tensor is passed locally.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.schedules.actions import Action, Kind, parse_action
from pipeline.schedules.placement import PLACEMENTS, check_placement, rank_of
from pipeline.schedules.program import Program, derive, options
from pipeline.schedules.registry import REGISTRY, entry
from pipeline.schedules.validate import ScheduleError, check_drain, validate

__all__ = [
    "PLACEMENTS",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "default_n_virtual",
    "forward_only",
    "rank_of",
    "schedule",
    "schedule_options",
    "unchecked",
]

SCHEDULES: tuple[str, ...] = tuple(REGISTRY)  # the registered names (registry.py), in its order


@dataclass(frozen=True)
class Schedule:
    name: str
    n_stages: int  # all stages, p * v
    n_ranks: int  # p
    n_microbatches: int  # m
    split_backward: bool  # True: B is the input-gradient part only, and every (s, i) has a W
    compute: tuple[tuple[Action, ...], ...]  # per rank, ordered F/B/W actions
    placement: str = "loop"  # where stage s lives: rank_of(placement, p, s)

    @property
    def n_virtual(self) -> int:
        return self.n_stages // self.n_ranks

    def rank_of(self, stage: int) -> int:
        return rank_of(self.placement, self.n_ranks, stage)

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank ``rank`` holds, in increasing order."""
        return list(self._stages_by_rank.get(rank, ()))

    @functools.cached_property
    def _stages_by_rank(self) -> dict[int, tuple[int, ...]]:
        # once per schedule: the walk asks every rank's, a placement lookup per stage each time
        by_rank: dict[int, list[int]] = {}
        for s in range(self.n_stages):
            by_rank.setdefault(self.rank_of(s), []).append(s)
        return {r: tuple(stages) for r, stages in by_rank.items()}

    def lowered(self) -> tuple[tuple[Action, ...], ...]:
        """Per rank: the compute actions with their sends and receives, in run order."""
        return self._lowered

    @functools.cached_property
    def _lowered(self) -> tuple[tuple[Action, ...], ...]:
        ranks = [self.rank_of(s) for s in range(self.n_stages)]
        # per stage: whether the stage before it, and the one after it, live on another rank
        prev_remotes = [s > 0 and ranks[s - 1] != ranks[s] for s in range(self.n_stages)]
        next_remotes = [s < self.n_stages - 1 and ranks[s + 1] != ranks[s] for s in range(self.n_stages)]
        return tuple(tuple(self._lower_rank(actions, prev_remotes, next_remotes)) for actions in self.compute)

    @staticmethod
    def _lower_rank(
        actions: tuple[Action, ...], prev_remotes: list[bool], next_remotes: list[bool]
    ) -> list[Action]:
        out: list[Action] = []
        append = out.append  # one lookup: planning lowers tens of thousands of actions
        # per compute kind: the receive before it, when the stage its input comes from is remote,
        # and the send after it, when the stage its output goes to is (W: none)
        F, B = Kind.F, Kind.B
        recv_f, send_f, recv_b, send_b = Kind.RECV_F, Kind.SEND_F, Kind.RECV_B, Kind.SEND_B
        for a in actions:
            kind = a.kind
            if kind is F:
                s = a.stage
                if prev_remotes[s]:
                    append(Action(s, recv_f, a.microbatch))
                append(a)
                if next_remotes[s]:
                    append(Action(s, send_f, a.microbatch))
            elif kind is B:
                s = a.stage
                if next_remotes[s]:
                    append(Action(s, recv_b, a.microbatch))
                append(a)
                if prev_remotes[s]:
                    append(Action(s, send_b, a.microbatch))
            else:
                append(a)
        return out

    def program(self, rank: int, *, dp: int = 1, ties: Sequence[Sequence[int]] = ()) -> Program:
        """Rank ``rank``'s step as data: computes, posts, waits, frees, reductions and collectives
        (program.py), for ``dp`` replicas and the weights tied across ``ties`` (stage tuples)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.n_ranks:
            raise ValueError(
                f"rank ({rank!r}) must be an integer in [0, {self.n_ranks}): one of the schedule's ranks"
            )
        return self.programs(dp=dp, ties=ties)[rank]

    def programs(self, *, dp: int = 1, ties: Sequence[Sequence[int]] = ()) -> tuple[Program, ...]:
        """Every rank's program (derived once per dp > 1 or not and tie set)."""
        key = options(self, dp, ties)
        if key not in self._derived:
            self._derived[key] = derive(self, dp=dp, ties=ties)
        return self._derived[key]

    @functools.cached_property
    def _derived(self) -> dict[tuple[bool, tuple[tuple[int, ...], ...]], tuple[Program, ...]]:
        return {}

    def to_text(self) -> str:
        return "\n".join(" ".join(str(a) for a in actions) for actions in self.compute)

    @classmethod
    def from_text(
        cls,
        text: str,
        *,
        name: str = "custom",
        n_stages: int | None = None,
        split_backward: bool | None = None,
        check: bool = True,
        placement: str = "loop",
    ) -> Schedule:
        """Load one line per rank; infer n_stages, m and split_backward unless given; stage s is
        on rank ``rank_of(placement, p, s)``.

        With ``check`` (the default) the schedule is validated before it is returned.
        """
        check_placement(placement)
        lines = text.strip().splitlines()
        if not lines:
            raise ValueError("empty schedule text: expected one line of actions per rank, e.g. '0F0 0B0'")
        compute = tuple(tuple(parse_action(tok) for tok in line.split()) for line in lines)
        flat = [a for actions in compute for a in actions]
        for a in flat:
            if not a.kind.is_compute:
                raise ValueError(
                    f"schedule text holds the communication action {a}: write only F, B and W "
                    "actions, the sends and receives are added by Schedule.lowered()"
                )
        if not flat:
            raise ValueError("schedule text has no actions: expected actions such as '0F0 0B0'")
        sched = cls(
            name=name,
            n_stages=max(a.stage for a in flat) + 1 if n_stages is None else n_stages,
            n_ranks=len(lines),
            n_microbatches=max(a.microbatch for a in flat) + 1,
            split_backward=any(a.kind is Kind.W for a in flat) if split_backward is None else split_backward,
            compute=compute,
            placement=placement,
        )
        if check:
            validate(sched)
        return sched


def default_n_virtual(name: str) -> int:
    """v when not given: the fewest stages per rank the schedule takes (2 for interleaved-1f1b)."""
    return entry(name).default_virtual


def schedule_options(
    name: str, n_ranks: int, n_microbatches: int | None = None, n_virtual: int | None = None
) -> tuple[int, int]:
    """The one check of a schedule's options: ``(n_virtual, n_microbatches)``, defaults filled in.

    Defaults: v = the fewest stages per rank the schedule takes; m = p. ``partition``,
    ``Pipeline``, ``Plan`` and the scripts all call this, so an option means the
    same and is refused with the same message everywhere. What each schedule takes is
    its registry entry's (registry.py).
    """
    e = entry(name)
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, int) or n_ranks < 1:
        raise ValueError(f"n_ranks ({n_ranks!r}) must be an integer >= 1: the pipeline's ranks (devices)")
    v = n_virtual if n_virtual is not None else e.default_virtual
    m = n_microbatches if n_microbatches is not None else n_ranks
    for label, value in (("n_virtual", v), ("n_microbatches", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} ({value!r}) must be an integer >= 1")
    if v < e.min_virtual:
        raise ValueError(
            f"n_virtual ({v}) must be >= {e.min_virtual} for {name} (stages per rank); "
            f"pass n_virtual={e.min_virtual} or more, or use schedule='1f1b'"
        )
    if not e.takes_virtual(v):
        if e.max_virtual == 1:
            several = [x.name for x in REGISTRY.values() if x.max_virtual != 1]
            raise ValueError(
                f"n_virtual ({v}) must be 1 for {name!r}, which runs one stage per rank; "
                f"use schedule={several[0]!r} for several stages per rank"
            )
        raise ValueError(f"n_virtual ({v}) must be at most {e.max_virtual} for {name!r}")
    if e.m_multiple_of_p and m % n_ranks != 0:
        fixes = " or ".join(str(k) for k in (m - m % n_ranks, m - m % n_ranks + n_ranks) if k > 0)
        raise ValueError(
            f"n_microbatches ({m}) must be a multiple of the number of ranks ({n_ranks}) for "
            f"{name}; use {fixes} micro-batches, or schedule='1f1b'"
        )
    return v, m


def schedule(
    name: str, n_ranks: int, n_microbatches: int | None = None, *, n_virtual: int | None = None
) -> Schedule:
    """The named schedule on ``n_ranks`` ranks (p), each holding ``n_virtual`` stages (v), validated.

    The one place a ``Schedule`` is built from a name; see ``schedule_options`` for the defaults.

    >>> print(schedule("1f1b", 2, 2).to_text())
    0F0 0F1 0B0 0B1
    1F0 1B0 1F1 1B1
    """
    v, m = schedule_options(name, n_ranks, n_microbatches, n_virtual)
    sched = unchecked(name, n_ranks, m, v)
    validate(sched)
    return sched


def unchecked(name: str, p: int, m: int, v: int) -> Schedule:
    """The named schedule straight from its generator, options taken as valid and not validated: for
    the search, which builds dozens and reads only their order of actions (``schedule`` validates
    every one, seconds for k = 96 stages and m = 64; the generators are validated for every shape in
    their own tests)."""
    e = entry(name)
    return Schedule(name, p * v, p, m, e.split_backward, e.generate(p, v, m), e.placement)


def forward_only(sched: Schedule) -> Schedule:
    """The forwards of ``sched`` alone, for evaluation: each rank runs its stages in order.

    Stage order on every rank (then micro-batch order) cannot deadlock: every
    forward waits only for a lower stage, and lower stages never wait for higher
    ones. The result has no backward, so it is not a training schedule and
    ``validate`` (which demands every B) does not apply to it.
    """
    compute = tuple(
        tuple(Action(s, Kind.F, i) for s in sched.stages_of(r) for i in range(sched.n_microbatches))
        for r in range(sched.n_ranks)
    )
    forward = Schedule(
        f"{sched.name}/forward",
        sched.n_stages,
        sched.n_ranks,
        sched.n_microbatches,
        False,
        compute,
        sched.placement,
    )
    check_drain(forward)  # the one check of validate's that a forward-only program needs proving
    return forward
