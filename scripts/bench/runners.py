"""Run the cases: on every rank, build each run of a case, then step them in turn and time them.

    # p: ranks, v: stages per rank, m: micro-batches, s: stage

Both runtimes run in the same processes (``pipeline.launch``, gloo, one thread
per rank), on the same model and micro-batches, one step each in turn, so a
load spike hits both. A step's time is from the barrier before it to the last
rank's end; who goes first alternates from step to step::

    step k (even):  barrier | run 0 | barrier | run 1 | ... | barrier | run n-1
    step k+1:       barrier | run n-1 | ... | barrier | run 0

Before and after each case every rank measures this machine's limits (one-way
p2p latency, how long the case's sleeps really last), for the simulator.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.cases import ZB_TORCH, Case, Run
from bench.results import Calibration, CaseResult, Event, RankResult, RunResult
from bench.workloads import (
    MB_ROWS,
    WIDTH,
    TimedLayer,
    p2p_latency,
    reset_work,
    sleep_duration,
    timed_loss,
    work_done,
)
from pipeline.launch import launch
from pipeline.plan import Plan
from pipeline.reference import models

__all__ = ["run_cases"]

_LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Workload:
    """The whole model (same seed on every rank), its balance, one batch and the loss."""

    model: nn.Sequential
    balance: list[int]
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: _LossFn


def _workload(case: Case, v: int) -> _Workload:
    torch.manual_seed(0)
    if case.workload == "timed":
        n_stages = case.p * v
        f, b, w = case.layer_costs(v)
        model = nn.Sequential(*[TimedLayer(WIDTH, f, b, w) for _ in range(n_stages)])
        x = torch.randn(case.m * MB_ROWS, WIDTH, requires_grad=case.input_grad)
        return _Workload(model, [1] * n_stages, x, torch.randn(case.m * MB_ROWS, WIDTH), timed_loss)
    if case.workload == "mlp":
        model, x = models.mlp(**case.model)
        return _Workload(model, _even(len(model), case.p * v), x, torch.randn_like(x), _mse)
    model, x = models.gpt(**case.model)
    balance = _even(len(model), case.p * v)  # 2 stages: embedding + half the blocks | the rest, norm, head
    return _Workload(model, balance, x, torch.randint_like(x, 96), models.gpt_loss)


def _even(n: int, k: int) -> list[int]:
    """``n`` layers over ``k`` stages as evenly as possible, the last stages one more each."""
    return [n // k + (1 if s >= k - n % k else 0) for s in range(k)]


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


@dataclass
class _Stepper:
    step: Callable[[], float | None]  # one training step; the loss where this rank knows it
    params: list[nn.Parameter]
    record: Callable[[], list[Event]] | None = None  # ours: one step's events


def _ours(case: Case, run: Run) -> _Stepper:
    from pipeline.runtime.pipe import Pipeline

    w = _workload(case, run.v)
    plan = Plan(balance=w.balance, schedule=run.schedule, n_microbatches=case.m, n_virtual=run.v)
    pipe = Pipeline(w.model, plan, loss_fn=w.loss_fn)

    def record() -> list[Event]:
        pipe.step(w.x, w.y, record=True)
        return [(str(e.action), e.start, e.end) for e in pipe.timeline().events]

    return _Stepper(lambda: float(pipe.step(w.x, w.y)), list(pipe.parameters()), record)


def _torch(case: Case, run: Run) -> _Stepper:
    from torch.distributed import pipelining as tp

    w = _workload(case, run.v)
    rank, n_stages = dist.get_rank(), len(w.balance)
    bounds = [sum(w.balance[:s]) for s in range(n_stages + 1)]
    stages = [
        tp.PipelineStage(w.model[bounds[s] : bounds[s + 1]], s, n_stages, torch.device("cpu"))
        for s in range(rank, n_stages, case.p)
    ]
    classes: dict[str, Any] = {
        "gpipe": tp.ScheduleGPipe,
        "1f1b": tp.Schedule1F1B,
        "interleaved-1f1b": tp.ScheduleInterleaved1F1B,
        ZB_TORCH: tp.ScheduleInterleavedZeroBubble,
    }
    multi = run.schedule in ("interleaved-1f1b", ZB_TORCH)
    sched = classes[run.schedule](stages if multi else stages[0], case.m, loss_fn=w.loss_fn)
    first, last = rank == 0, rank == (n_stages - 1) % case.p
    args = (w.x,) if first else ()

    def step() -> float | None:
        losses: list[torch.Tensor] = []
        if last:
            sched.step(*args, target=w.y, losses=losses)
            return float(torch.stack(losses).detach().mean())
        sched.step(*args)
        return None

    return _Stepper(step, [p for s in stages for p in s.submod.parameters()])


def _single(case: Case, run: Run) -> _Stepper:
    w = _workload(case, 1)
    if dist.get_rank() != 0:
        return _Stepper(lambda: None, [])

    def whole() -> float:
        loss = w.loss_fn(w.model(w.x), w.y)
        torch.autograd.backward(loss)
        return float(loss.detach())

    def accumulate() -> float:  # the pipeline's micro-batches, one after another
        total = 0.0
        for xs, ys in zip(w.x.chunk(case.m), w.y.chunk(case.m), strict=True):
            loss = w.loss_fn(w.model(xs), ys) / case.m
            torch.autograd.backward(loss)
            total += float(loss.detach())
        return total

    return _Stepper(accumulate if run.schedule == "micro" else whole, list(w.model.parameters()))


_BUILDERS: dict[str, Callable[[Case, Run], _Stepper]] = {"ours": _ours, "torch": _torch, "single": _single}


def _calibrate(case: Case) -> Calibration:
    """This machine's limits now: one-way p2p latency, and how long the case's sleeps really last
    (every rank sleeps at once, as in a step)."""
    durations = sorted({c for run in case.runs for c in case.layer_costs(run.v) if c > 0})
    return Calibration(
        latency=p2p_latency((MB_ROWS, WIDTH), 100), sleep={t: sleep_duration(t, 10) for t in durations}
    )


def _measure(case: Case, steps: int, warmup: int, trace: bool) -> CaseResult:
    steppers = [_BUILDERS[run.impl](case, run) for run in case.runs]
    before = _calibrate(case)
    results = [RunResult() for _ in steppers]
    for k in range(warmup + steps):
        order = range(len(steppers)) if k % 2 == 0 else range(len(steppers) - 1, -1, -1)
        for j in order:  # alternate who goes first, so that neither always follows the other
            stepper, result = steppers[j], results[j]
            for param in stepper.params:
                param.grad = None
            reset_work()
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = stepper.step()
            end, cpu_end = time.perf_counter(), time.process_time()
            if k < warmup:
                continue
            result.spans.append((start, end))
            result.cpu += cpu_end - cpu_start
            slept = work_done()
            result.nominal.add(slept["nominal"])
            result.real.add(slept["real"])
            if result.loss is None:
                result.loss = loss
    if trace:
        for stepper, result in zip(steppers, results, strict=True):
            result.trace = stepper.record() if stepper.record is not None else None
    after = _calibrate(case)
    del steppers
    dist.barrier()
    return CaseResult(results, before, after)


def _rank_main(cases: list[Case], steps: int, warmup: int, trace: bool) -> RankResult:
    out = RankResult(dist.get_rank(), dist.get_world_size())
    for case in cases:
        out.cases[case.key] = _measure(case, steps, warmup, trace)
    return out


def run_cases(cases: list[Case], steps: int, warmup: int, trace: bool) -> dict[int, list[RankResult]]:
    """Every case, its ranks started per rank count p: {p: [rank 0's result, rank 1's, ...]}."""
    results: dict[int, list[RankResult]] = {}
    for p in sorted({c.p for c in cases}):
        mine = [c for c in cases if c.p == p]
        results[p] = launch(_rank_main, p, mine, steps, warmup, trace, backend="gloo")
    return results
