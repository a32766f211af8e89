"""Lower bounds on the memory limit a configuration needs, each checked before what it saves.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, s: stage, l: layer, o: option

Floors, each read off the data of the rule it bounds, never a formula of its own:

    static floor   the layers' static bytes (weights, gradients, optimizer state, buffers:
                   ``layer_bounds``' "least", ``partitioner.memory``), no activation, no buffer:
                   every row of every schedule and mode holds at least these, so a limit they
                   do not fit fits nothing. No schedule is built: a refusal in milliseconds.
    group floor    a group's (schedule, v, m) joint problem (each stage on any mode, ``Modes``)
                   on the memory rows of the walk (``peaks.coefficients``, unchanged) of its
                   ranks' compute orders alone (``_ComputeOnly``): at every compute that walk
                   holds a subset of what the program's walk holds, so its coefficients, rows
                   and smallest limit are at most the exact ones. No program is derived. First
                   the first and last ranks' (2 / p of a walk, the others at their static bytes),
                   then every rank's.

    static floor  <=  group floor (two ranks)  <=  group floor (every rank)  <=  the exact smallest
                                                   limit of the per-stage choice and of each mode

``partition`` refuses below the static floor before it builds its schedule, and the auto search
below what every k's static check implies (sum and largest group, ``refuse_below_static`` with k
None) before it picks one: one function, one row, one rule of a rank's usable bytes. When nothing
fits, the search skips a group whose floors do not fit the least limit found (one fit each, at it:
``static_reaches``, ``group_reaches``), and a group that not even its floor fits at the limit given
(``group_fits``) before walking it (``partitioner.auto``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from partitioner._balance import Modes
from partitioner._fit import fits, smallest
from partitioner._inputs import _prefix
from partitioner._joint import fits_joint
from partitioner._options import Options, reserve_fix, reserve_text
from partitioner._planning import grouped, least_memory
from partitioner.figures import Profile
from pipeline.schedules.program import Program
from pipeline.schedules.schedule import Schedule

__all__ = [
    "group_fits",
    "group_floor",
    "group_reaches",
    "refuse_below_static",
    "static_fits",
    "static_floor",
    "static_reaches",
    "static_row",
    "walked_ranks",
]


def static_row(profile: Profile, net: Options, sizes: list[int]) -> list[float]:
    """Prefix sums over the layer groups of each layer's static bytes (``least_memory``): what
    every static check reads (the auto search keeps one per profile it scales)."""
    return _prefix(grouped(least_memory(profile, net.composition), sizes))


def _base(net: Options) -> list[float]:
    """What x multiplies: 1 per rank (x is the limit), or each rank's own limit (x a factor)."""
    if net.scalar_limit or net.memory_limit is None:
        return [1.0] * net.n_ranks
    return net.memory_limit


def static_fits(
    profile: Profile, net: Options, k: int, sizes: list[int], row: list[float] | None = None
) -> bool:
    """Whether some balance into k stages holds the layers' static bytes within the limits (``row``:
    their ``static_row``, when kept)."""
    return _fits_static(static_row(profile, net, sizes) if row is None else row, net, k)


def _fits_static(row: list[float], net: Options, k: int) -> bool:
    assert net.memory_limit is not None  # called only with a limit
    return fits([row], net.stage_limits(1.0, net.memory_limit, [0.0] * k, k), k)


def static_reaches(
    profile: Profile, net: Options, k: int, sizes: list[int], least: float, row: list[float] | None = None
) -> bool:
    """Whether the static floor of k stages is above ``least`` (a limit, or a factor on the per-rank
    limits): one fit there, not the floor itself (a relative 1e-12 below: see ``group_reaches``)."""
    x = least * (1.0 - 1e-12)
    held = static_row(profile, net, sizes) if row is None else row
    return not fits([held], net.stage_limits(x, _base(net), [0.0] * k, k), k)


def static_floor(profile: Profile, net: Options, k: int, sizes: list[int]) -> float:
    """The least limit (or factor on the per-rank limits) at which the static bytes of k stages fit."""
    return _floor_static(static_row(profile, net, sizes), net, k)


def _floor_static(row: list[float], net: Options, k: int) -> float:
    return smallest([row], k, *net.affine(_base(net), [0.0] * k, k))


def refuse_below_static(
    profile: Profile, net: Options, k: int | None, sizes: list[int], row: list[float] | None = None
) -> None:
    """A ValueError when the layers' static bytes (weights, gradients, optimizer state, buffers:
    ``static_row``, over the layer groups ``sizes``) cannot fit the limits, before any schedule:

        k stages   no split into k stages holds them within the stage limits (``fits``); the error
                   names their floor, the exact min-max over those splits (a limit there gets the
                   exact smallest limit, activations included, from ``check_fit``)
        k None     no configuration at all (the auto search, before it picks p x v): every split
                   into any k = p v stages holds all the groups within stage limits that add up to
                   the ranks' usable bytes, the largest group in one stage of at most one rank's;
                   so it needs sum(usable) >= the total and max(usable) >= the largest group, which
                   every k's check implies (it refuses nothing that some k fits). The error names
                   the least one limit meeting both, or the two figures for limits per rank

    One row, one rule of what a rank may hold (``Options.stage_limits``, its usable bytes of
    ``DeviceMemory.usable`` over its v stages): the two differ only in how much of the split they
    know. ``net``: with k None, its n_ranks and limits are read (its v, and placement, are not)."""
    if net.memory_limit is None:
        return
    if row is None:
        row = static_row(profile, net, sizes)
    if k is None:
        _refuse_for_every_k(row, net)
        return
    if _fits_static(row, net, k):
        return
    floor = _floor_static(row, net, k)
    given = net.memory_limit
    alone = (
        f"no split into {k} stages fits even the weights, gradients, optimizer state and buffers alone, "
        "before any activation"
    )
    if net.scalar_limit:
        raise ValueError(
            f"memory_limit ({given[0]:g}) is too small: {alone}: they need a limit of at "
            f"least {floor!r} bytes per rank{reserve_text(net.device)}; raise memory_limit past that (a "
            f"limit there is answered with the smallest that fits, activations included) "
            f"{reserve_fix(net.device)}or use more ranks"
        )
    raise ValueError(
        f"memory_limit ({given}) is too small: {alone}: the limits must grow by a factor of at least "
        f"{floor!r}{reserve_text(net.device)}; raise memory_limit {reserve_fix(net.device)}or use more ranks"
    )


def _refuse_for_every_k(row: list[float], net: Options) -> None:
    """``refuse_below_static`` with k None: the sum and the largest group against the usable bytes."""
    assert net.memory_limit is not None
    p, device = net.n_ranks, net.device
    usable = [device.usable(limit) for limit in net.memory_limit]  # a rank's stage limits' sum, any v
    total, largest = row[-1], max((b - a for a, b in itertools.pairwise(row)), default=0.0)
    if sum(usable) >= total and max(usable) >= largest:
        return
    less = ", less what each keeps," if device.reserves else ""
    if net.scalar_limit:
        at_least = f"at least {device.limit_for(max(total / p, largest)):.4g} bytes per rank"
    else:
        at_least = f"limits that{less} add up to at least {total:.4g} bytes, one at least {largest:.4g}"
    given = net.memory_limit[0] if net.scalar_limit else net.memory_limit
    raise ValueError(
        f"memory_limit ({given!r}) is too small for every configuration: the weights, gradients "
        f"and optimizer state alone are {total:.4g} bytes over {p} ranks (the largest layer group's, "
        f"which no cut splits, {largest:.4g}), before any activation{reserve_text(device)}; it needs "
        f"{at_least}: raise memory_limit {reserve_fix(device)}or use more ranks"
    )


@dataclass(frozen=True)
class _ComputeOnly(Schedule):
    """A schedule whose program, on the ranks in ``walked``, is its compute actions alone (its
    ``Program.compute()``: no receive posted ahead, no send held until its free) and empty on the
    others. The walk (``coefficients``) of it holds, at each compute, a subset of what the whole
    program's walk holds there (the posts and frees only add holders), so its coefficients are a
    lower bound of the walk's, read by the same rule; no program is derived, and two ranks walked
    cost 2 / p of one walk."""

    walked: frozenset[int] = frozenset()

    def program(self, rank: int, *, dp: int = 1, ties: Sequence[Sequence[int]] = ()) -> Program:
        return Program(rank, self.compute[rank] if rank in self.walked else ())


def walked_ranks(sched: Schedule, ends: bool = False) -> frozenset[int]:
    """The ranks whose stages a floor charges activations: every rank, or (``ends``) the first and
    the last, 2 / p of the walk: a rank left out holds its static bytes only, so the balance crowds
    its stages and that floor is far lower, but it still prunes the groups far above the best."""
    return frozenset({0, sched.n_ranks - 1} if ends else range(sched.n_ranks))


def _floor_modes(
    profile: Profile,
    sched: Schedule,
    net: Options,
    sizes: list[int],
    modes: Sequence[str],
    ends: bool = False,
) -> Modes:
    """The group's joint problem (each stage on any of ``modes``) on the rows of the walk of the
    compute actions of ``walked_ranks`` (coefficients 0 on the other ranks' stages: static bytes)."""
    ranks = walked_ranks(sched, ends)
    part = _ComputeOnly(
        f"{sched.name}/compute of {sorted(ranks) if ends else 'every rank'}",
        sched.n_stages,
        sched.n_ranks,
        sched.n_microbatches,
        sched.split_backward,
        sched.compute,
        sched.placement,
        ranks,
    )  # fmt: skip  (its own name: its own rows cached)
    return Modes.build(profile, part, net, sizes, [list(modes)] * sched.n_stages)


def group_floor(
    profile: Profile,
    sched: Schedule,
    net: Options,
    sizes: list[int],
    modes: Sequence[str],
    ends: bool = False,
) -> float:
    """A lower bound on the smallest limit (or factor) at which ``sched`` fits with each stage on
    any of ``modes``: ``Modes.smallest`` of it, and each mode's alone, are at least this."""
    return _floor_modes(profile, sched, net, sizes, modes, ends).smallest()


def group_reaches(
    profile: Profile, sched: Schedule, net: Options, sizes: list[int], modes: Sequence[str], least: float
) -> bool:
    """Whether a group floor is above ``least`` (a limit, or a factor on the per-rank limits): its
    rows do not fit there, so no config of the group fits below it. One fit per floor, not the
    floor itself: the two ranks' first, then every rank's. A relative 1e-12 below ``least`` keeps
    the float rows (other sums than the exact rows') from skipping a group that ties it."""
    x = least * (1.0 - 1e-12)
    per_rank = None if net.scalar_limit else net.memory_limit
    for ends in (True, False):
        floor = _floor_modes(profile, sched, net, sizes, modes, ends)
        if not fits_joint(floor.memory, floor.limits(x, per_rank), floor.allowed, floor.k):
            return True
    return False


def group_fits(
    profile: Profile, sched: Schedule, net: Options, sizes: list[int], modes: Sequence[str]
) -> bool:
    """False when not even the group floor's rows fit the limits: no config of the group fits."""
    return _floor_modes(profile, sched, net, sizes, modes).fits()
