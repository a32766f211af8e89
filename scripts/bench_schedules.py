"""Schedule efficiency, side by side: our executor against torch.distributed.pipelining.

    python scripts/bench_schedules.py                  # every case, 2-3 minutes on 2 cores
    python scripts/bench_schedules.py --cases coarse,zb --steps 20 --json bench.json
    python scripts/bench_schedules.py --cases fine --trace traces/   # + Chrome traces, overheads
    python scripts/bench_schedules.py --quick          # tiny cases, 2 steps (the smoke test)

Cases: coarse, fine, fine-p8 (GPipe and 1F1B), interleaved, zb (timed layers); mlp, gpt (real).

    # p: ranks, v: virtual stages per rank, m: micro-batches, F / B / W: forward / input-grad / weight-grad

Both runtimes run in the same processes (``pipeline.launch``, gloo, one thread per
rank), on the same model and micro-batches, one step each in turn, so a load spike
hits both. A step's time is from the barrier before it to the last rank's end.

Workload A, timed layers (``_bench_workloads.TimedLayer``): a stage sleeps its
costs, so the ideal step is known exactly and the rest is runtime and
communication overhead. The bench also measures, in the same processes, how long
the layers' sleeps really last and the one-way latency of a small gloo message,
and gives both to ``pipeline.simulate``: its prediction is the best step this
machine allows for the schedule. Efficiency is ideal / measured.

Workload B, real compute: a model split into 2 stages against the same model in
one process with one thread; speed-up against the ideal 2m / (m + 1). The CPU
columns (process time of each rank, all threads, per step) show each runtime's
own cost, which the step times hide when the ranks do not contend for cores.

torch's ``ScheduleInterleavedZeroBubble`` runs in the zb case twice: with one
stage per rank ("interleaved-zb", the order closest to our ZB-H1, same model)
and with v = 2 on the same work per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_workloads import (
    TimedLayer,
    p2p_latency,
    reset_work,
    sleep_duration,
    timed_loss,
    work_done,
)

from pipeline.launch import launch
from pipeline.reference import models
from pipeline.schedules.actions import Kind, parse_action
from pipeline.schedules.schedule import Schedule
from pipeline.schedules.schedule import schedule as make_schedule
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import TimedAction, Timeline

__all__ = ["main"]

_WIDTH = 16  # timed layers' activation width: messages stay small
_MB_ROWS = 2  # rows per micro-batch of the timed workload
_ZB_TORCH = "interleaved-zb"  # torch's ScheduleInterleavedZeroBubble; with v = 1 it is a ZB-H1-like order


# ---- cases


@dataclass(frozen=True)
class Run:
    """One runtime on one workload: ``impl`` is "ours", "torch" or "single" (one process)."""

    impl: str
    schedule: str
    v: int = 1


@dataclass(frozen=True)
class Case:
    """Runs measured in alternation on one workload; ``rows`` pairs ours with each rival."""

    key: str
    workload: str  # "timed", "mlp" or "gpt"
    p: int
    m: int
    costs: tuple[float, float, float] = (0.0, 0.0, 0.0)  # timed: F, B, W seconds per rank and micro-batch
    model: dict[str, int] = field(default_factory=dict)  # real: builder arguments
    runs: tuple[Run, ...] = ()
    rows: tuple[tuple[int, int], ...] = ()  # (index of ours, index of the rival) in runs
    input_grad: bool = True  # timed: stage 0's input requires grad, so stage 0 has an input-grad part too


def _pairs(schedules: tuple[str, ...]) -> tuple[tuple[Run, ...], tuple[tuple[int, int], ...]]:
    runs = tuple(r for s in schedules for r in (Run("ours", s), Run("torch", s)))
    return runs, tuple((2 * k, 2 * k + 1) for k in range(len(schedules)))


def _timed(key: str, p: int, m: int, t_f: float, t_b: float) -> Case:
    runs, rows = _pairs(("gpipe", "1f1b"))
    return Case(key, "timed", p, m, (t_f, t_b, 0.0), runs=runs, rows=rows)


def _special(p: int, m: int, t: float) -> list[Case]:
    """Interleaved 1F1B (v = 2, F = B = W = t per virtual stage) and ZB-H1 on the same work per rank.

    Torch's zero-bubble schedule runs twice: one stage per rank like ours, and interleaved (v = 2).
    """
    inter = Case(
        "interleaved", "timed", p, m, (2 * t, 2 * t, 2 * t),
        runs=(Run("ours", "interleaved-1f1b", 2), Run("torch", "interleaved-1f1b", 2)), rows=((0, 1),),
    )  # fmt: skip
    # Split backward: both runtimes skip stage 0's input gradient when the input needs none (ours
    # always does), so the input needs none here and stage 0's B is free in both; the ideal holds
    # regardless, as the last rank bounds it.
    zb = Case(
        "zb", "timed", p, m, (2 * t, 2 * t, 2 * t),
        runs=(Run("ours", "zb-h1"), Run("torch", _ZB_TORCH), Run("torch", _ZB_TORCH, 2)),
        rows=((0, 1), (0, 2)), input_grad=False,
    )  # fmt: skip
    return [inter, zb]


def _real(key: str, workload: str, p: int, m: int, model: dict[str, int]) -> Case:
    runs, rows = _pairs(("gpipe", "1f1b"))
    runs = (Run("single", "batch"), Run("single", "micro"), *runs)
    return Case(key, workload, p, m, model=model, runs=runs, rows=tuple((a + 2, b + 2) for a, b in rows))


def _cases(quick: bool) -> list[Case]:
    if quick:
        return [
            _timed("coarse", 2, 4, 2e-3, 4e-3),
            *_special(2, 4, 1e-3),
            _real("mlp", "mlp", 2, 4, {"width": 64, "depth": 4, "batch_size": 16}),
            _real("gpt", "gpt", 2, 4, {"width": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 16,
                                       "batch_size": 8}),
        ]  # fmt: skip
    return [
        _timed("coarse", 4, 8, 10e-3, 20e-3),
        _timed("fine", 4, 16, 1e-3, 2e-3),
        _timed("fine-p8", 8, 32, 2e-3, 4e-3),
        *_special(4, 8, 5e-3),
        _real("mlp", "mlp", 2, 8, {"width": 1024, "depth": 8, "batch_size": 128}),
        _real("gpt", "gpt", 2, 8, {"width": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": 64,
                                   "batch_size": 16}),
    ]  # fmt: skip


def _layer_costs(case: Case, run: Run) -> tuple[float, float, float]:
    """A run with v stages per rank gives each stage 1/v of the rank's work."""
    f, b, w = case.costs
    return f / run.v, b / run.v, w / run.v


def _ideal(case: Case, run: Run) -> float:
    """The step with zero overhead, from the nominal costs (the closed forms of the schedules issue)."""
    f, b, w = _layer_costs(case, run)
    p, m, v = case.p, case.m, run.v
    if run.schedule in ("gpipe", "1f1b"):
        return (m + p - 1) * (f + b + w)
    if run.schedule == "interleaved-1f1b":
        return (m * v + p - 1) * (f + b + w)
    if run.schedule == "zb-h1":
        return m * (f + b + w) + (p - 1) * (f + b - w)
    raise ValueError(f"no closed-form ideal for schedule {run.schedule!r}")


# ---- one rank: build every run of a case, then step them in turn


_Workload = tuple[nn.Sequential, list[int], torch.Tensor, torch.Tensor, Callable[..., Any]]


def _model(case: Case, v: int) -> _Workload:
    """The whole model (same seed on every rank), its balance, a batch and the loss."""
    torch.manual_seed(0)
    if case.workload == "timed":
        n_stages = case.p * v
        f, b, w = _layer_costs(case, Run("", "", v))
        model = nn.Sequential(*[TimedLayer(_WIDTH, f, b, w) for _ in range(n_stages)])
        x = torch.randn(case.m * _MB_ROWS, _WIDTH, requires_grad=case.input_grad)
        return model, [1] * n_stages, x, torch.randn(case.m * _MB_ROWS, _WIDTH), timed_loss
    if case.workload == "mlp":
        model, x = models.mlp(**case.model)
        return model, [len(model) // 2, len(model) - len(model) // 2], x, torch.randn_like(x), _mse
    model, x = models.gpt(**case.model)
    cut = (len(model) - 1) // 2  # embedding + half the blocks | the other blocks, norm, head
    return model, [cut, len(model) - cut], x, torch.randint_like(x, 96), models.gpt_loss


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


@dataclass
class _Stepper:
    step: Callable[[], float | None]  # one training step; the loss where this rank knows it
    params: list[nn.Parameter]
    record: Callable[[], list[tuple[str, float, float]]] | None = None  # ours: one step's events


def _record(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> list[tuple[str, float, float]]:
    pipe.step(x, y, record=True)
    return [(str(e.action), e.start, e.end) for e in pipe.timeline().events]


def _ours(case: Case, run: Run) -> _Stepper:
    from pipeline.runtime.pipe import Pipeline

    model, balance, x, y, loss_fn = _model(case, run.v)
    pipe = Pipeline(
        model, balance, schedule=run.schedule, n_microbatches=case.m, loss_fn=loss_fn, n_virtual=run.v
    )
    return _Stepper(lambda: float(pipe.step(x, y)), list(pipe.parameters()), lambda: _record(pipe, x, y))


def _torch(case: Case, run: Run) -> _Stepper:
    from torch.distributed import pipelining as tp

    model, balance, x, y, loss_fn = _model(case, run.v)
    rank, n_stages = dist.get_rank(), len(balance)
    bounds = [sum(balance[:s]) for s in range(n_stages + 1)]
    stages = [
        tp.PipelineStage(model[bounds[s] : bounds[s + 1]], s, n_stages, torch.device("cpu"))
        for s in range(rank, n_stages, case.p)
    ]
    classes: dict[str, Any] = {
        "gpipe": tp.ScheduleGPipe,
        "1f1b": tp.Schedule1F1B,
        "interleaved-1f1b": tp.ScheduleInterleaved1F1B,
        _ZB_TORCH: tp.ScheduleInterleavedZeroBubble,
    }
    multi = run.schedule in ("interleaved-1f1b", _ZB_TORCH)
    sched = classes[run.schedule](stages if multi else stages[0], case.m, loss_fn=loss_fn)
    first, last = rank == 0, rank == (n_stages - 1) % case.p
    args = (x,) if first else ()

    def step() -> float | None:
        losses: list[torch.Tensor] = []
        if last:
            sched.step(*args, target=y, losses=losses)
            return float(torch.stack(losses).detach().mean())
        sched.step(*args)
        return None

    return _Stepper(step, [p for s in stages for p in s.submod.parameters()])


def _single(case: Case, run: Run) -> _Stepper:
    model, _, x, y, loss_fn = _model(case, 1)
    if dist.get_rank() != 0:
        return _Stepper(lambda: None, [])

    def step() -> float:
        loss = loss_fn(model(x), y)
        loss.backward()
        return float(loss.detach())

    def accumulate() -> float:  # the pipeline's micro-batches, one after another
        total = 0.0
        for xs, ys in zip(x.chunk(case.m), y.chunk(case.m), strict=True):
            loss = loss_fn(model(xs), ys) / case.m
            loss.backward()
            total += float(loss.detach())
        return total

    if run.schedule == "micro":
        return _Stepper(accumulate, list(model.parameters()))

    return _Stepper(step, list(model.parameters()))


_BUILDERS = {"ours": _ours, "torch": _torch, "single": _single}


def _calibrate(case: Case) -> dict[str, Any]:
    """This machine's limits now: one-way p2p latency, and how long the case's sleeps really last
    (every rank sleeps at once, as in a step)."""
    durations = sorted({c for run in case.runs for c in _layer_costs(case, run) if c > 0})
    return {
        "latency": p2p_latency((_MB_ROWS, _WIDTH), 100),
        "sleep": {str(t): sleep_duration(t, 10) for t in durations},
    }


def _rank_main(cases: list[Case], steps: int, warmup: int, trace: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": dist.get_rank(), "world": dist.get_world_size(), "cases": {}}
    for case in cases:
        steppers = [_BUILDERS[run.impl](case, run) for run in case.runs]
        before = _calibrate(case)
        times: list[list[tuple[float, float]]] = [[] for _ in steppers]
        cpu = [0.0 for _ in steppers]  # CPU seconds of this process (all threads): the runtime's own cost
        work = [{kind: {"F": 0.0, "B": 0.0, "W": 0.0} for kind in ("nominal", "real")} for _ in steppers]
        losses: list[float | None] = [None] * len(steppers)
        for k in range(warmup + steps):
            order = range(len(steppers)) if k % 2 == 0 else range(len(steppers) - 1, -1, -1)
            for j in order:  # alternate who goes first, so that neither always follows the other
                stepper = steppers[j]
                for param in stepper.params:
                    param.grad = None
                reset_work()
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                loss = stepper.step()
                end, cpu_end = time.perf_counter(), time.process_time()
                if k >= warmup:
                    times[j].append((start, end))
                    cpu[j] += cpu_end - cpu_start
                    for kind, parts in work_done().items():
                        for part, seconds in parts.items():
                            work[j][kind][part] += seconds
                    losses[j] = loss if losses[j] is None else losses[j]
        traces = [st.record() if trace and st.record is not None else None for st in steppers]
        after = _calibrate(case)  # the load may drift during the case: average both ends
        out["cases"][case.key] = {
            "times": times, "cpu": cpu, "work": work, "losses": losses, "calibration": [before, after],
            "trace": traces,
            "latency": (before["latency"] + after["latency"]) / 2,
            "sleep": {t: (d + after["sleep"][t]) / 2 for t, d in before["sleep"].items()},
        }  # fmt: skip
        del steppers
        dist.barrier()
    return out


# ---- report


def _step_times(per_rank: list[dict[str, Any]], key: str, j: int) -> list[float]:
    """A step lasts from the earliest rank's start to the last rank's end (one monotonic clock)."""
    spans = [r["cases"][key]["times"][j] for r in per_rank]
    return [max(s[k][1] for s in spans) - min(s[k][0] for s in spans) for k in range(len(spans[0]))]


def _predict(case: Case, run: Run, per_rank: list[dict[str, Any]]) -> float | None:
    if run.impl != "ours":
        return None
    sched = make_schedule(run.schedule, case.p, case.m, n_virtual=run.v)
    return _simulated(case, run, per_rank, sched).makespan


def _simulated(case: Case, run: Run, per_rank: list[dict[str, Any]], sched: Schedule) -> Timeline:
    """Our simulator's timeline of ``sched`` with this run's measured sleeps and p2p latency."""
    sleep = [r["cases"][case.key]["sleep"] for r in per_rank]  # per rank: nominal -> measured
    costs = _layer_costs(case, run)
    real = [[sleep[s % case.p].get(str(c), 0.0) for s in range(sched.n_stages)] for c in costs]
    if not case.input_grad:
        real[1][0] = 0.0
    return simulate(sched, real[0], real[1], real[2], comm=per_rank[0]["cases"][case.key]["latency"])


def _label(run: Run) -> str:
    name = {"ours": "ours", "torch": "torch", "single": "1 proc"}[run.impl]
    return f"{name} {run.schedule}" + (f" v={run.v}" if run.v > 1 else "")


def _report(cases: list[Case], results: dict[int, list[dict[str, Any]]], steps: int) -> dict[str, Any]:
    rows_a: list[dict[str, Any]] = []
    rows_b: list[dict[str, Any]] = []
    notes: list[str] = []
    for case in cases:
        per_rank = results[case.p]
        med = [statistics.median(_step_times(per_rank, case.key, j)) for j in range(len(case.runs))]
        cpu = [statistics.mean(r["cases"][case.key]["cpu"][j] for r in per_rank) / steps
               for j in range(len(case.runs))]  # fmt: skip
        # the busiest rank's slept seconds per step, as asked: equal when both runtimes do the same work
        work = [max(sum(r["cases"][case.key]["work"][j]["nominal"].values()) for r in per_rank) / steps
                for j in range(len(case.runs))]  # fmt: skip
        for i_ours, i_rival in case.rows:
            ours, rival = case.runs[i_ours], case.runs[i_rival]
            row: dict[str, Any] = {
                "case": f"{case.key} p={case.p} m={case.m}",
                "ours": _label(ours),
                "theirs": _label(rival),
                "ours_ms": med[i_ours] * 1e3,
                "theirs_ms": med[i_rival] * 1e3,
                "ours/theirs": med[i_ours] / med[i_rival],
                "cpu_ours_ms": cpu[i_ours] * 1e3,
                "cpu_theirs_ms": cpu[i_rival] * 1e3,
            }
            if case.workload == "timed":
                ideal = _ideal(case, ours)
                predicted = _predict(case, ours, per_rank)
                row.update(
                    costs="/".join(f"{c * 1e3:g}" for c in _layer_costs(case, ours)),
                    ideal_ms=ideal * 1e3,
                    sim_ms=None if predicted is None else predicted * 1e3,
                    eff_ours=ideal / med[i_ours],
                    eff_theirs=ideal / med[i_rival],
                    **{"ours/sim": None if predicted is None else med[i_ours] / predicted},
                    work_ours_ms=work[i_ours] * 1e3,
                    work_theirs_ms=work[i_rival] * 1e3,
                )
                if abs(work[i_ours] - work[i_rival]) > 1e-6:
                    notes.append(
                        f"{case.key}: slept work per rank differs: {_label(ours)} "
                        f"{work[i_ours] * 1e3:.1f} ms, {_label(rival)} {work[i_rival] * 1e3:.1f} ms per step"
                    )
                rows_a.append(row)
            else:
                single, single_mb = med[0], med[1]
                ideal_speedup = case.p * case.m / (case.m + case.p - 1)
                row.update(
                    single_ms=single * 1e3,
                    single_mb_ms=single_mb * 1e3,
                    speedup_mb_ours=single_mb / med[i_ours],
                    speedup_ours=single / med[i_ours],
                    speedup_theirs=single / med[i_rival],
                    ideal_speedup=ideal_speedup,
                    eff_ours=single / med[i_ours] / ideal_speedup,
                    eff_theirs=single / med[i_rival] / ideal_speedup,
                )
                rows_b.append(row)
            losses = per_rank[-1]["cases"][case.key]["losses"]
            ours_loss, rival_loss = losses[i_ours], losses[i_rival]
            if ours_loss is not None and rival_loss is not None and case.workload != "timed":
                rel = abs(ours_loss - rival_loss) / max(abs(rival_loss), 1e-12)
                if rel > 1e-4:
                    notes.append(
                        f"{case.key}: loss differs: {_label(ours)} {ours_loss}, {_label(rival)} {rival_loss}"
                    )
    return {"timed": rows_a, "real": rows_b, "notes": notes}


# (header, row key, format)
_COLS_A = [
    ("case", "case", "{}"), ("F/B/W ms", "costs", "{}"), ("ours", "ours", "{}"),
    ("theirs", "theirs", "{}"), ("work", "work_ours_ms", "{:.0f}"), ("ideal", "ideal_ms", "{:.1f}"),
    ("sim", "sim_ms", "{:.1f}"),
    ("ours ms", "ours_ms", "{:.1f}"), ("theirs ms", "theirs_ms", "{:.1f}"),
    ("eff ours", "eff_ours", "{:.3f}"), ("eff theirs", "eff_theirs", "{:.3f}"),
    ("ours/theirs", "ours/theirs", "{:.3f}"), ("ours/sim", "ours/sim", "{:.3f}"),
    ("cpu ours", "cpu_ours_ms", "{:.1f}"), ("cpu theirs", "cpu_theirs_ms", "{:.1f}"),
]  # fmt: skip
_COLS_B = [
    ("case", "case", "{}"), ("ours", "ours", "{}"), ("theirs", "theirs", "{}"),
    ("1 proc ms", "single_ms", "{:.1f}"), ("1 proc m ms", "single_mb_ms", "{:.1f}"),
    ("ours ms", "ours_ms", "{:.1f}"),
    ("theirs ms", "theirs_ms", "{:.1f}"), ("ideal x", "ideal_speedup", "{:.3f}"),
    ("ours x", "speedup_ours", "{:.3f}"), ("theirs x", "speedup_theirs", "{:.3f}"),
    ("ours x m", "speedup_mb_ours", "{:.3f}"),
    ("ours/ideal", "eff_ours", "{:.3f}"), ("theirs/ideal", "eff_theirs", "{:.3f}"),
    ("ours/theirs", "ours/theirs", "{:.3f}"),
    ("cpu ours", "cpu_ours_ms", "{:.1f}"), ("cpu theirs", "cpu_theirs_ms", "{:.1f}"),
]  # fmt: skip


def _table(rows: list[dict[str, Any]], cols: list[tuple[str, str, str]]) -> str:
    cells = [[h for h, _, _ in cols]] + [
        ["-" if row.get(k) is None else fmt.format(row[k]) for _, k, fmt in cols] for row in rows
    ]
    widths = [max(len(r[c]) for r in cells) for c in range(len(cols))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _overheads(case: Case, run: Run, events: list[tuple[int, str, float, float]]) -> dict[str, Any]:
    """Where one recorded step of ours went, per rank: compute actions' time beyond their sleeps
    (runtime overhead plus sleep overshoot) and time blocked on receives."""
    nominal = dict(zip("FBW", _layer_costs(case, run), strict=True))
    if run.schedule != "zb-h1":
        nominal["B"] += nominal["W"]
    out: dict[str, Any] = {"over_us": [], "recv_ms": [], "span_ms": []}
    for r in range(case.p):
        mine = [e for e in events if e[0] == r]
        recvs = [(a, b) for _, name, a, b in mine if "RECV" in name]
        over = []
        for _, name, a, b in mine:
            act = parse_action(name)
            if not act.kind.is_compute:
                continue
            waited = sum(min(b, rb) - max(a, ra) for ra, rb in recvs if ra < b and rb > a)
            free = act.stage == 0 and act.kind is Kind.B and not case.input_grad
            cost = 0.0 if free else nominal[act.kind.value]
            over.append(b - a - waited - cost)
        out["over_us"].append(statistics.median(over) * 1e6)
        out["recv_ms"].append(sum(b - a for a, b in recvs) * 1e3)
        out["span_ms"].append((max(e[3] for e in mine) - min(e[2] for e in mine)) * 1e3)
    return out


def _write_traces(cases: list[Case], results: dict[int, list[dict[str, Any]]], folder: str) -> list[str]:
    """Chrome traces of ours, measured next to simulated (measured costs); one summary line per run."""
    from pipeline.schedules.trace import write_chrome_trace

    os.makedirs(folder, exist_ok=True)
    lines = []
    for case in cases:
        per_rank = results[case.p]
        for j, run in enumerate(case.runs):
            if per_rank[0]["cases"][case.key]["trace"][j] is None:
                continue
            events = [(r, *e) for r, res in enumerate(per_rank) for e in res["cases"][case.key]["trace"][j]]
            t0 = min(e[2] for e in events)
            timed = [TimedAction(r, parse_action(a), b - t0, c - t0) for r, a, b, c in events]
            measured = Timeline(timed, case.p)
            name = f"{case.key}-{run.schedule}{f'-v{run.v}' if run.v > 1 else ''}"
            if case.workload == "timed":
                sched = make_schedule(run.schedule, case.p, case.m, n_virtual=run.v)
                simulated = _simulated(case, run, per_rank, sched)
                write_chrome_trace(os.path.join(folder, f"{name}.json"), simulated, measured,
                                   names=["simulated", "measured"])  # fmt: skip
                o = _overheads(case, run, events)
                lines.append(
                    f"{name}: per rank, median compute action beyond its sleep "
                    f"{' '.join(f'{v:.0f}' for v in o['over_us'])} us; blocked on receives "
                    f"{' '.join(f'{v:.1f}' for v in o['recv_ms'])} ms; span "
                    f"{' '.join(f'{v:.1f}' for v in o['span_ms'])} ms "
                    f"(simulated {simulated.makespan * 1e3:.1f})"
                )
            else:
                write_chrome_trace(os.path.join(folder, f"{name}.json"), measured, names=["measured"])
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny cases on 2 ranks, 2 steps (smoke test)")
    parser.add_argument("--cases", default="", help="comma-separated case keys (default: all)")
    parser.add_argument("--steps", type=int, help="measured steps per run (default 10, quick 2)")
    parser.add_argument("--warmup", type=int, help="unmeasured steps first (default 2, quick 1)")
    parser.add_argument("--json", default=None, help="write raw results and the tables to this path")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="after measuring, record one step of ours per run: Chrome traces (measured "
                             "next to simulated) in DIR, and where the time went")  # fmt: skip
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (2 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if steps < 1 or warmup < 0:
        parser.error(f"--steps ({steps}) must be >= 1 and --warmup ({warmup}) >= 0")
    cases = _cases(args.quick)
    if args.cases:
        wanted = args.cases.split(",")
        unknown = sorted(set(wanted) - {c.key for c in cases})
        if unknown:
            parser.error(f"unknown case(s) {unknown}; choose from {[c.key for c in cases]}")
        cases = [c for c in cases if c.key in wanted]

    began = time.perf_counter()
    results: dict[int, list[dict[str, Any]]] = {}
    for p in sorted({c.p for c in cases}):
        mine = [c for c in cases if c.p == p]
        results[p] = launch(_rank_main, p, mine, steps, warmup, args.trace is not None, backend="gloo")
    report = _report(cases, results, steps)
    if args.trace is not None:
        report["notes"] += _write_traces(cases, results, args.trace)

    print(f"# torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"gloo, 1 thread per rank, {steps} steps after {warmup} warm-up, median step")  # fmt: skip
    for case in cases:
        if case.workload == "timed":
            cal = results[case.p][0]["cases"][case.key]
            sleep = ", ".join(f"{float(t) * 1e3:g} -> {d * 1e3:.3f}" for t, d in cal["sleep"].items())
            print(f"# {case.key}: p2p latency {cal['latency'] * 1e6:.0f} us one way; "
                  f"rank 0's sleeps (nominal -> real ms) {sleep}")  # fmt: skip
    if report["timed"]:
        print("\nWorkload A, timed layers (ms; work = the busiest rank's sleeps per step; eff = ideal / "
              "measured;\n  sim = simulator with the measured sleeps and p2p latency; cpu = CPU ms per rank "
              "and step)")
        print(_table(report["timed"], _COLS_A))
    if report["real"]:
        print("\nWorkload B, real compute, 2 stages against one process (x = speed-up over the whole batch"
              " in one process;\n  x m = over the same m micro-batches in one process, accumulating)")
        print(_table(report["real"], _COLS_B))
    for note in report["notes"]:
        print(f"note: {note}")
    print(f"\n# total {time.perf_counter() - began:.0f} s")
    if args.json:
        raw = {"cases": [asdict(c) for c in cases], "steps": steps, "warmup": warmup,
               "results": {str(p): r for p, r in results.items()}, **report}  # fmt: skip
        with open(args.json, "w") as fh:
            json.dump(raw, fh, indent=1)
    return report


if __name__ == "__main__":
    main()
