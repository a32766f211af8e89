"""The benchmark's report: the table's rows from the cases and their measurements, the detail per
plan and the JSON record (see ``bench_autoplan``).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoplan_bench.measure import Result
from autoplan_bench.plans import Case, P, _config_of, plan_key, rank_peaks
from partitioner.overhead import RuntimeCosts
from pipeline.plan import Plan


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
