"""Where a step's host time goes: named functions of the runtime timed in place, each its own time only.

    # a: a compute action (F, B or W) of this rank

``Tally`` replaces functions of the runtime, named "module:Class.method", by wrappers that add
each call's time to the function's category, minus the time of the wrapped calls inside it
(exclusive time), so that categories add up without counting anything twice::

    Pipeline.step  [facade ...  Executor.run [loop .. post [.. host_wait ..] .. forward [...] ..] ..]
                    '-facade-'               '-loop-'  '-post-' '--wait--'      '-compute-'

A wrapper costs time of its own, inside the window it measures and outside it (in its caller's):
``calibrate`` measures both on an empty function and ``per_step`` takes them off each category.
Functions a version of the runtime does not have are skipped (the same table runs on main's code
and on a change's, for a before and after); ``restore`` puts every original back.
"""

from __future__ import annotations

import importlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["CATEGORIES", "Tally"]

# category -> the functions whose own time it is ("module:Class.method")
CATEGORIES: dict[str, tuple[str, ...]] = {
    "header": ("pipeline.runtime.step.describe:Describer.describe",),
    "meter": tuple(
        f"pipeline.runtime.step.memory:ActivationMeter.{name}"
        for name in ("begin_step", "end_step", "hold", "saving", "owned")
    ),
    "clock": tuple(
        f"pipeline.runtime.step.clock:StepClock.{name}"
        for name in ("begin_step", "begin", "input_ready", "end", "posted")
    ),
    "post/take": tuple(
        f"pipeline.runtime.step.executor:Executor.{name}" for name in ("post", "take", "release", "_drain")
    ),
    "loop+hooks": ("pipeline.runtime.step.executor:Executor.run",),
    "data": (
        "pipeline.runtime.step.prepare:Preparer.prepare",
        "pipeline.runtime.step.place:Placer.place",
        "pipeline.runtime.step.place:Placer.start_prefetch",
    ),
    "loss": ("pipeline.runtime.step.steps:StepRunner.finish",),
    "facade": ("pipeline.runtime.pipe:Pipeline.step", "pipeline.runtime.step.steps:StepRunner.train"),
    "backend": (  # the backend's own posting: gloo's send / recv take its pair's lock, and may wait there
        "pipeline.runtime.comm.transport:GlooTransport._post",
        "pipeline.runtime.comm.transport:NcclTransport._post",
    ),
    "compute": tuple(
        f"pipeline.runtime.step.stage:StageRuntime.{name}" for name in ("forward", "backward", "weight")
    ),
    "wait": (
        "pipeline.runtime.comm.transport:Transport.host_wait",
        "pipeline.runtime.comm.transport:Transport.poll",
        "pipeline.runtime.comm.p2p:Comm.wait_key",
        "pipeline.runtime.comm.collectives:Collectives.broadcast",
    ),
}
RUNTIME = ("header", "meter", "clock", "post/take", "loop+hooks", "data", "loss", "facade")  # ours alone


def _resolve(name: str) -> tuple[Any, str] | None:
    """(the class, the attribute) that ``name`` names, if this version of the runtime has it."""
    module_name, _, path = name.partition(":")
    owner_name, _, attr = path.rpartition(".")
    try:
        owner = getattr(importlib.import_module(module_name), owner_name)
    except (ImportError, AttributeError):
        return None
    return (owner, attr) if attr in vars(owner) else None


class Tally:
    """Exclusive host time per category over the calls of the functions in ``categories``."""

    def __init__(
        self,
        categories: dict[str, tuple[str, ...]] = CATEGORIES,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, float] = defaultdict(float)
        self.inner_calls: defaultdict[str, float] = defaultdict(float)  # wrapped calls inside a category's
        self._stack: list[list[float]] = []  # per wrapped call in progress: [inner seconds, inner calls]
        self._saved: list[tuple[Any, str, Any]] = []
        self.cost_in = self.cost_out = 0.0  # a wrapper's own seconds inside / outside its window
        self.missing = [n for names in categories.values() for n in names if _resolve(n) is None]
        for category, names in categories.items():
            for name in names:
                found = _resolve(name)
                if found is not None:
                    owner, attr = found
                    original = vars(owner)[attr]
                    self._saved.append((owner, attr, original))
                    setattr(owner, attr, self.wrap(original, category))

    def wrap(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        stack, seconds, calls, inner_calls, clock = (
            self._stack,
            self.seconds,
            self.calls,
            self.inner_calls,
            self.clock,
        )

        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [0.0, 0]
            stack.append(frame)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                took = clock() - start
                stack.pop()
                seconds[category] += took - frame[0]
                calls[category] += 1
                inner_calls[category] += frame[1]
                if stack:
                    stack[-1][0] += took
                    stack[-1][1] += 1

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def calibrate(self, n: int = 20000) -> None:
        """A wrapper's own cost on an empty function: inside the window it times, and in its caller's."""
        probe = Tally({}, self.clock)
        inner = probe.wrap(lambda: None, "in")

        def outer() -> None:
            for _ in range(n):
                inner()

        probe.wrap(outer, "out")()
        loop = self.clock()
        for _ in range(n):
            (lambda: None)()
        bare = (self.clock() - loop) / n
        self.cost_in = max(probe.seconds["in"] / n - bare, 0.0)
        self.cost_out = max(probe.seconds["out"] / n - bare, 0.0)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.inner_calls.clear()

    def per_step(self, steps: int, categories: Iterable[str] = CATEGORIES) -> dict[str, float]:
        """Seconds per step by category, the wrappers' own cost taken off."""
        out = {}
        for c in categories:
            own = self.seconds[c] - self.calls[c] * self.cost_in - self.inner_calls[c] * self.cost_out
            out[c] = max(own, 0.0) / steps
        return out

    def restore(self) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved = []
