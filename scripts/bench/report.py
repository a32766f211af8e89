"""From every rank's measurements to the two tables: ours against each rival, per case.

    # p: ranks, m: micro-batches, s: stage

A step lasts from the earliest rank's start to the last rank's end (one
monotonic clock on one machine); a row shows the median step of each runtime.
Workload A (timed) compares with the ideal step and with the simulator fed the
measured sleeps and latency; workload B (real) with the model in one process.
"""

from __future__ import annotations

import statistics

from bench.cases import Case, Run
from bench.results import RankResult, RealRow, Report, RowBase, TimedRow
from pipeline.schedules.schedule import schedule as make_schedule
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import Timeline

__all__ = ["REAL_COLUMNS", "TIMED_COLUMNS", "build_report", "simulated", "step_times", "table"]


def step_times(per_rank: list[RankResult], key: str, j: int) -> list[float]:
    """Run j's step times in case ``key``: from the earliest rank's start to the last rank's end."""
    spans = [r.cases[key].runs[j].spans for r in per_rank]
    return [max(s[k][1] for s in spans) - min(s[k][0] for s in spans) for k in range(len(spans[0]))]


def simulated(case: Case, run: Run, per_rank: list[RankResult]) -> Timeline:
    """Our simulator's timeline of the run's schedule with its measured sleeps and p2p latency."""
    sched = make_schedule(run.schedule, case.p, case.m, n_virtual=run.v)
    sleep = [r.cases[case.key].sleep for r in per_rank]  # per rank: nominal -> measured
    real = [[sleep[s % case.p].get(c, 0.0) for s in range(sched.n_stages)] for c in case.layer_costs(run.v)]
    if not case.input_grad:
        real[1][0] = 0.0  # stage 0 computes no input gradient
    return simulate(sched, real[0], real[1], real[2], comm=per_rank[0].cases[case.key].latency)


def _timed_row(
    case: Case, ours: Run, base: RowBase, step: tuple[float, float], work: tuple[float, float],
    per_rank: list[RankResult],
) -> TimedRow:  # fmt: skip
    """``step``: median seconds of ours and the rival; ``work``: slept seconds per step of each."""
    ideal = case.ideal(ours)
    predicted = simulated(case, ours, per_rank).makespan
    return TimedRow(
        **vars(base),
        costs="/".join(f"{c * 1e3:g}" for c in case.layer_costs(ours.v)),
        ideal_ms=ideal * 1e3,
        sim_ms=predicted * 1e3,
        eff_ours=ideal / step[0],
        eff_theirs=ideal / step[1],
        ours_over_sim=step[0] / predicted,
        work_ours_ms=work[0] * 1e3,
        work_theirs_ms=work[1] * 1e3,
    )


def _real_row(
    case: Case, base: RowBase, step: tuple[float, float], single: float, single_mb: float
) -> RealRow:
    """``step``: median seconds of ours and the rival; ``single`` / ``single_mb``: one process's."""
    ours, theirs = step
    ideal_speedup = case.p * case.m / (case.m + case.p - 1)
    return RealRow(
        **vars(base),
        single_ms=single * 1e3,
        single_mb_ms=single_mb * 1e3,
        speedup_mb_ours=single_mb / ours,
        speedup_ours=single / ours,
        speedup_theirs=single / theirs,
        ideal_speedup=ideal_speedup,
        eff_ours=single / ours / ideal_speedup,
        eff_theirs=single / theirs / ideal_speedup,
    )


def build_report(cases: list[Case], results: dict[int, list[RankResult]], steps: int) -> Report:
    report = Report()
    for case in cases:
        per_rank = results[case.p]
        n = len(case.runs)
        med = [statistics.median(step_times(per_rank, case.key, j)) for j in range(n)]
        cpu = [statistics.mean(r.cases[case.key].runs[j].cpu for r in per_rank) / steps for j in range(n)]
        # the busiest rank's slept seconds per step, as asked: equal when both runtimes do the same work
        work = [max(r.cases[case.key].runs[j].nominal.total for r in per_rank) / steps for j in range(n)]
        for i_ours, i_rival in case.rows:
            ours, rival = case.runs[i_ours], case.runs[i_rival]
            base = RowBase(
                case=case.title,
                ours=ours.label,
                theirs=rival.label,
                ours_ms=med[i_ours] * 1e3,
                theirs_ms=med[i_rival] * 1e3,
                ours_over_theirs=med[i_ours] / med[i_rival],
                cpu_ours_ms=cpu[i_ours] * 1e3,
                cpu_theirs_ms=cpu[i_rival] * 1e3,
            )
            step = (med[i_ours], med[i_rival])
            if case.timed:
                report.timed.append(
                    _timed_row(case, ours, base, step, (work[i_ours], work[i_rival]), per_rank)
                )
                if abs(work[i_ours] - work[i_rival]) > 1e-6:
                    report.notes.append(
                        f"{case.key}: slept work per rank differs: {ours.label} "
                        f"{work[i_ours] * 1e3:.1f} ms, {rival.label} {work[i_rival] * 1e3:.1f} ms per step"
                    )
                continue
            report.real.append(_real_row(case, base, step, med[0], med[1]))
            runs = per_rank[-1].cases[case.key].runs
            ours_loss, rival_loss = runs[i_ours].loss, runs[i_rival].loss
            if ours_loss is not None and rival_loss is not None:
                rel = abs(ours_loss - rival_loss) / max(abs(rival_loss), 1e-12)
                if rel > 1e-4:
                    report.notes.append(
                        f"{case.key}: loss differs: {ours.label} {ours_loss}, {rival.label} {rival_loss}"
                    )
    return report


# (header, row attribute, format)
TIMED_COLUMNS = [
    ("case", "case", "{}"), ("F/B/W ms", "costs", "{}"), ("ours", "ours", "{}"),
    ("theirs", "theirs", "{}"), ("work", "work_ours_ms", "{:.0f}"), ("ideal", "ideal_ms", "{:.1f}"),
    ("sim", "sim_ms", "{:.1f}"),
    ("ours ms", "ours_ms", "{:.1f}"), ("theirs ms", "theirs_ms", "{:.1f}"),
    ("eff ours", "eff_ours", "{:.3f}"), ("eff theirs", "eff_theirs", "{:.3f}"),
    ("ours/theirs", "ours_over_theirs", "{:.3f}"), ("ours/sim", "ours_over_sim", "{:.3f}"),
    ("cpu ours", "cpu_ours_ms", "{:.1f}"), ("cpu theirs", "cpu_theirs_ms", "{:.1f}"),
]  # fmt: skip
REAL_COLUMNS = [
    ("case", "case", "{}"), ("ours", "ours", "{}"), ("theirs", "theirs", "{}"),
    ("1 proc ms", "single_ms", "{:.1f}"), ("1 proc m ms", "single_mb_ms", "{:.1f}"),
    ("ours ms", "ours_ms", "{:.1f}"),
    ("theirs ms", "theirs_ms", "{:.1f}"), ("ideal x", "ideal_speedup", "{:.3f}"),
    ("ours x", "speedup_ours", "{:.3f}"), ("theirs x", "speedup_theirs", "{:.3f}"),
    ("ours x m", "speedup_mb_ours", "{:.3f}"),
    ("ours/ideal", "eff_ours", "{:.3f}"), ("theirs/ideal", "eff_theirs", "{:.3f}"),
    ("ours/theirs", "ours_over_theirs", "{:.3f}"),
    ("cpu ours", "cpu_ours_ms", "{:.1f}"), ("cpu theirs", "cpu_theirs_ms", "{:.1f}"),
]  # fmt: skip


def table(rows: list[TimedRow] | list[RealRow], columns: list[tuple[str, str, str]]) -> str:
    """Left-aligned columns under a rule; a None cell shows as "-"."""
    cells = [[h for h, _, _ in columns]]
    for row in rows:
        values = [getattr(row, attr) for _, attr, _ in columns]
        cells.append(
            ["-" if v is None else fmt.format(v) for v, (_, _, fmt) in zip(values, columns, strict=True)]
        )
    widths = [max(len(r[c]) for r in cells) for c in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
