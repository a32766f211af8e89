"""Timelines: when each action of a step started and ended, simulated or measured.

    # p: ranks, r: rank, s: stage, i: micro-batch

The simulator (simulate.py) predicts one and the executor records one when it
measures a real step; both are the same plain data, so the runtime never needs
the simulator to describe what it measured. A measured timeline's events may
include SEND/RECV actions (posting a send, waiting for a receive), which never
count as busy time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.schedules.actions import Action, Kind

__all__ = ["TimedAction", "TimedReduction", "Timeline"]


@dataclass(frozen=True)
class TimedAction:
    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class TimedReduction:
    """Stage ``stage``'s gradient reduction over the replicas, on rank ``rank``."""

    rank: int
    stage: int
    start: float
    end: float


@dataclass
class Timeline:
    events: list[TimedAction]
    n_ranks: int
    reductions: list[TimedReduction] = field(default_factory=list)
    ends: list[float] = field(
        default_factory=list
    )  # per rank, when its step ended (simulated: its tail's end)

    @property
    def makespan(self) -> float:
        """Wall time from the first start to the step's end: its last event, reduction or collective
        (0 for no events)."""
        if not self.events:
            return 0.0
        last = max([e.end for e in self.events] + [x.end for x in self.reductions] + self.ends)
        return last - min(e.start for e in self.events)

    @property
    def exposed_tail(self) -> float:
        """Seconds the step ran on after its last compute: the reductions (and collectives) the
        computes did not hide (0 without them)."""
        if not self.events:
            return 0.0
        return self.makespan - (max(e.end for e in self.events) - min(e.start for e in self.events))

    @property
    def busy_time(self) -> list[float]:
        """Per rank, the summed duration of its compute actions."""
        busy = [0.0] * self.n_ranks
        for e in self.events:
            if e.action.kind.is_compute:
                busy[e.rank] += e.duration
        return busy

    @property
    def bubble_fraction(self) -> float:
        """Idle share of ranks x makespan, counting only compute as busy."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy_time) / (self.n_ranks * span)

    @property
    def peak_activations(self) -> list[int]:
        """Per rank, the most (stage, micro-batch) pairs whose F has started and whose
        last backward action (W if there is one, else B) has not ended."""
        last_end: dict[tuple[int, int], float] = {}
        has_w = {(e.action.stage, e.action.microbatch) for e in self.events if e.action.kind is Kind.W}
        points: list[list[tuple[float, int]]] = [[] for _ in range(self.n_ranks)]
        for e in self.events:
            key = (e.action.stage, e.action.microbatch)
            if e.action.kind is Kind.F:
                points[e.rank].append((e.start, 1))
            elif (e.action.kind is Kind.W) or (e.action.kind is Kind.B and key not in has_w):
                last_end[key] = e.end
                points[e.rank].append((e.end, -1))
        peaks = []
        for pts in points:
            live = peak = 0
            for _, delta in sorted(pts):  # at equal times, ends (-1) sort before starts (+1)
                live += delta
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def of_rank(self, rank: int) -> list[TimedAction]:
        return sorted((e for e in self.events if e.rank == rank), key=lambda e: (e.start, e.end))
