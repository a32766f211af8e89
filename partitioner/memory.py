"""Per-stage memory under a schedule: weights, gradients, optimizer state and held activations.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, s: stage, l: layer

A stage holds, at its peak::

    params * (1 + 1 + optimizer_state_factor)        weights, their gradients, optimizer state
    + buffers + cache                                buffers; autocast's low-precision weight
                                                     copies, made once and shared by every
                                                     micro-batch of the step
    + saved_bytes * sets[s]                          activation sets autograd keeps
    + input_bytes(s) * inputs[s]                     stage inputs a recomputing stage keeps

``in_flight`` walks the schedule itself: on each rank the actions run one after another,
so counting F (one more micro-batch held by its stage) and the last backward part (B, or
W when the schedule splits the backward: one fewer) gives each stage's exact peak, whatever
the timing. ``held`` turns that peak N into what a stage keeps under a recomputation mode::

    recompute      sets    inputs
    never          N       0          every in-flight micro-batch keeps its activations
    always         1       N          inputs only, plus the one being recomputed for its backward
    except_last    2       N          the last micro-batch keeps its activations (N >= 2; m >= 2)
                   1       1          (N = 1: the one held is the last, or one being recomputed)

``except_last`` with m = 1 recomputes nothing and counts as ``never``. Both recomputing rows
are upper bounds: they charge every held micro-batch its input besides the activation sets.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.runtime.recompute import check_mode
from pipeline.schedules.actions import Kind
from pipeline.schedules.schedule import Schedule

__all__ = ["held", "in_flight", "layer_memory"]


def in_flight(sched: Schedule) -> list[int]:
    """Peak number of micro-batches whose activations stage s holds, for every stage (k = p * v)."""
    last = Kind.W if sched.split_backward else Kind.B
    live, peak = [0] * sched.n_stages, [0] * sched.n_stages
    for actions in sched.compute:
        for a in actions:
            if a.kind is Kind.F:
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind is last:
                live[a.stage] -= 1
    return peak


def held(recompute: str, n_microbatches: int, in_flight_counts: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per stage, (activation sets, stage inputs) kept at the peak under ``recompute``; see above."""
    check_mode(recompute)
    if recompute == "never" or (recompute == "except_last" and n_microbatches < 2):
        return list(in_flight_counts), [0] * len(in_flight_counts)
    most = 1 if recompute == "always" else 2
    return [min(most, n) for n in in_flight_counts], list(in_flight_counts)


def layer_memory(
    param_bytes: Sequence[int],
    saved_bytes: Sequence[int],
    sets: Sequence[int],
    optimizer_state_factor: float,
    *,
    buffer_bytes: Sequence[int] | None = None,
    cache_bytes: Sequence[int] | None = None,
) -> list[list[float]]:
    """Row s, entry l: bytes layer l costs when it sits on stage s, which keeps ``sets[s]``
    activation sets (the rows ``solve`` takes; a recomputing stage's inputs come on top)."""
    if not optimizer_state_factor >= 0:
        raise ValueError(
            f"optimizer_state_factor ({optimizer_state_factor!r}) must be >= 0: bytes of optimizer state "
            "per parameter byte (2.0 for Adam, 1.0 for SGD with momentum, 0.0 for plain SGD)"
        )
    zeros = [0] * len(param_bytes)
    static = np.asarray(param_bytes, np.float64) * (2.0 + optimizer_state_factor)
    for once in (buffer_bytes, cache_bytes):
        static = static + np.asarray(once or zeros, np.float64)
    saved = np.asarray(saved_bytes, np.float64)
    if saved.shape != static.shape:
        raise ValueError(f"saved_bytes has {len(saved)} entries, param_bytes {len(static)}; one per layer")
    rows: dict[int, list[float]] = {n: (static + saved * float(n)).tolist() for n in set(sets)}
    return [rows[n] for n in sets]
