"""What the bench measures, as typed records: per rank and case while running, per row when reported.

    # p: ranks

    RankResult (one per rank)                     Report (rank 0, after every case)
      cases: {key: CaseResult}                      timed: [TimedRow]   workload A's table
        runs: [RunResult]  (as Case.runs)           real:  [RealRow]    workload B's table
          spans, cpu, slept, loss, trace            notes: [str]
        before, after: Calibration

Every record is a dataclass, so ``dataclasses.asdict`` gives the ``--json`` output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "Calibration",
    "CaseResult",
    "Event",
    "RankResult",
    "RealRow",
    "Report",
    "RowBase",
    "RunResult",
    "Slept",
    "TimedRow",
]

Event = tuple[str, float, float]  # one recorded action of ours: (action, start, end), perf_counter seconds


@dataclass
class Slept:
    """Seconds slept by timed layers, by part."""

    F: float = 0.0
    B: float = 0.0
    W: float = 0.0

    @property
    def total(self) -> float:
        return self.F + self.B + self.W

    def add(self, parts: dict[str, float]) -> None:
        self.F += parts["F"]
        self.B += parts["B"]
        self.W += parts["W"]


@dataclass(frozen=True)
class Calibration:
    """This machine's limits at one moment: one-way p2p latency and each nominal sleep's real length."""

    latency: float
    sleep: dict[float, float]  # nominal seconds -> measured seconds


@dataclass
class RunResult:
    """One run on one rank over the measured steps."""

    spans: list[tuple[float, float]] = field(default_factory=list)  # per step: (start, end)
    cpu: float = 0.0  # CPU seconds of this process (all threads): the runtime's own cost
    nominal: Slept = field(default_factory=Slept)  # slept as asked
    real: Slept = field(default_factory=Slept)  # slept as measured
    loss: float | None = None  # the first measured step's loss, where this rank knows it
    trace: list[Event] | None = None  # ours, with tracing: one recorded step


@dataclass
class CaseResult:
    """One case on one rank: its runs (in ``Case.runs`` order) and the machine before and after."""

    runs: list[RunResult]
    before: Calibration
    after: Calibration

    @property
    def latency(self) -> float:
        """The load may drift during a case: both ends, averaged."""
        return (self.before.latency + self.after.latency) / 2

    @property
    def sleep(self) -> dict[float, float]:
        return {t: (d + self.after.sleep[t]) / 2 for t, d in self.before.sleep.items()}


@dataclass
class RankResult:
    rank: int
    world: int
    cases: dict[str, CaseResult] = field(default_factory=dict)


@dataclass(frozen=True)
class RowBase:
    """Ours against one rival on one case; times are medians over the steps, cpu is per rank and step."""

    case: str
    ours: str
    theirs: str
    ours_ms: float
    theirs_ms: float
    ours_over_theirs: float
    cpu_ours_ms: float
    cpu_theirs_ms: float


@dataclass(frozen=True)
class TimedRow(RowBase):
    costs: str  # "F/B/W" ms per stage
    ideal_ms: float
    sim_ms: float  # the simulator with the measured sleeps and latency
    eff_ours: float  # ideal / measured
    eff_theirs: float
    ours_over_sim: float
    work_ours_ms: float  # the busiest rank's slept seconds per step
    work_theirs_ms: float


@dataclass(frozen=True)
class RealRow(RowBase):
    single_ms: float  # the whole batch in one process
    single_mb_ms: float  # the same m micro-batches in one process, accumulated
    speedup_mb_ours: float
    speedup_ours: float
    speedup_theirs: float
    ideal_speedup: float  # p m / (m + p - 1)
    eff_ours: float  # speed-up / ideal
    eff_theirs: float


@dataclass
class Report:
    timed: list[TimedRow] = field(default_factory=list)
    real: list[RealRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
