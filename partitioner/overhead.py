"""The runtime's own cost per action and per message, which the profile's layer times lack.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, s: stage

A pipeline step is more than its layers' compute: the executor runs each action (F, B, W) in
Python (autograd set-up, buffers, bookkeeping), and each activation or gradient crossing ranks is a
message whose send and receive cost time at both ends whatever its size (gloo on CPU: a thread
hand-off and, on a loaded machine, a wait to be scheduled). Per micro-batch that is a constant, so
it is what makes many tiny micro-batches slow: interleaved-1F1B with v = 2 and m = 8 on 2 ranks
runs 32 actions and 48 messages per rank where 1F1B with m = 2 runs 4 and 4. The simulator charges
(``stage_extras``), on top of the profiled times and the links' latency and bandwidth::

    F (s, i)      action + message * messages(s)      messages(s) = [s > 0] + [s < k - 1]  (p > 1)
    B (s, i)      action + message * messages(s)      (the input gradient's, or the whole backward)
    W (s, i)      action                              (split-backward schedules: no message)

``measure_runtime`` measures both on the group's ranks with a micro-benchmark: pipelines of tiny
layers (no compute to speak of), 1F1B with m = 1, 2, 4, 8 and interleaved-1F1B (v = 2) with
m = p and 4 p, one row per micro-batch, each step timed on every rank (the slowest rank's time),
the medians fitted by ``fit_runtime``::

    step_j = c0 + action * A_j + message * M_j     (least squares, every figure >= 0)

where A_j and M_j are the simulated steps of configuration j with one second per action
(message 0) and one second per message (action 0): the same simulator the search prices with, so
what was measured is what is charged.

``DEFAULT_RUNTIME``, the search's default when none is given, is this micro-benchmark on the
development machine (2 CPU cores shared with other work at a load average of 5 to 9, gloo,
torch 2.13; ``launch(measure_runtime, 2)`` under ``if __name__ == "__main__":``): fitted to the
fastest step of each configuration it comes to 0.54 ms per action with its message, to the median
steps 1.0 ms per action and 0.54 ms per message (runs differ by 2x). The default takes the
fastest, split evenly: what a quiet machine costs at least. It grows with the machine's load;
pass a measured one (``runtime=``) to ``partition`` when the run's machine differs.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.schedules.schedule import Schedule
from pipeline.schedules.schedule import rank_of as placed
from pipeline.schedules.simulate import simulate

__all__ = ["DEFAULT_RUNTIME", "NO_RUNTIME", "RuntimeCosts", "fit_runtime", "measure_runtime", "stage_extras"]


@dataclass(frozen=True)
class RuntimeCosts:
    """Seconds the runtime adds per compute action (``action``) and per message sent or received
    (``message``) on top of the layers' profiled times (see the module docstring)."""

    action: float = 0.0
    message: float = 0.0

    def __post_init__(self) -> None:
        for name in ("action", "message"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x >= 0):
                raise ValueError(
                    f"RuntimeCosts.{name} ({x!r}) must be finite seconds >= 0 (per "
                    f"{'compute action' if name == 'action' else 'message'}); measure_runtime() measures it"
                )


NO_RUNTIME = RuntimeCosts()
# measure_runtime()'s fastest steps on the development machine (see the module docstring)
DEFAULT_RUNTIME = RuntimeCosts(action=2.7e-4, message=2.7e-4)


def stage_extras(
    k: int, n_ranks: int, runtime: RuntimeCosts, rank_of: Callable[[int], int] | None = None
) -> list[tuple[float, float]]:
    """Per stage: (seconds added to its F and to its B action; the W action adds ``action``);
    ``rank_of``: the schedule's placement (None: stage s on rank s % p), for the neighbours on the
    same rank, which send nothing."""
    where = rank_of if rank_of is not None else functools.partial(placed, "loop", n_ranks)
    out = []
    for s in range(k):
        messages = sum(1 for q in (s - 1, s + 1) if 0 <= q < k and where(q) != where(s))
        each = runtime.action + runtime.message * messages
        out.append((each, each))
    return out


def _basis(sched: Schedule, runtime: RuntimeCosts) -> float:
    """The simulated step of ``sched`` with no compute, only ``runtime``'s costs."""
    extras = stage_extras(sched.n_stages, sched.n_ranks, runtime, sched.rank_of)
    w = runtime.action if sched.split_backward else 0.0
    line = simulate(sched, [f for f, _ in extras], [b for _, b in extras], [w] * sched.n_stages)
    return float(line.makespan)


def fit_runtime(samples: Sequence[tuple[Schedule, float]]) -> RuntimeCosts:
    """The per-action and per-message seconds that best explain measured steps (seconds) of
    no-compute pipelines: least squares of ``step = c0 + action * A + message * M`` (see the module
    docstring), every figure >= 0 (a term that comes out negative is dropped and the rest refitted)."""
    if len(samples) < 3:
        raise ValueError(f"fit_runtime needs at least 3 measured schedules, got {len(samples)}")
    a = np.array([_basis(s, RuntimeCosts(action=1.0)) for s, _ in samples])
    m = np.array([_basis(s, RuntimeCosts(message=1.0)) for s, _ in samples])
    t = np.array([float(x) for _, x in samples])
    columns = {"c0": np.ones_like(t), "action": a, "message": m}
    kept = list(columns)
    while True:
        x, *_ = np.linalg.lstsq(np.stack([columns[c] for c in kept], axis=1), t, rcond=None)
        got = dict(zip(kept, (float(v) for v in x), strict=True))
        negative = [c for c in kept if got[c] < 0]
        if not negative:
            return RuntimeCosts(action=got.get("action", 0.0), message=got.get("message", 0.0))
        kept.remove(min(negative, key=lambda c: got[c]))
        if not kept:
            return NO_RUNTIME


def _configs(p: int) -> list[tuple[str, int, int]]:
    """(schedule, m, v) of the micro-benchmark on p ranks."""
    return [("1f1b", m, 1) for m in (1, 2, 4, 8)] + [("interleaved-1f1b", m, 2) for m in (p, 4 * p)]


def measure_runtime(group: Any = None, *, steps: int = 10, warmup: int = 2) -> RuntimeCosts:
    """``RuntimeCosts`` measured on the ranks of ``group`` (the default group if None; p >= 2): call
    it on every rank (it is collective; every rank returns the same). A few seconds: ``steps``
    timed steps (after ``warmup``) of each of six tiny pipelines, in turns."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from pipeline.plan import Plan
    from pipeline.runtime.pipe import Pipeline

    if not dist.is_initialized():
        raise ValueError("measure_runtime runs on every rank of an initialised process group; call it there")
    p = dist.get_world_size(group)
    if p < 2:
        raise ValueError(f"measure_runtime needs at least 2 ranks (messages cross ranks), got {p}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps ({steps!r}) must be >= 1 and warmup ({warmup!r}) >= 0")
    runs = []
    for name, m, v in _configs(p):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 * p)])
        plan = Plan(balance=[2 // v] * (p * v), schedule=name, n_microbatches=m, n_virtual=v)
        runs.append((Pipeline(model, plan, loss_fn=nn.functional.mse_loss, group=group), plan, m))
    x, y = torch.randn(4 * p, 4), torch.randn(4 * p, 4)
    took = torch.zeros(len(runs), steps, dtype=torch.float64)
    try:
        for i in range(warmup + steps):
            for j, (pipe, _, m) in enumerate(runs):
                dist.barrier(group)
                start = time.perf_counter()
                pipe.step(x[:m], y[:m])
                if i >= warmup:
                    took[j, i - warmup] = time.perf_counter() - start
                for param in pipe.parameters():
                    param.grad = None
    finally:
        for pipe, _, _ in runs:
            pipe.close()
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)  # a step lasts until its slowest rank ends
    samples = [
        (plan.build_schedule(), statistics.median(took[j].tolist())) for j, (_, plan, _) in enumerate(runs)
    ]
    return fit_runtime(samples)
