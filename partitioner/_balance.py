"""The exact balance of one configuration (schedule, m, v, recomputation), under the memory limits.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, s: stage, o: option (a mode)

One mode for every stage goes to ``partitioner.solve`` (after ``check_fit``'s memory check, which
names the smallest limit that fits). Modes per stage go to ``partitioner._joint``: ``Modes`` lists,
per stage, the recomputation modes it may use (one each: a fixed per-stage plan; all three: the
auto search's "choose per stage"), and the joint DP picks the balance and each stage's mode::

    Modes.build(profile, sched, net, sizes, [["never", "always", ...], ...])
        options      the distinct modes o, each with per-layer costs (f + b + rho_o f) and memory
                     rows (``memory_rows``, a bound of the walk; its buffers' offset taken off
                     the stage's limit)
        fits(x)      whether some balance fits when each rank's limit is x (scalar) or x times its own
        solve()      (balance, mode per stage), or None when nothing fits

Every stage's limit is its rank's usable bytes / v (the limit less what the device holds beyond
the walk, ``Options.stage_limits``), less the input and output buffers its mode holds (each at the
largest activation a cut can carry), as ``partition`` does for one mode.
"""

from __future__ import annotations

from collections.abc import Sequence

from partitioner._inputs import _prefix
from partitioner._joint import fits_joint, smallest_joint, solve_joint
from partitioner._options import Options, check_fit, reserve_text
from partitioner._planning import expand, grouped, grouped_cut, memory_rows
from partitioner.costs import cut_rows, layer_costs
from partitioner.figures import Profile
from partitioner.solve import solve
from pipeline.plan import Plan
from pipeline.runtime.step.recompute import RECOMPUTE_MODES
from pipeline.schedules.schedule import Schedule

__all__ = ["Modes", "balance_of"]


def balance_of(profile: Profile, shape: Plan, sched: Schedule, net: Options, sizes: list[int]) -> Plan:
    """``shape`` with the exact balance of its configuration (a ValueError when nothing fits)."""
    k, v, m = shape.n_stages, shape.n_virtual, shape.n_microbatches
    if not isinstance(shape.recompute, str):  # modes per stage: the joint DP, one mode allowed each
        modes = Modes.build(profile, sched, net, sizes, [[mode] for mode in shape.recompute])
        found = modes.solve()
        if found is None:
            least = modes.smallest()
            raise ValueError(
                f"memory_limit ({_limit_text(net)}) is too small: no split into {k} stages fits it with "
                f"recompute={shape.recompute!r}; {_least_text(net, least)}{reserve_text(net.device)}; raise "
                "memory_limit, recompute on more stages or use more ranks"
            )
        return shape.replace(balance=found[0])
    recompute = shape.recompute
    limits, rows = None, None
    if net.memory_limit is not None:  # first: a limit nothing fits is refused before any cost is made
        layer_rows, offset = memory_rows(profile, sched, recompute, net.composition)
        rows = [grouped(row, sizes) for row in layer_rows]
        limits = check_fit(net, rows, offset, recompute, k, v)
    costs = layer_costs(
        profile, net.cost, recompute=recompute, n_microbatches=m, split_backward=sched.split_backward
    )
    cuts = cut_rows(profile, k, net.n_ranks, net.latency, net.bandwidth, net.placement)
    group_balance = solve(
        grouped(costs, sizes),
        k,
        cut_costs=None if cuts is None else [grouped_cut(row, sizes) for row in cuts],
        memory=None if limits is None else rows,
        memory_limit=limits,
        speeds=net.stage_speeds(k),
    )
    return shape.replace(balance=expand(group_balance, sizes))


class Modes:
    """The joint problem of a configuration whose stages choose their modes (see the module docstring)."""

    def __init__(self) -> None:
        self.modes: list[str] = []  # option o's mode
        self.allowed: list[list[int]] = []  # per stage: its options
        self.prefix: list[list[float]] = []  # per option: cost prefix sums over the layer groups
        self.memory: list[list[list[float]]] = []  # per option: per stage, memory prefix sums
        self.offset: list[list[float]] = []  # per option: per stage, bytes of its input and output buffers
        self.cut: list[list[float]] | None = None
        self.speed: list[float] | None = None
        self.sizes: list[int] = []
        self.net = Options()
        self.k = self.v = 1

    @classmethod
    def build(
        cls,
        profile: Profile,
        sched: Schedule,
        net: Options,
        sizes: list[int],
        allowed: Sequence[Sequence[str]],
    ) -> Modes:
        out = cls()
        k, m = sched.n_stages, sched.n_microbatches
        out.k, out.v, out.net, out.sizes = k, k // sched.n_ranks, net, sizes
        out.modes = [mode for mode in RECOMPUTE_MODES if any(mode in stage for stage in allowed)]
        out.allowed = [
            [out.modes.index(mode) for mode in RECOMPUTE_MODES if mode in stage] for stage in allowed
        ]
        for mode in out.modes:
            costs = layer_costs(
                profile, net.cost, recompute=mode, n_microbatches=m, split_backward=sched.split_backward
            )
            out.prefix.append(_prefix(grouped(costs, sizes)))
            rows, offset = memory_rows(profile, sched, mode, net.composition)
            sums: dict[int, list[float]] = {}  # stages of equal coefficients share a row: one sum each
            for row in rows:
                if id(row) not in sums:
                    sums[id(row)] = _prefix(grouped(row, sizes))
            out.memory.append([sums[id(row)] for row in rows])
            out.offset.append(offset)
        cuts = cut_rows(profile, k, net.n_ranks, net.latency, net.bandwidth, net.placement)
        out.cut = None if cuts is None else [grouped_cut(row, sizes) for row in cuts]
        if out.cut is not None and not any(any(row[:-1]) for row in out.cut):
            out.cut = None
        out.speed = net.stage_speeds(k)
        return out

    def limits(self, x: float, per_rank: Sequence[float] | None = None) -> list[list[float]]:
        """Per option, per stage: the layers' limit when rank r's limit is x (or x * per_rank[r])."""
        p = self.net.n_ranks
        base = [1.0] * p if per_rank is None else list(per_rank)
        return [self.net.stage_limits(x, base, off, self.k) for off in self.offset]

    def fits(self, allowed: Sequence[Sequence[int]] | None = None) -> bool:
        """Whether some balance fits the limits, each stage on one of its options (or of ``allowed``)."""
        assert self.net.memory_limit is not None
        limits = self.limits(1.0, self.net.memory_limit)
        return fits_joint(self.memory, limits, self.allowed if allowed is None else allowed, self.k)

    def smallest(self) -> float:
        """The least x such that every rank's limit x fits (scalar limit), or the least factor on the
        given per-rank limits."""
        given = self.net.memory_limit
        per_rank = None if given is None or self.net.scalar_limit else given
        top = max(row[-1] for rows in self.memory for row in rows) + max(max(off) for off in self.offset)
        rank = self.net.device.limit_for(top * self.v)  # a rank limit whose every stage holds top
        high = rank / (1.0 if per_rank is None else max(min(per_rank), 1e-300)) * 2.0 + 1.0
        return smallest_joint(self.memory, self.allowed, self.k, lambda x: self.limits(x, per_rank), high)

    def solve(self) -> tuple[list[int], tuple[str, ...]] | None:
        """(balance, mode per stage) of the smallest bottleneck that fits, None if none fits."""
        limited = self.net.memory_limit is not None
        found = solve_joint(
            self.prefix,
            self.k,
            self.allowed,
            cut=self.cut,
            speed=self.speed,
            memory=self.memory if limited else None,
            limits=self.limits(1.0, self.net.memory_limit) if limited else None,
        )
        if found is None:
            return None
        ends, options = found
        group_balance = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        return expand(group_balance, self.sizes), tuple(self.modes[o] for o in options)


def _limit_text(net: Options) -> str:
    assert net.memory_limit is not None
    return f"{net.memory_limit[0]:g}" if net.scalar_limit else str(net.memory_limit)


def _least_text(net: Options, least: float) -> str:
    if net.scalar_limit:
        return f"the smallest limit that fits is {least!r}"
    return f"the limits must grow by a factor of at least {least!r}"
