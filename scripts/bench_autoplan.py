"""Auto-plan benchmark: the plan ``partition(schedule="auto")`` picks, measured against every configuration.

    python scripts/bench_autoplan.py                   # 3 models x 2 memory limits, a few minutes
    python scripts/bench_autoplan.py --models gpt --steps 8 --json runs/autoplan.json --detail
    python scripts/bench_autoplan.py --quick           # tiny models, batch 2 (the smoke test)

    # p: ranks (2 here), v: stages per rank, k = p * v stages, m: micro-batches, B: batch rows

For each model (``_autoplan_models``: the reference GPT, a ResNet-like CNN, an MLP with one very
heavy layer) and two per-rank memory limits (bytes of a rank's peak as ``partitioner.memory``
predicts it: weights, gradients, Adam state, buffers, held activations):

    grid     gpipe, 1f1b, zb-h1, interleaved-1f1b (v = 2 .. n / p)  x  m dividing B  x  one
             recompute mode for every stage, plus the search's per-stage choice of each
             (schedule, v, m); each with the exact balance ``partition`` finds under the limit
             (what cannot fit is left out), all from the two profiles the search takes (B rows
             and the smallest micro-batch, 1 row: ``second_rows``), priced at B / m rows the
             way it does (``partitioner.scaling``), with the runtime's own seconds per action
             and per message measured first on the same 2 ranks (``measure_runtime``)
    auto     what partition(model, p, x, schedule="auto", n_microbatches="auto", memory_limit=...,
             batch_size=B) returns: ``partitioner.auto.search`` given those same two profiles
             (so that profiling noise cannot set it apart from the grid); timed (the search time)
    default  what a user would pick: 1f1b, m = p, no recomputation, equal layer counts

    loose limit   2 x the largest predicted peak of any configuration's unconstrained plan
    tight limit   30 % of the way from the smallest limit any configuration fits to the
                  default's peak: the default does not fit, the search must choose otherwise

Every plan of a model (both limits' grids, the auto plans, the default; each distinct plan once)
then runs in the SAME two processes (``pipeline.launch``, gloo, one thread per rank), round-robin:
each round steps every plan once, in a fresh random order (the same on both ranks), so a load
spike hits all of them alike. A step is timed from the barrier before it to the last rank's end
(Adam's step follows, untimed); the peak is ``memory_stats(optimizer)["peak"]`` per rank::

    warm-up rounds | screening rounds: every plan | final rounds: auto, default, each limit's
                                                    fastest few by screening (--top)

The best measured configuration is the fastest finalist by the final rounds' median: picking the
minimum of many noisy screenings would favour whichever plan got lucky. The table gives, per
model and limit, the auto plan's median step against the best (goal: within 5 %) and against the
default, its measured peak against the limit (never above), and the search time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _autoplan_models beside this file
from _autoplan_models import MODELS, Workload, build

from partitioner import NoisyProfileWarning, Profile, equal_balance, partition, plan_for, profile
from partitioner.auto import search
from partitioner.overhead import RuntimeCosts, measure_runtime
from partitioner.scaling import scale_profile, second_rows
from pipeline.launch import launch
from pipeline.plan import Plan
from pipeline.runtime.recompute import RECOMPUTE_MODES

__all__ = [
    "Case",
    "Config",
    "Measured",
    "Result",
    "Row",
    "build_row",
    "choose_limits",
    "collate",
    "finalists",
    "grid",
    "main",
    "microbatch_counts",
    "plan_key",
    "rank_peaks",
    "recompute_choices",
    "smallest_fit",
    "step_times",
    "table",
    "virtual_counts",
]

P = 2  # ranks
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
_SHORT = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved-1f1b": "i1f1b", "zb-h1": "zbh1"}
_MODE = {"never": "n", "except_last": "l", "always": "a"}
Recompute = str | tuple[str, ...]


# ---- the grid


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
    """The v the search tries: 1, or for interleaved-1f1b 2 up to n // p (at most ``max_virtual``)."""
    if name != "interleaved-1f1b":
        return [1]
    return list(range(2, min(n_layers // n_ranks, max_virtual or n_layers) + 1))


def grid(
    n_ranks: int, batch: int, n_layers: int, per_stage: bool = False, max_virtual: int | None = None
) -> list[Config]:
    """Every configuration the search considers: schedule x v x m dividing B x recomputation
    (interleaved-1f1b: every v from 2 to n // p, ``max_virtual`` at most, and m a multiple of p)."""
    out = []
    for name in SCHEDULES:
        for v in virtual_counts(name, n_ranks, n_layers, max_virtual):
            for m in microbatch_counts(batch):
                if v > 1 and m % n_ranks != 0:
                    continue
                out += [Config(name, m, v, rc) for rc in recompute_choices(n_ranks * v, m, per_stage)]
    return out


# ---- plans


def rank_peaks(plan: Plan) -> list[float]:
    """Predicted peak bytes per rank: the sum of its stages' (each stage's limit is the rank's / v)."""
    return [sum(st.memory_bytes for st in plan.stages[r :: plan.n_ranks]) for r in range(plan.n_ranks)]


def plan_key(plan: Plan) -> str:
    """What makes two plans run the same: the plan without its predictions."""
    rc = plan.recompute if isinstance(plan.recompute, str) else list(plan.recompute)
    return json.dumps([plan.schedule, plan.n_microbatches, plan.n_virtual, rc, plan.balance])


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
            out.append(plan.replace(extra={}))
    return out


# ---- measurement (in the ranks)


@dataclass
class Measured:
    """One plan's measurements on one rank: its steps' (start, end) and its peak memory."""

    spans: list[tuple[float, float]] = field(default_factory=list)
    peak: float | None = None  # the most memory_stats' "peak" gave over the measured steps
    split: dict[str, Any] = field(default_factory=dict)  # the last step's memory_stats, by kind
    source: str = ""


def _stats(pipe: Any, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``memory_stats``, given the optimizer so that its state is counted."""
    return dict(pipe.memory_stats(optimizer))


@dataclass
class Job:
    """What the ranks measure for one model."""

    model: str
    plans: list[str]  # Plan.to_json of every distinct plan
    groups: list[list[int]]  # per limit: the plans of the grid that fit it (indices into plans)
    always: list[int]  # finalists whatever the screening says: the auto plans and the default


def finalists(
    medians: Sequence[float], groups: Sequence[Sequence[int]], always: Sequence[int], top: int
) -> list[int]:
    """The plans measured again: ``always`` and each group's ``top`` fastest by screening median."""
    chosen = set(always)
    for group in groups:
        chosen.update(sorted(group, key=lambda j: (medians[j], j))[:top])
    return sorted(chosen)


def step_times(spans: Sequence[Sequence[tuple[float, float]]]) -> list[float]:
    """A plan's step times from every rank's (start, end) per step: earliest start to last end."""
    return [max(r[i][1] for r in spans) - min(r[i][0] for r in spans) for i in range(len(spans[0]))]


_Run = tuple[Any, list[torch.nn.Parameter], "torch.optim.Optimizer | None"]


def _rounds(
    runs: list[_Run],
    chosen: Sequence[int],
    rounds: int,
    warmup: int,
    work: Workload,
    order: random.Random,
    out: list[Measured],
) -> None:
    """``warmup + rounds`` rounds, each stepping every chosen plan once in a fresh random order (the
    same on every rank: the same seed); the measured ones go to ``out``."""
    for k in range(warmup + rounds):
        turn = list(chosen)
        order.shuffle(turn)
        for j in turn:
            pipe, params, optimizer = runs[j]
            dist.barrier()
            start = time.perf_counter()
            pipe.step(work.x, work.y)
            end = time.perf_counter()
            stats = _stats(pipe, optimizer)
            if optimizer is not None:
                optimizer.step()
            for param in params:
                param.grad = None
            if k < warmup:
                continue
            result = out[j]
            result.spans.append((start, end))
            if stats.get("peak") is not None:
                result.peak = max(result.peak or 0.0, float(stats["peak"]))
            result.split = {key: v for key, v in stats.items() if isinstance(v, int | float) or v is None}
            result.source = str(stats.get("source", ""))


def _rank_measure(
    job: Job, quick: bool, batch: int, rounds: tuple[int, int, int], top: int, seed: int
) -> tuple[list[Measured], list[Measured]]:
    """On each rank: every plan's pipeline; ``rounds`` = (warm-up, screening, final): all plans are
    screened round-robin, then the finalists run again. This rank's measurements of both phases."""
    from pipeline.runtime.pipe import Pipeline

    runs: list[_Run] = []
    for text in job.plans:
        work = build(job.model, quick, batch)  # fresh weights per plan: pipelines must not share layers
        pipe = Pipeline(work.model, Plan.from_json(text), loss_fn=work.loss_fn)
        params = list(pipe.parameters())
        runs.append((pipe, params, torch.optim.Adam(params, lr=1e-4) if params else None))
    work = build(job.model, quick, batch)
    order = random.Random(seed)
    warmup, screening, final = rounds
    screen = [Measured() for _ in runs]
    _rounds(runs, range(len(runs)), screening, warmup, work, order, screen)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, [m.spans for m in screen])  # every rank picks the same finalists
    medians = [statistics.median(step_times([r[j] for r in every])) for j in range(len(runs))]
    again = [Measured() for _ in runs]
    _rounds(runs, finalists(medians, job.groups, job.always, top), final, 0, work, order, again)
    for pipe, _, _ in runs:
        pipe.close()
    dist.barrier()
    return screen, again


def _measure_runtime(quick: bool) -> RuntimeCosts:
    """On each rank: the runtime's seconds per action and per message (``measure_runtime``)."""
    return measure_runtime(steps=3 if quick else 10, warmup=1 if quick else 2)


def _rank_main(
    jobs: list[Job], quick: bool, batch: int, rounds: tuple[int, int, int], top: int
) -> list[tuple[list[Measured], list[Measured]]]:
    """Every model's plans in turn, in these processes: per model, this rank's two phases."""
    return [_rank_measure(job, quick, batch, rounds, top, seed) for seed, job in enumerate(jobs)]


# ---- the report


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


@dataclass
class Result:
    """One plan's measurements over both ranks: step times of both phases, per-rank measured peaks."""

    screen: list[float]  # seconds, screening rounds
    final: list[float]  # seconds, final rounds (empty: not a finalist)
    peaks: list[float | None]  # bytes per rank (None: not measured)
    splits: list[dict[str, Any]] = field(default_factory=list)  # per rank: the last memory_stats, by kind

    @property
    def median(self) -> float:
        """The final rounds' median step for a finalist, else the screening's."""
        return statistics.median(self.final or self.screen)

    @property
    def peak(self) -> float | None:
        return None if any(p is None for p in self.peaks) else max(p for p in self.peaks if p is not None)


@dataclass
class Row:
    """One line of the table (times in ms, memory in MB)."""

    model: str
    limit: str
    limit_mb: float
    fit: int  # configurations of the grid that fit the limit
    grid: int
    auto: str
    auto_ms: float
    best: str
    best_ms: float
    auto_over_best: float
    default: str
    default_ms: float
    default_fits: bool
    default_over_auto: float
    auto_pred_ms: float
    pred_over_grid: float  # the auto plan's predicted step over the fastest predicted fitting grid plan
    auto_pred_mb: float
    auto_peak_mb: float | None
    peak_over_limit: float | None
    search_s: float


def _name(plan: Plan) -> str:
    return f"{_config_of(plan).label()} {plan.balance}".replace(" ", " ").replace(", ", ",")


def build_row(case: Case, results: dict[str, Result]) -> Row:
    """The table's line for ``case``. The best is the fitting grid plan with the lowest final median
    (each limit's fastest plans by screening are the finalists, so the best is among them)."""
    finalists = [plan for plan in case.fitting if results[plan_key(plan)].final] or case.fitting
    best = min(finalists, key=lambda plan: results[plan_key(plan)].median)
    auto, default = results[plan_key(case.auto)], results[plan_key(case.default)]
    best_ms = results[plan_key(best)].median
    peak = auto.peak
    return Row(
        model=case.model,
        limit=case.limit_name,
        limit_mb=case.limit / 1e6,
        fit=len(case.fitting),
        grid=case.grid_size,
        auto=_name(case.auto),
        auto_ms=auto.median * 1e3,
        best=_name(best),
        best_ms=best_ms * 1e3,
        auto_over_best=auto.median / best_ms,
        default=_name(case.default),
        default_ms=default.median * 1e3,
        default_fits=max(rank_peaks(case.default)) <= case.limit,
        default_over_auto=default.median / auto.median,
        auto_pred_ms=case.auto.step_time * 1e3,
        pred_over_grid=case.auto.step_time / min(plan.step_time for plan in case.fitting),
        auto_pred_mb=max(rank_peaks(case.auto)) / 1e6,
        auto_peak_mb=None if peak is None else peak / 1e6,
        peak_over_limit=None if peak is None else peak / case.limit,
        search_s=case.search_s,
    )


COLUMNS = (  # header, Row attribute, format
    ("model", "model", "<"),
    ("limit", "limit", "<"),
    ("limit MB", "limit_mb", ".2f"),
    ("fit/grid", "", ""),
    ("auto plan", "auto", "<"),
    ("auto ms", "auto_ms", ".2f"),
    ("best measured", "best", "<"),
    ("best ms", "best_ms", ".2f"),
    ("auto/best", "auto_over_best", ".3f"),
    ("default ms", "default_ms", ".2f"),
    ("default/auto", "default_over_auto", ".3f"),
    ("peak MB", "auto_peak_mb", ".2f"),
    ("peak/limit", "peak_over_limit", ".3f"),
    ("search s", "search_s", ".3f"),
    ("pred/grid", "pred_over_grid", ".3f"),
)


def _cell(row: Row, attr: str, fmt: str) -> str:
    if not attr:
        return f"{row.fit}/{row.grid}"
    value = getattr(row, attr)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if attr == "default_ms" and not row.default_fits:
        return f"{value:.2f}*"  # the default does not fit this limit
    return str(value) if fmt == "<" else format(value, fmt)


def table(rows: Sequence[Row]) -> str:
    """The rows under their headers, each column as wide as its widest cell; "-" where unknown."""
    cells = [[_cell(row, attr, fmt) for _, attr, fmt in COLUMNS] for row in rows]
    heads = [head for head, _, _ in COLUMNS]
    widths = [max(len(c) for c in col) for col in zip(heads, *cells, strict=True)]
    left = [fmt == "<" for _, _, fmt in COLUMNS]
    lines = []
    for line in [heads, *cells]:
        lines.append(
            "  ".join(c.ljust(w) if lft else c.rjust(w) for c, w, lft in zip(line, widths, left, strict=True))
        )
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _detail(model: str, plans: list[Plan], results: dict[str, Result], cases: list[Case]) -> str:
    """Every plan measured for ``model``, fastest first (finalists first, by their final median):
    predicted against measured time and peak, and which limits it fits."""
    limits = [c for c in cases if c.model == model]
    names = " ".join(f"{c.limit_name:>5}" for c in limits)
    width = max(len(_name(plan)) for plan in plans)
    lines = [
        f"{model}: {'plan':<{width}} {'pred ms':>8} {'screen':>8} {'final':>8} {'ms/pred':>7} {'pred MB':>8} "
        f"{'MB':>8} {'MB/pred':>7}  {names}"
    ]
    for plan in sorted(
        plans, key=lambda plan: (not results[plan_key(plan)].final, results[plan_key(plan)].median)
    ):
        got = results[plan_key(plan)]
        pred_mb = max(rank_peaks(plan)) / 1e6
        mb = "-" if got.peak is None else f"{got.peak / 1e6:.2f}"
        ratio = "-" if got.peak is None else f"{got.peak / 1e6 / pred_mb:.3f}"
        final = f"{statistics.median(got.final) * 1e3:.2f}" if got.final else "-"
        fits = " ".join(
            f"{'yes' if any(plan_key(p) == plan_key(plan) for p in c.fitting) else '-':>5}" for c in limits
        )
        lines.append(
            f"{'':<{len(model) + 2}}{_name(plan):<{width}} {plan.step_time * 1e3:>8.2f} "
            f"{statistics.median(got.screen) * 1e3:>8.2f} {final:>8} {got.median / plan.step_time:>7.3f} "
            f"{pred_mb:>8.2f} {mb:>8} {ratio:>7}  {fits}"
        )
    return "\n".join(lines)


# ---- the command line


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
        auto, seconds = _auto(work, limit, profiled, runtime)
        plans.update({plan_key(plan): plan for plan in (*fitting, auto)})
        noisy = list(profiled.whole.noisy_layers)
        cases.append(Case(name, label, limit, size, fitting, auto, seconds, default, noisy))
    return cases, list(plans.values())


def _job(name: str, plans: list[Plan], cases: list[Case]) -> Job:
    index = {plan_key(plan): j for j, plan in enumerate(plans)}
    mine = [c for c in cases if c.model == name]
    groups = [[index[plan_key(plan)] for plan in c.fitting] for c in mine]
    always = sorted({index[plan_key(plan)] for c in mine for plan in (c.auto, c.default)})
    return Job(name, [plan.to_json() for plan in plans], groups, always)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny models, batch 2, 2 + 2 rounds (smoke test)"
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--batch", type=int, help="rows per step, B (default 8, quick 2)")
    parser.add_argument("--warmup", type=int, help="unmeasured rounds first (default 2, quick 1)")
    parser.add_argument("--steps", type=int, help="screening rounds, every plan (default 5, quick 2)")
    parser.add_argument("--final", type=int, help="final rounds, the finalists (default 10, quick 2)")
    parser.add_argument("--top", type=int, help="finalists per limit besides auto and default (default 3)")
    parser.add_argument(
        "--per-stage",
        action="store_true",
        help="also every per-stage recomputation (one mode per stage; a much larger grid)",
    )
    parser.add_argument(
        "--max-virtual", type=int, help="interleaved-1f1b: v at most this (default: all of 2 .. n / p)"
    )
    parser.add_argument("--detail", action="store_true", help="also list every plan measured, per model")
    parser.add_argument("--json", default=None, help="write the rows and every measurement to this path")
    args = parser.parse_args(argv)
    batch = args.batch if args.batch is not None else (2 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    final = args.final if args.final is not None else (2 if args.quick else 10)
    top = args.top if args.top is not None else 3
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown or not names:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if min(batch, steps, final, top) < 1 or warmup < 0:
        parser.error(
            f"--batch ({batch}), --steps ({steps}), --final ({final}) and --top ({top}) must be >= 1, "
            f"--warmup ({warmup}) >= 0"
        )

    began = time.perf_counter()
    runtime = launch(_measure_runtime, P, args.quick, backend="gloo")[0]
    cases: list[Case] = []
    jobs: dict[str, list[Plan]] = {}
    for name in names:
        mine, jobs[name] = plan_model(name, args.quick, batch, args.per_stage, args.max_virtual, runtime)
        cases += mine
    planned = time.perf_counter() - began
    work = [_job(name, plans, cases) for name, plans in jobs.items()]
    per_rank = launch(_rank_main, P, work, args.quick, batch, (warmup, steps, final), top, backend="gloo")
    results = collate(jobs, per_rank)
    rows = [build_row(case, results[case.model]) for case in cases]
    source = per_rank[0][0][0][0].source
    _print(
        rows,
        (batch, warmup, steps, final, top),
        source,
        planned,
        runtime,
        [
            f"# {model}: the profile found layers {list(noisy)} too noisy to trust (-1: the loss)"
            for model, noisy in sorted({(c.model, tuple(c.noisy)) for c in cases if c.noisy})
        ],
    )
    if args.detail:
        for name, plans in jobs.items():
            print()
            print(_detail(name, plans, results[name], cases))
    print(f"\n# total {time.perf_counter() - began:.0f} s")
    report = {
        "rows": [asdict(row) for row in rows],
        "plans": {
            name: [
                _plan_record(plan, results[name][plan_key(plan)], [c for c in cases if c.model == name])
                for plan in plans
            ]
            for name, plans in jobs.items()
        },
        "batch": batch,
        "warmup": warmup,
        "steps": steps,
        "final": final,
        "top": top,
        "memory_source": source,
        "runtime": asdict(runtime),
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return report


def collate(
    jobs: dict[str, list[Plan]], per_rank: Sequence[Sequence[tuple[list[Measured], list[Measured]]]]
) -> dict[str, dict[str, Result]]:
    """Per model, per plan (``plan_key``; the same plan may run for several models): both ranks'
    measurements of it. ``per_rank[r][j]``: rank r's (screening, final) of the j-th model's plans."""
    out: dict[str, dict[str, Result]] = {}
    for j, (model, plans) in enumerate(jobs.items()):
        mine = out.setdefault(model, {})
        for i, plan in enumerate(plans):
            screen = [ranks[j][0][i] for ranks in per_rank]
            again = [ranks[j][1][i] for ranks in per_rank]
            peaks = [
                max((m.peak for m in (a, b) if m.peak is not None), default=None)
                for a, b in zip(screen, again, strict=True)
            ]
            finals = step_times([m.spans for m in again]) if again[0].spans else []
            splits = [(b if b.spans else a).split for a, b in zip(screen, again, strict=True)]
            mine[plan_key(plan)] = Result(step_times([m.spans for m in screen]), finals, peaks, splits)
    return out


def _plan_record(plan: Plan, got: Result, cases: list[Case]) -> dict[str, Any]:
    return {
        "plan": _name(plan),
        "predicted_ms": plan.step_time * 1e3,
        "screen_ms": [t * 1e3 for t in got.screen],
        "final_ms": [t * 1e3 for t in got.final],
        "predicted_peaks": rank_peaks(plan),
        "peaks": got.peaks,
        "memory_stats": got.splits,
        "fits": [
            f"{c.model} {c.limit_name}"
            for c in cases
            if any(plan_key(p) == plan_key(plan) for p in c.fitting)
        ],
    }


def _print(
    rows: list[Row],
    counts: tuple[int, int, int, int, int],
    source: str,
    planned: float,
    runtime: RuntimeCosts,
    notes: list[str],
) -> None:
    batch, warmup, steps, final, top = counts
    print(
        f"# torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, {P} ranks "
        f"(gloo, 1 thread each), batch {batch}; every plan: {warmup} warm-up + {steps} screening rounds, "
        f"then auto, default and each limit's {top} fastest: {final} final rounds (median step)"
    )
    print(
        f"# memory measured: {source or 'no'}; limits: per-rank predicted peak (weights, gradients, "
        "Adam state, buffers, held activations)"
    )
    print(
        f"# runtime (measure_runtime, charged in every prediction): {runtime.action * 1e3:.3f} ms per "
        f"action, {runtime.message * 1e3:.3f} ms per message"
    )
    print(
        f"# planning (runtime measured, 2 profiles per model, every grid plan under both limits, searches) "
        f"{planned:.1f} s; search s: partitioner.auto.search given the profiles\n"
    )
    print(table(rows))
    for note in notes:
        print(note)
    print(
        "\n* the default does not fit the limit (measured anyway); auto/best < 1: the auto plan beat every "
        "grid plan;\n  default/auto > 1: the auto plan is faster than the default; pred/grid: the auto "
        "plan's predicted step over the fastest predicted grid plan that fits (1: the search found it)"
    )


if __name__ == "__main__":
    main()
