"""The step's clock: busy time and measured events, from the host on CPU and CUDA events on a GPU.

    # r: this rank, a: an action

A compute action is busy from when its input is there to when it ends; waiting
for a receive is not busy time. On CPU the host runs each action, so host
times measure it. On a GPU the host only queues kernels, so host times would
measure launches: there each compute action gets a start event (recorded again
after the compute stream was ordered after its input) and an end event on the
compute stream, and times are read from the events when asked for, after the
step (``busy``, ``events``):

    compute stream   ..[end F0] (waits for 1RECV_F1) [start F1 ...... end F1]..
                      '-- RECV wait (GPU idle) ----'  '------ busy --------'

The end events also bound the host's run-ahead (``end_event``). A recorded
step's GPU events are placed on the wall clock from an anchor event recorded
right after a device synchronisation at the step's start. Sends appear in the
measured timeline on CPU only (on a GPU, posting one takes no device time).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pipeline.runtime.comm import stream
from pipeline.runtime.comm.stream import AbstractStream, Event
from pipeline.schedules.actions import Action
from pipeline.schedules.timeline import TimedAction

__all__ = ["StepClock"]


class StepClock:
    """Rank ``rank``'s busy time and events of the last step, on ``device`` with ``compute`` as its stream."""

    def __init__(self, device: torch.device, compute: AbstractStream, rank: int) -> None:
        self.cuda = device.type == "cuda"
        self.compute, self.rank = compute, rank
        self.record = False
        self._host_busy = 0.0
        self._host_events: list[TimedAction] = []
        self._offset = 0.0  # wall time minus perf_counter, for timelines comparable across ranks
        self._start = 0.0  # host: when the running compute had its input
        self._start_event: Event = None
        self._recv: Action | None = None  # the receive the running compute waited for
        # GPU: per compute action (action, start, end, the receive it waited for)
        self._marks: list[tuple[Action, Any, Any, Action | None]] = []
        self._anchor: tuple[Any, float] | None = None

    def begin_step(self, record: bool) -> None:
        self.record, self._host_busy, self._host_events, self._marks = record, 0.0, [], []
        self._offset = time.time() - time.perf_counter()
        self._anchor = None
        if self.cuda and record:
            torch.cuda.synchronize()
            self._anchor = (stream.record_event(self.compute, timing=True), time.time())

    def begin(self, waits: bool = False) -> None:
        """A compute action is about to run; ``waits``: it takes a receive first, and its busy time
        starts at ``input_ready`` (no start is taken here, on a GPU no event recorded for nothing)."""
        self._recv = None
        if waits:
            return
        if self.cuda:
            self._start_event = stream.record_event(self.compute, timing=True)
        else:
            self._start = time.perf_counter()

    def input_ready(self, recv: Action, waited_since: float) -> None:
        """The running compute's input ``recv`` is there (host) or ordered before it (GPU)."""
        self._recv = recv
        if self.cuda:
            self._start_event = stream.record_event(self.compute, timing=True)
            return
        self._start = now = time.perf_counter()
        if self.record:
            self._host_events.append(
                TimedAction(self.rank, recv, waited_since + self._offset, now + self._offset)
            )

    def end(self, a: Action) -> Event:
        """Compute action ``a`` ended (was queued, on a GPU); its end event, if any."""
        if self.cuda:
            end = stream.record_event(self.compute, timing=True)
            self._marks.append((a, self._start_event, end, self._recv))
            return end
        now = time.perf_counter()
        self._host_busy += now - self._start
        if self.record:
            self._host_events.append(
                TimedAction(self.rank, a, self._start + self._offset, now + self._offset)
            )
        return None

    def posted(self, sends: list[Action], start: float) -> None:
        """Sends posted from ``start`` until now (host clock; CPU timelines only)."""
        if self.record and not self.cuda:
            end = time.perf_counter()
            self._host_events += [
                TimedAction(self.rank, a, start + self._offset, end + self._offset) for a in sends
            ]

    # ---- read after the step

    @property
    def busy(self) -> float:
        """Seconds in compute actions in the last step (device time on a GPU)."""
        if not self.cuda:
            return self._host_busy
        if not self._marks:
            return 0.0
        self._marks[-1][2].synchronize()
        return float(sum(s.elapsed_time(e) for _, s, e, _ in self._marks)) / 1e3

    @property
    def events(self) -> list[TimedAction]:
        """The last recorded step's events: compute and receive waits (and sends posted, on CPU)."""
        if not self.cuda:
            return self._host_events
        if self._anchor is None or not self._marks:
            return []
        anchor, wall = self._anchor
        self._marks[-1][2].synchronize()

        def at(event: Any) -> float:
            return wall + float(anchor.elapsed_time(event)) / 1e3

        out: list[TimedAction] = []
        prev_end = anchor
        for a, s, e, recv in self._marks:
            if recv is not None:
                out.append(TimedAction(self.rank, recv, at(prev_end), max(at(prev_end), at(s))))
            out.append(TimedAction(self.rank, a, at(s), at(e)))
            prev_end = e
        return out
