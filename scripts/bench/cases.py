"""The bench's cases: which runtimes run which schedule on which workload, and each case's ideal step.

    # p: ranks, v: stages per rank, m: micro-batches, F / B / W: forward / input-grad / weight-grad

A ``Case`` is one workload measured under several ``Run``s in alternation; its
``rows`` pair our runtime with each rival, one table row per pair::

    Case "zb"  (timed, p=4, m=8, F/B/W = 10/10/10 ms per rank and micro-batch)
      runs:  0 ours zb-h1 | 1 torch interleaved-zb | 2 torch interleaved-zb v=2
      rows:  (0, 1), (0, 2)

Timed cases give each rank the same work whatever v is: a run with v stages per
rank gives each stage 1/v of it, so the closed-form ideal compares schedules
fairly. Real cases ("mlp", "gpt") also run the model in one process, whole
batch and accumulated micro-batches, as the speed-up's reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["ZB_TORCH", "Case", "Impl", "Run", "Workload", "all_cases"]

Impl = Literal["ours", "torch", "single"]  # single: the whole model in one process
Workload = Literal["timed", "mlp", "gpt"]

ZB_TORCH = "interleaved-zb"  # torch's ScheduleInterleavedZeroBubble; with v = 1 it is a ZB-H1-like order
_LABELS: dict[Impl, str] = {"ours": "ours", "torch": "torch", "single": "1 proc"}


@dataclass(frozen=True)
class Run:
    """One runtime on one workload. For ``single``, ``schedule`` is "batch" or "micro" (accumulated)."""

    impl: Impl
    schedule: str
    v: int = 1

    @property
    def label(self) -> str:
        return f"{_LABELS[self.impl]} {self.schedule}" + (f" v={self.v}" if self.v > 1 else "")

    @property
    def name(self) -> str:
        """For file names: schedule and v."""
        return self.schedule + (f"-v{self.v}" if self.v > 1 else "")


@dataclass(frozen=True)
class Case:
    """Runs measured in alternation on one workload; ``rows`` pairs ours with each rival."""

    key: str
    workload: Workload
    p: int
    m: int
    costs: tuple[float, float, float] = (0.0, 0.0, 0.0)  # timed: F, B, W seconds per rank and micro-batch
    model: dict[str, int] = field(default_factory=dict)  # real: builder arguments
    runs: tuple[Run, ...] = ()
    rows: tuple[tuple[int, int], ...] = ()  # (index of ours, index of the rival) in runs
    input_grad: bool = True  # timed: stage 0's input requires grad, so stage 0 has an input-grad part too

    @property
    def title(self) -> str:
        return f"{self.key} p={self.p} m={self.m}"

    @property
    def timed(self) -> bool:
        return self.workload == "timed"

    def layer_costs(self, v: int) -> tuple[float, float, float]:
        """F, B, W of one stage: a run with v stages per rank gives each stage 1/v of the rank's work."""
        f, b, w = self.costs
        return f / v, b / v, w / v

    def ideal(self, run: Run) -> float:
        """The step with zero overhead, from the nominal costs (the schedules' closed forms)."""
        f, b, w = self.layer_costs(run.v)
        p, m, v = self.p, self.m, run.v
        if run.schedule in ("gpipe", "1f1b"):
            return (m + p - 1) * (f + b + w)
        if run.schedule == "interleaved-1f1b":
            return (m * v + p - 1) * (f + b + w)
        if run.schedule == "zb-h1":
            return m * (f + b + w) + (p - 1) * (f + b - w)
        raise ValueError(f"no closed-form ideal for schedule {run.schedule!r}")


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
        runs=(Run("ours", "zb-h1"), Run("torch", ZB_TORCH), Run("torch", ZB_TORCH, 2)),
        rows=((0, 1), (0, 2)), input_grad=False,
    )  # fmt: skip
    return [inter, zb]


def _real(key: str, workload: Workload, p: int, m: int, model: dict[str, int]) -> Case:
    runs, rows = _pairs(("gpipe", "1f1b"))
    runs = (Run("single", "batch"), Run("single", "micro"), *runs)
    return Case(key, workload, p, m, model=model, runs=runs, rows=tuple((a + 2, b + 2) for a, b in rows))


def all_cases(quick: bool) -> list[Case]:
    """Every case, in table order; ``quick``: tiny ones on 2 ranks (the smoke test)."""
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
