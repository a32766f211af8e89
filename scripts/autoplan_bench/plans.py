"""The benchmark's plans: the grid the search considers, every configuration's exact balance under a
limit, the two limits, the auto plan and the default, per model (see ``bench_autoplan``).
"""

from __future__ import annotations

import itertools
import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from _autoplan_models import Workload, build

from partitioner import NoisyProfileWarning, Profile, equal_balance, partition, plan_for, profile
from partitioner.auto import search
from partitioner.overhead import RuntimeCosts
from partitioner.scaling import scale_profile, second_rows
from pipeline.plan import Plan
from pipeline.runtime.step.recompute import RECOMPUTE_MODES
from pipeline.schedules.registry import REGISTRY, entry
from pipeline.schedules.schedule import rank_of
from pipeline.schedules.schedule import schedule as make_schedule

P = 2  # ranks
SCHEDULES = tuple(REGISTRY)
_SHORT = {"interleaved-1f1b": "i1f1b", "zb-h1": "zbh1"}  # in the table's plan names; others as they are
_MODE = {"never": "n", "except_last": "l", "always": "a"}
Recompute = str | tuple[str, ...]


@dataclass(frozen=True)
class Config:
    """One point of the grid: schedule, m, v and the recomputation (one mode, or one per stage)."""

    schedule: str
    m: int
    v: int
    recompute: Recompute

    def label(self) -> str:
        """``1f1b m4 rc:n``: schedule, m, v when > 1, recomputation (n never, l except_last,
        a always; one letter per stage when stages differ)."""
        modes = (self.recompute,) if isinstance(self.recompute, str) else self.recompute
        v = f" v{self.v}" if self.v > 1 else ""
        return (
            f"{_SHORT.get(self.schedule, self.schedule)} m{self.m}{v} rc:{''.join(_MODE[r] for r in modes)}"
        )


def microbatch_counts(batch: int) -> list[int]:
    """Every m that divides the batch's B rows."""
    return [m for m in range(1, batch + 1) if batch % m == 0]


def recompute_choices(k: int, m: int, per_stage: bool) -> list[Recompute]:
    """The recomputation settings of a k-stage plan with m micro-batches, without duplicates:
    "except_last" at m = 1 recomputes nothing (it is "never") and is left out; with
    ``per_stage``, every tuple of one mode per stage whose modes differ is added."""
    modes = [r for r in RECOMPUTE_MODES if not (r == "except_last" and m < 2)]
    out: list[Recompute] = list(modes)
    if per_stage:
        out += [combo for combo in itertools.product(modes, repeat=k) if len(set(combo)) > 1]
    return out


def virtual_counts(name: str, n_ranks: int, n_layers: int, max_virtual: int | None = None) -> list[int]:
    """The v the search tries: the schedule's own, up to n // p (at most ``max_virtual``)."""
    e = entry(name)
    if e.max_virtual == 1:
        return [1]
    return e.virtual_counts(min(n_layers // n_ranks, max_virtual or n_layers))


def grid(
    n_ranks: int, batch: int, n_layers: int, per_stage: bool = False, max_virtual: int | None = None
) -> list[Config]:
    """Every configuration the search considers: schedule x v x m dividing B x recomputation
    (interleaved-1f1b: every v from 2 to n // p, ``max_virtual`` at most, and m a multiple of p;
    zb-v: v = 2, any m)."""
    out = []
    for name in SCHEDULES:
        for v in virtual_counts(name, n_ranks, n_layers, max_virtual):
            for m in microbatch_counts(batch):
                if entry(name).m_multiple_of_p and m % n_ranks != 0:
                    continue
                out += [Config(name, m, v, rc) for rc in recompute_choices(n_ranks * v, m, per_stage)]
    return out


def rank_peaks(plan: Plan) -> list[float]:
    """Predicted peak bytes per rank: the sum of its stages' (each stage's limit is the rank's / v)."""
    placement, p = entry(plan.schedule).placement, plan.n_ranks
    held = [0.0] * p
    for s, st in enumerate(plan.stages):
        held[rank_of(placement, p, s)] += st.memory_bytes
    return held


def plan_key(plan: Plan) -> str:
    """What makes two plans run the same: each rank's lowered actions, the recomputation and the
    balance (not the schedule's name: gpipe and 1f1b at m = 1 are one plan, measured once, so that
    measurement noise cannot rank a plan against itself)."""
    rc = plan.recompute if isinstance(plan.recompute, str) else list(plan.recompute)
    sched = make_schedule(plan.schedule, plan.n_ranks, plan.n_microbatches, n_virtual=plan.n_virtual)
    actions = [[str(a) for a in rank] for rank in sched.lowered()]
    return json.dumps([actions, rc, plan.balance])


def _config_of(plan: Plan) -> Config:
    rc: Recompute = plan.recompute if isinstance(plan.recompute, str) else tuple(plan.recompute)
    return Config(plan.schedule, plan.n_microbatches, plan.n_virtual, rc)


def _plan(
    work: Workload, prof: Profile, config: Config, limit: float | None, runtime: RuntimeCosts
) -> Plan | None:
    """The exact balance of ``config`` under ``limit`` (None: no plan of it fits)."""
    try:
        return partition(
            work.model,
            P,
            work.x,
            schedule=config.schedule,
            n_microbatches=config.m,
            n_virtual=config.v,
            recompute=config.recompute,  # type: ignore[arg-type]  # one per stage: once Plan takes it
            memory_limit=limit,
            runtime=runtime,
            profile=prof,
        )
    except ValueError as exc:
        if limit is not None and "too small" in str(exc):
            return None
        raise


@dataclass
class Profiled:
    """What ``partition(schedule="auto")`` profiles: one step's B rows (``whole``) and a second size
    (``second``: the smallest micro-batch, for each layer's per-call overhead); ``per_m``: both
    scaled to B / m rows (``partitioner.scaling``), what every grid plan of that m is made from."""

    whole: Profile
    second: tuple[Profile, int]
    per_m: dict[int, Profile]


def _profiles(work: Workload, ms: Sequence[int], quick: bool) -> Profiled:
    """Profile the model (with the loss) as the search does, and price each m as it does."""
    rows = work.x.shape[0]
    warmup, repeat = (1, 2) if quick else (2, 10)

    def of(n: int) -> Profile:
        with warnings.catch_warnings():  # the table names the untrusted layers (Case.noisy), briefly
            warnings.simplefilter("ignore", NoisyProfileWarning)
            return profile(
                work.model, work.x[:n], loss_fn=work.loss_fn, target=work.y[:n], warmup=warmup, repeat=repeat
            )

    if rows < 2:
        raise ValueError(f"batch ({rows} rows) must have at least 2 rows: the search profiles two sizes")
    other = second_rows(rows, rows, microbatch_counts(rows))  # as partition(schedule="auto") does
    whole, second = of(rows), (of(other), other)
    return Profiled(whole, second, {m: scale_profile(whole, rows, rows // m, second) for m in ms})


def _auto(work: Workload, limit: float, profiled: Profiled, runtime: RuntimeCosts) -> tuple[Plan, float]:
    """The auto plan and the seconds the search took: ``partition(model, p, x, schedule="auto",
    n_microbatches="auto", memory_limit=limit, batch_size=B)`` after its profiling, given the
    same two profiles as the grid (so that noise cannot make them differ)."""
    rows = work.x.shape[0]
    start = time.perf_counter()
    plan = search(
        profiled.whole, P, batch_size=rows, sample_rows=rows, memory_limit=limit, second=profiled.second,
        runtime=runtime,
    )  # fmt: skip
    return plan, time.perf_counter() - start


def _per_stage(
    work: Workload, limit: float, profiled: Profiled, configs: list[Config], runtime: RuntimeCosts
) -> list[Plan]:
    """Per (schedule, v, m) of the grid, the search's best plan of that group alone when its
    recomputation differs between stages (the search's joint choice of balance and a mode per
    stage, which the grid of one mode for every stage lacks)."""
    rows, out = work.x.shape[0], []
    for name, v, m in sorted({(c.schedule, c.v, c.m) for c in configs}):
        try:
            plan = search(
                profiled.whole, P, batch_size=rows, sample_rows=rows, memory_limit=limit, schedules=[name],
                n_microbatches=m, n_virtual=v, second=profiled.second, runtime=runtime,
            )  # fmt: skip
        except ValueError as exc:
            if "too small" in str(exc):
                continue  # nothing of this group fits
            raise
        if not isinstance(plan.recompute, str):
            out.append(plan.replace(candidates=[], search=None))  # the group's best alone, no search record
    return out


def smallest_fit(fits: Callable[[float], bool], high: float, rel: float = 0.005) -> float:
    """The smallest limit in (0, high] that ``fits`` (monotone: what fits a limit fits any larger),
    within ``rel``, by bisection; ``high`` must fit."""
    if not fits(high):
        raise ValueError(f"nothing fits the upper bound {high:g}; give a larger one")
    low = 0.0
    while high - low > rel * high:
        mid = (low + high) / 2
        if fits(mid):
            high = mid
        else:
            low = mid
    return high


def choose_limits(
    free_peaks: Sequence[Sequence[float]], default_peaks: Sequence[float], least: float
) -> tuple[float, float]:
    """(loose, tight) per-rank limits: loose is 2 x the largest predicted peak of the unconstrained
    plans (``free_peaks``, per rank), so all of them fit; tight is 30 % of the way from ``least``,
    the smallest limit any configuration fits, to the default's peak, which then does not fit."""
    highs = [max(peaks) for peaks in free_peaks]
    default = max(default_peaks)
    return 2.0 * max([*highs, default]), least + 0.3 * max(0.0, default - least)


@dataclass
class Case:
    """One model under one limit, as planned: its fitting grid plans, the auto plan and the default."""

    model: str
    limit_name: str  # "loose" or "tight"
    limit: float  # bytes per rank
    grid_size: int
    fitting: list[Plan]
    auto: Plan
    search_s: float
    default: Plan
    noisy: list[int] = field(default_factory=list)  # layers the profile found too noisy to trust (-1: loss)


def plan_model(
    name: str, quick: bool, batch: int, per_stage: bool, max_virtual: int | None, runtime: RuntimeCosts
) -> tuple[list[Case], list[Plan]]:
    """A model's two cases (loose and tight limit) and every distinct plan they need measured."""
    work = build(name, quick, batch)
    configs = grid(P, batch, len(work.model), per_stage, max_virtual)
    profiled = _profiles(work, sorted({c.m for c in configs} | {P}), quick)
    per_m = profiled.per_m
    free = [plan for c in configs if (plan := _plan(work, per_m[c.m], c, None, runtime)) is not None]
    default = plan_for(
        per_m[P], equal_balance(len(work.model), P), schedule="1f1b", n_microbatches=P, runtime=runtime
    )
    high = max(max(rank_peaks(plan)) for plan in free)
    least = smallest_fit(lambda limit: any(_plan(work, per_m[c.m], c, limit, runtime) for c in configs), high)
    loose, tight = choose_limits([rank_peaks(plan) for plan in free], rank_peaks(default), least)
    groups = len({(c.schedule, c.v, c.m) for c in configs})
    size = len(configs) + (0 if per_stage else groups)  # the search's per-stage config of each group
    cases, plans = [], {plan_key(default): default}
    for label, limit in (("loose", loose), ("tight", tight)):
        fitting = [plan for c in configs if (plan := _plan(work, per_m[c.m], c, limit, runtime)) is not None]
        if not per_stage:  # the search's per-stage choice of each group, when it differs from the grid's
            known = {plan_key(plan) for plan in fitting}
            fitting += [
                plan
                for plan in _per_stage(work, limit, profiled, configs, runtime)
                if plan_key(plan) not in known
            ]
        unique: dict[str, Plan] = {}
        for plan in fitting:  # gpipe and 1f1b at m = 1 are one plan: counted and measured once
            unique.setdefault(plan_key(plan), plan)
        fitting = list(unique.values())
        auto, seconds = _auto(work, limit, profiled, runtime)
        plans.update({plan_key(plan): plan for plan in (*fitting, auto)})
        noisy = list(profiled.whole.noisy_layers)
        cases.append(Case(name, label, limit, size, fitting, auto, seconds, default, noisy))
    return cases, list(plans.values())
