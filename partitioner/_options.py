"""``partition``'s own options, checked, and its memory-limit check with the smallest limit that fits.

    # p: ranks, v: stages per rank, k = p * v stages, s: stage, r: rank

``Options.make`` checks the cost, speeds and memory limits (one number for every rank, or one per
rank), the share of each limit kept free (``memory_headroom``) and the links' latency and
bandwidth (see ``partitioner.costs``); the schedule's options are ``schedule_options``'.
``check_fit`` turns a rank's memory limit into per-stage limits for the layers (``stage_limits``:
the rank's usable bytes, its limit less what its device holds beyond the walk, ``DeviceMemory``;
their share ``/ v``, less the stage's input and output buffers) and, when no balance fits them,
raises naming the smallest limit (or factor on the limits) that would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from partitioner._fit import fits, smallest
from partitioner._inputs import _prefix_rows
from partitioner.composition import Composition, collective_link
from partitioner.costs import COSTS, links
from partitioner.device_memory import with_headroom
from partitioner.overhead import NO_RUNTIME, RuntimeCosts
from pipeline.plan import DeviceMemory, check_headroom
from pipeline.schedules.placement import check_placement, rank_of

__all__ = ["Options", "check_fit", "reserve_fix", "reserve_text"]


class Options:
    """The partitioner's own options, checked (the schedule's are ``schedule_options``')."""

    def __init__(self) -> None:
        self.cost = "time"
        self.n_ranks = 1
        self.speeds: list[float] | None = None
        self.bandwidth: list[float] | None = None
        self.latency: list[float] | None = None
        self.memory_limit: list[float] | None = None
        self.scalar_limit = True
        self.optimizer_state_factor = 2.0
        # FSDP and tensor parallelism (with the optimizer's factor): every static byte's one rule
        self.composition = Composition()
        self.runtime = NO_RUNTIME  # the runtime's seconds per action and message (partitioner.overhead)
        self.placement = "loop"  # where stage s lives: the schedule's (pipeline.schedules.schedule.rank_of)
        self.memory_headroom: float | None = None  # the share of a limit kept free; None: the device's
        self.device = DeviceMemory()  # what a rank's device holds beyond the walk (``measured``)

    def measured(self, found: DeviceMemory) -> Options:
        """These options on the device the profile measured (``Profile.device_memory``), with the
        ``memory_headroom`` given, if any."""
        self.device = with_headroom(found, self.memory_headroom)
        return self

    def composed(
        self,
        shard: int,
        tp: int,
        zero: int,
        bandwidth: float | Sequence[float] | None,
        latency: float | Sequence[float] | None,
        dp: int = 1,
    ) -> Options:
        """These options for ``shard`` FSDP parts and ``tp`` tensor-parallel ranks per stage under
        ZeRO-``zero``, their collectives over the slowest of the links given (already checked), in
        ``dp`` replicas of the pipeline."""
        link = collective_link(bandwidth, latency)
        self.composition = Composition(shard, tp, zero, self.optimizer_state_factor, *link, dp=dp)
        return self

    def stage_limits(self, x: float, base: Sequence[float], offset: Sequence[float], k: int) -> list[float]:
        """Per stage s, the bytes its layers may hold when rank r's limit is x * base[r]: the rank's
        usable bytes (``DeviceMemory.usable``) over its v stages, less ``offset[s]``."""
        v = k // self.n_ranks
        return [self.device.usable(x * base[self.rank_of(s)]) / v - offset[s] for s in range(k)]

    def affine(
        self, base: Sequence[float], offset: Sequence[float], k: int
    ) -> tuple[Callable[[float], list[float]], list[float], list[float]]:
        """``stage_limits`` as a function of x, with its slope and offset per stage (it is affine:
        limits_at(x)[s] = x * scale[s] - shift[s]), as ``_fit.smallest`` takes them."""

        def limits_at(x: float) -> list[float]:
            return self.stage_limits(x, base, offset, k)

        d, v = self.device, k // self.n_ranks
        shrink = (1.0 - d.headroom) / (1.0 + d.rounding)  # usable(x) = x shrink - workspace / (1 + rounding)
        scale = [base[self.rank_of(s)] * shrink / v for s in range(k)]
        return limits_at, scale, [d.workspace_bytes / (1.0 + d.rounding) / v + offset[s] for s in range(k)]

    def rank_of(self, s: int) -> int:
        """The rank that holds stage ``s`` (the schedule's placement)."""
        return rank_of(self.placement, self.n_ranks, s)

    @classmethod
    def make(
        cls,
        cost: str,
        p: int,
        v: int,
        speeds: Sequence[float] | None,
        bandwidth: float | Sequence[float] | None,
        latency: float | Sequence[float] | None,
        memory_limit: float | Sequence[float] | None,
        optimizer_state_factor: float,
        runtime: RuntimeCosts | None = None,
        placement: str = "loop",
        memory_headroom: float | None = None,
    ) -> Options:
        """``runtime``: what the simulated step charges per action and message (None: nothing;
        the auto search passes ``DEFAULT_RUNTIME`` when given none); ``placement``: the schedule's
        (its registry entry's), where each stage and so each cut lives; ``memory_headroom``: the
        share of each limit kept free (None: the profiled device's, ``partitioner.device_memory``).
        FSDP and tensor parallelism: ``composed``."""
        out = cls()
        if memory_headroom is not None:
            check_headroom(memory_headroom)
        out.memory_headroom = memory_headroom
        if cost not in COSTS:
            raise ValueError(f"unknown cost {cost!r}; valid costs are {', '.join(COSTS)}")
        check_placement(placement)
        out.cost, out.n_ranks, out.placement = cost, p, placement
        out.bandwidth = links("bandwidth", bandwidth, p, v, placement)
        out.latency = links("latency", latency, p, v, placement)
        if cost != "time" and (bandwidth is not None or latency is not None):
            named = "bandwidth" if bandwidth is not None else "latency"
            raise ValueError(f"{named} turns bytes into seconds and needs cost='time', not cost={cost!r}")
        out.speeds = _per_rank("speeds", speeds, p, positive=True)
        out.scalar_limit = memory_limit is None or isinstance(memory_limit, (int, float))
        out.memory_limit = _per_rank("memory_limit", memory_limit, p, positive=False)
        if isinstance(optimizer_state_factor, bool) or not optimizer_state_factor >= 0:
            raise ValueError(
                f"optimizer_state_factor ({optimizer_state_factor!r}) must be >= 0: bytes of optimizer "
                "state per parameter byte (2.0 for Adam, 1.0 for SGD with momentum, 0.0 for plain SGD)"
            )
        out.optimizer_state_factor = optimizer_state_factor
        out.composition = Composition(optimizer_state_factor=float(optimizer_state_factor))
        if runtime is not None and not isinstance(runtime, RuntimeCosts):
            raise TypeError(
                f"runtime ({runtime!r}) must be a partitioner.overhead.RuntimeCosts (or None for the default)"
            )
        out.runtime = NO_RUNTIME if runtime is None else runtime
        return out

    def stage_speeds(self, k: int) -> list[float] | None:
        return None if self.speeds is None else [self.speeds[self.rank_of(s)] for s in range(k)]


def _per_rank(
    name: str, value: float | Sequence[float] | None, p: int, *, positive: bool
) -> list[float] | None:
    """One number for every rank, or one per rank, checked."""
    if value is None:
        return None
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = [float(value)] * p
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        values = [float(x) for x in value]
        if len(values) != p:
            raise ValueError(f"{name} has {len(values)} entries for {p} ranks; pass one per rank")
    else:
        raise TypeError(f"{name} must be a number or a list of one per rank, got {type(value).__name__}")
    for r, x in enumerate(values):
        if math.isnan(x) or (x <= 0 if positive else x < 0) or (positive and math.isinf(x)):
            where = f"{name}[{r}]" if not isinstance(value, (int, float)) else name
            raise ValueError(f"{where} ({x!r}) must be a number {bound}")
    return values


def check_fit(
    net: Options,
    rows: list[list[float]],
    offset: list[float],
    recompute: str,
    k: int,
    v: int,
) -> list[float]:
    """Per-stage limits for the layers (the rank's share less ``offset[s]``, the stage's buffers that
    do not depend on its layers); a ValueError naming the smallest memory_limit (or factor) that fits
    when none does."""
    assert net.memory_limit is not None
    per_rank, p = net.memory_limit, net.n_ranks
    found = net.stage_limits(1.0, per_rank, offset, k)
    grouped = _prefix_rows(rows, k)  # arrays, once: not per fit
    if fits(grouped, found, k):
        return found
    kept = (
        f" with recompute={recompute!r}, where a stage keeps up to {max(offset):g} bytes of inputs and "
        "outputs (each counted at the largest activation any cut can carry) besides its layers"
        if recompute != "never"
        else ""
    )
    if net.scalar_limit:
        least = smallest(grouped, k, *net.affine([1.0] * p, offset, k))
        raise ValueError(
            f"memory_limit ({per_rank[0]:g}) is too small: no split into {k} stages fits it{kept}; "
            f"the smallest limit that fits is {least!r}{reserve_text(net.device)}; raise memory_limit "
            f"{reserve_fix(net.device)}or use more ranks"
        )
    factor = smallest(grouped, k, *net.affine(per_rank, offset, k))
    raise ValueError(
        f"memory_limit ({per_rank}) is too small: no split into {k} stages fits it{kept}; the limits "
        f"must grow by a factor of at least {factor!r}{reserve_text(net.device)}"
    )


def reserve_text(device: DeviceMemory) -> str:
    """For a memory error: what each limit keeps beyond the walk, when it keeps anything."""
    return f" ({device.describe()})" if device.reserves else ""


def reserve_fix(device: DeviceMemory) -> str:
    """The other fixes of a memory error, where the device reserves something."""
    return "or lower memory_headroom or the workspaces, " if device.reserves else ""
