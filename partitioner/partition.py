"""``partition``: profile, turn the profile into costs, cut costs and memory rows, solve, and plan.

    # n: layers, p: ranks, v: stages per rank, m: micro-batches, j: stage, i: layer

    model, sample --profile--> per-layer figures --costs(cost)------------> solve --> balance --> Plan
                                               --cut_bytes / bandwidth--^    ^
                                               --layer_memory(schedule)------'

``sample`` is ONE micro-batch: the figures (and so step-time predictions) are per micro-batch.
A cut after layer i costs its stage 2 * cut_bytes[i] / bandwidth seconds: the activation it sends
and the gradient of the same size it receives back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from partitioner.graph import cut_bytes
from partitioner.memory import SCHEDULE_NAMES, in_flight, layer_memory
from partitioner.plan import Plan, StagePlan
from partitioner.profile import LayerProfile, Profile
from partitioner.profile import profile as run_profile
from partitioner.solve import solve, stage_costs, stage_memory
from partitioner.timing import predict

__all__ = ["COSTS", "layer_costs", "partition", "plan_for"]

COSTS: tuple[str, ...] = ("time", "flops", "params", "uniform")


def partition(
    model: nn.Sequential,
    n_stages: int,
    sample: Any,
    *,
    schedule: str = "1f1b",
    n_microbatches: int | None = None,
    cost: str = "time",
    memory_limit: float | None = None,
    bandwidth: float | None = None,
    optimizer_state_factor: float = 2.0,
    profile: Profile | None = None,
    n_virtual: int | None = None,
) -> Plan:
    """The exact best split of ``model`` into ``n_stages`` stages (all stages: p * v when interleaved).

    ``memory_limit`` is bytes per device; with ``"interleaved-1f1b"`` each of a rank's v stages gets
    ``memory_limit / v`` (sufficient for the rank's total). ``n_microbatches`` defaults to the number
    of ranks; ``n_virtual`` to 2 for ``"interleaved-1f1b"`` and 1 otherwise.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"model must be an nn.Sequential, got {type(model).__name__}; wrap the layers in one"
        )
    if len(model) == 0:
        raise ValueError("model is an empty nn.Sequential: there are no layers to split; add layers")
    n = len(model)
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or not 1 <= n_stages <= n:
        raise ValueError(f"n_stages ({n_stages!r}) must be an integer from 1 to the number of layers ({n})")
    v, m = _check_options(schedule, n_stages, n_microbatches, cost, bandwidth, n_virtual, memory_limit)
    if profile is None:
        profile = run_profile(model, sample)
    elif len(profile) != n:
        raise ValueError(f"profile has {len(profile)} layers but the model has {n}; profile this model")
    costs, cuts = layer_costs(profile, cost, bandwidth)
    rows = layer_memory(
        [lp.param_bytes for lp in profile.layers],
        [lp.saved_bytes for lp in profile.layers],
        in_flight(schedule, n_stages, m, n_virtual=v),
        optimizer_state_factor,
    )
    balance = solve(
        costs,
        n_stages,
        cut_costs=cuts,
        memory=rows if memory_limit is not None else None,
        memory_limit=None if memory_limit is None else memory_limit / v,
    )
    return plan_for(
        profile,
        balance,
        schedule=schedule,
        n_microbatches=m,
        cost=cost,
        bandwidth=bandwidth,
        optimizer_state_factor=optimizer_state_factor,
        n_virtual=v,
    )


def layer_costs(
    profile: Profile, cost: str, bandwidth: float | None = None
) -> tuple[list[float], list[float] | None]:
    """Per-layer costs for ``cost`` and, with ``bandwidth``, per-cut costs in seconds."""
    if cost not in COSTS:
        raise ValueError(f"unknown cost {cost!r}; valid costs are {', '.join(COSTS)}")
    costs = [_layer_cost(lp, cost) for lp in profile.layers]
    cuts = None if bandwidth is None else [2.0 * b / bandwidth for b in cut_bytes(profile.graph)]
    return costs, cuts


def _layer_cost(lp: LayerProfile, cost: str) -> float:
    if cost == "time":
        return lp.forward_time + lp.backward_time
    if cost == "flops":
        return float(lp.flops)  # forward flops; backward is about twice that in every layer alike
    if cost == "params":
        return float(lp.param_bytes)
    return 1.0


def plan_for(
    profile: Profile,
    balance: Sequence[int],
    *,
    schedule: str = "1f1b",
    n_microbatches: int | None = None,
    cost: str = "time",
    bandwidth: float | None = None,
    optimizer_state_factor: float = 2.0,
    n_virtual: int | None = None,
) -> Plan:
    """The ``Plan`` (predictions, memory, table) of any ``balance``: ours, equal counts, torchgpipe's."""
    k = len(balance)
    v, m = _check_options(schedule, k, n_microbatches, cost, bandwidth, n_virtual, None)
    costs, cuts = layer_costs(profile, cost, bandwidth)
    per_stage = stage_costs(costs, balance, cut_costs=cuts)
    rows = layer_memory(
        [lp.param_bytes for lp in profile.layers],
        [lp.saved_bytes for lp in profile.layers],
        in_flight(schedule, k, m, n_virtual=v),
        optimizer_state_factor,
    )
    mem = stage_memory(rows, balance)
    sent = cut_bytes(profile.graph)
    stages, start = [], 0
    for j, size in enumerate(balance):
        stop = start + size
        out = sent[stop - 1] if j < k - 1 else 0
        link = 0.0 if bandwidth is None else out / bandwidth
        lps = profile.layers[start:stop]
        stages.append(
            StagePlan(
                start=start,
                stop=stop,
                names=[lp.name for lp in lps],
                forward_time=math.fsum(lp.forward_time for lp in lps) + link,
                backward_time=math.fsum(lp.backward_time for lp in lps) + link,
                cost=per_stage[j],
                memory_bytes=mem[j],
                sent_bytes=out,
            )
        )
        start = stop
    step, bubble, source = predict(
        schedule, [s.forward_time for s in stages], [s.backward_time for s in stages], m, n_virtual=v
    )
    return Plan(
        balance=list(balance),
        stages=stages,
        bottleneck=max(per_stage),
        step_time=step,
        bubble=bubble,
        schedule=schedule,
        n_microbatches=m,
        cost=cost,
        n_virtual=v,
        prediction=source,
    )


def _check_options(
    schedule: str,
    n_stages: int,
    n_microbatches: int | None,
    cost: str,
    bandwidth: float | None,
    n_virtual: int | None,
    memory_limit: float | None,
) -> tuple[int, int]:
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {schedule!r}; valid schedules are {', '.join(SCHEDULE_NAMES)}")
    if cost not in COSTS:
        raise ValueError(f"unknown cost {cost!r}; valid costs are {', '.join(COSTS)}")
    v = n_virtual if n_virtual is not None else (2 if schedule == "interleaved-1f1b" else 1)
    if v < 1 or n_stages % v != 0:
        raise ValueError(
            f"n_stages ({n_stages}) must be a multiple of n_virtual ({v}): n_stages counts all stages, p * v"
        )
    m = n_microbatches if n_microbatches is not None else n_stages // v
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"n_microbatches ({m!r}) must be an integer >= 1")
    if bandwidth is not None:
        if not (math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"bandwidth ({bandwidth!r}) must be a finite number of bytes per second > 0")
        if cost != "time":
            raise ValueError(f"bandwidth turns bytes into seconds and needs cost='time', not cost={cost!r}")
    if memory_limit is not None and not (memory_limit >= 0):
        raise ValueError(f"memory_limit ({memory_limit!r}) must be a number of bytes >= 0")
    return v, m
