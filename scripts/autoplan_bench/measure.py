"""The benchmark's measurements, in the ranks: every plan stepped round-robin in the same processes,
screened, then the finalists again; the runtime's costs first (see ``bench_autoplan``).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from _autoplan_models import Workload, build

from autoplan_bench.plans import Case, plan_key
from partitioner.overhead import RuntimeCosts, measure_runtime
from pipeline.plan import Plan


@dataclass
class Measured:
    """One plan's measurements on one rank: its steps' (start, end) and its peak memory."""

    spans: list[tuple[float, float]] = field(default_factory=list)
    peak: float | None = None  # memory_stats' "peak" of a step measuring every live storage
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
            result.split = {key: v for key, v in stats.items() if isinstance(v, int | float) or v is None}
    for j in chosen:  # one more step each, untimed, measuring every live storage: the true peak
        pipe, params, optimizer = runs[j]
        pipe.step(work.x, work.y, measure_memory=True)
        stats = _stats(pipe, optimizer)
        for param in params:
            param.grad = None
        if stats.get("peak") is not None:
            out[j].peak = max(out[j].peak or 0.0, float(stats["peak"]))
        out[j].source = str(stats.get("source", ""))


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


def _job(name: str, plans: list[Plan], cases: list[Case]) -> Job:
    index = {plan_key(plan): j for j, plan in enumerate(plans)}
    mine = [c for c in cases if c.model == name]
    groups = [[index[plan_key(plan)] for plan in c.fitting] for c in mine]
    always = sorted({index[plan_key(plan)] for c in mine for plan in (c.auto, c.default)})
    return Job(name, [plan.to_json() for plan in plans], groups, always)
