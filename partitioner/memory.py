"""Per-stage memory under a schedule: weights, gradients, optimizer state and held activations.

    # p: ranks, v: stages per rank, m: micro-batches, s: stage (s = c * p + r), r: rank, c: chunk

A stage holds, at its peak::

    params * (1 + 1 + optimizer_state_factor)        weights, their gradients, optimizer state
    + saved_bytes * in_flight[s]                     activations of micro-batches whose F has run
                                                     and whose last backward part has not

``in_flight`` comes from the schedule itself when ``pipeline.schedule`` imports: walking a rank's
ordered actions (F adds one to its stage, the last of B/W removes one) gives exact per-stage peaks,
independent of timing since a rank runs its actions one after another. Otherwise closed forms:

    gpipe              m
    1f1b, zb-h1        min(m, p - s)      (zb-h1 really holds more: W runs late; use the schedule)
    interleaved-1f1b   min(m, (v - 1 - c) * p + min(p, 2 * (p - r - 1) + 1))

The interleaved form follows Megatron's warm-up: rank r runs 2 (p - r - 1) + (v - 1) p forwards,
chunk by chunk in groups of p micro-batches, before its first backward (of its last chunk); each
earlier chunk c has (v - 1 - c) more groups in flight. It is an upper bound on the schedule's exact
count (checked against ``pipeline.schedule`` for p <= 6, v <= 4).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SCHEDULE_NAMES", "in_flight", "layer_memory"]

SCHEDULE_NAMES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def in_flight(schedule: str, n_stages: int, n_microbatches: int, *, n_virtual: int = 1) -> list[int]:
    """Peak number of micro-batches whose activations stage s holds, for every stage (p * v)."""
    _check(schedule, n_stages, n_microbatches, n_virtual)
    try:
        from pipeline.schedules.actions import Kind
        from pipeline.schedules.schedule import schedule as build
    except ImportError:
        return _closed_form(schedule, n_stages, n_microbatches, n_virtual)
    sched = build(schedule, n_stages // n_virtual, n_microbatches, n_virtual=n_virtual)
    last = Kind.W if sched.split_backward else Kind.B
    live, peak = [0] * n_stages, [0] * n_stages
    for actions in sched.compute:
        for a in actions:
            if a.kind is Kind.F:
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind is last:
                live[a.stage] -= 1
    return peak


def _closed_form(schedule: str, n_stages: int, m: int, v: int) -> list[int]:
    p = n_stages // v
    if schedule == "gpipe":
        return [m] * n_stages
    if schedule in ("1f1b", "zb-h1"):
        return [min(m, p - s) for s in range(n_stages)]
    return [min(m, (v - 1 - s // p) * p + min(p, 2 * (p - s % p - 1) + 1)) for s in range(n_stages)]


def layer_memory(
    param_bytes: Sequence[int],
    saved_bytes: Sequence[int],
    in_flight_counts: Sequence[int],
    optimizer_state_factor: float,
) -> list[list[float]]:
    """Row s, entry i: bytes layer i costs when it sits on stage s (the rows ``solve`` takes)."""
    if not optimizer_state_factor >= 0:
        raise ValueError(
            f"optimizer_state_factor ({optimizer_state_factor!r}) must be >= 0: bytes of optimizer state "
            "per parameter byte (2.0 for Adam, 1.0 for SGD with momentum, 0.0 for plain SGD)"
        )
    static = [pb * (2.0 + optimizer_state_factor) for pb in param_bytes]
    return [[w + float(sb) * n for w, sb in zip(static, saved_bytes, strict=True)] for n in in_flight_counts]


def _check(schedule: str, n_stages: int, m: int, v: int) -> None:
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {schedule!r}; valid schedules are {', '.join(SCHEDULE_NAMES)}")
    if v < 1 or n_stages % v != 0:
        raise ValueError(f"n_stages ({n_stages}) must be a multiple of n_virtual ({v}) >= 1")
    if schedule == "interleaved-1f1b" and v < 2:
        raise ValueError("schedule 'interleaved-1f1b' needs n_virtual >= 2 stages per rank; pass n_virtual=2")
    if schedule != "interleaved-1f1b" and v != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank; pass n_virtual=1")
    if m < 1:
        raise ValueError(f"n_microbatches ({m}) must be >= 1")
