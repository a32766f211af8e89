"""``partition``: profile, turn the profile into costs, cut costs and memory rows, solve, and plan.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, n: layers, s: stage, l: layer

    model, sample --profile--> per-layer figures --costs(cost, recompute)---> solve --> balance --> Plan
                                               --cut_bytes / bandwidth-----^    ^
    schedule(name, p, m, v) --in_flight--> held(recompute) --layer_memory-------'

The count is the pipeline's ranks, p; each holds v stages, so the balance has k = p * v entries and
stage s runs on rank s % p. The schedule is built once, from the same options the returned ``Plan``
carries, and both the memory model and the step-time prediction read that ``Schedule``.

``sample`` is ONE micro-batch: the figures (and so step-time predictions) are per micro-batch.
A cut after layer l costs its stage 2 * cut_bytes[l] / bandwidth seconds: the activation it sends
and the gradient of the same size it receives back. A recomputed micro-batch runs its forward
again before its backward: with ``cost="time"`` each layer costs f + b + rho * f, rho being the
share of micro-batches that recompute (1 for "always", (m - 1) / m for "except_last").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from partitioner.graph import cut_bytes
from partitioner.memory import held, in_flight, layer_memory
from partitioner.profile import LayerProfile, Profile
from partitioner.profile import profile as run_profile
from partitioner.solve import solve, stage_costs, stage_memory
from partitioner.timing import predict
from pipeline.plan import Plan, StagePlan
from pipeline.schedules.schedule import Schedule, schedule_options

__all__ = ["COSTS", "layer_costs", "partition", "plan_for"]

COSTS: tuple[str, ...] = ("time", "flops", "params", "uniform")


def partition(
    model: nn.Sequential,
    n_ranks: int,
    sample: Any,
    *,
    schedule: str = "1f1b",
    n_microbatches: int | None = None,
    n_virtual: int | None = None,
    recompute: str = "never",
    cost: str = "time",
    memory_limit: float | None = None,
    bandwidth: float | None = None,
    optimizer_state_factor: float = 2.0,
    profile: Profile | None = None,
) -> Plan:
    """The exact best split of ``model`` over ``n_ranks`` ranks, each holding ``n_virtual`` stages.

    ``n_microbatches`` (m) defaults to the number of ranks and ``n_virtual`` (v) to 2 for
    "interleaved-1f1b" and 1 otherwise (see ``schedule_options``). ``memory_limit`` is bytes per
    rank; each of a rank's v stages gets ``memory_limit / v`` (enough for the rank's total).
    Every argument is checked before the model is profiled.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"model must be an nn.Sequential, got {type(model).__name__}; wrap the layers in one"
        )
    n = len(model)
    if n == 0:
        raise ValueError("model is an empty nn.Sequential: there are no layers to split; add layers")
    v, m = schedule_options(schedule, n_ranks, n_microbatches, n_virtual)
    k = n_ranks * v
    if k > n:
        fix = f"use at most {n // v} ranks" + (" or fewer stages per rank (n_virtual)" if v > 1 else "")
        raise ValueError(
            f"n_ranks ({n_ranks}) x n_virtual ({v}) is {k} stages but the model has {n} layers, "
            f"and every stage needs at least one; {fix}"
        )
    _check_options(cost, bandwidth, memory_limit, optimizer_state_factor)
    shape = Plan(balance=[1] * k, schedule=schedule, n_microbatches=m, n_virtual=v, recompute=recompute)
    sched = shape.build_schedule()
    if profile is None:
        profile = run_profile(model, sample)
    elif len(profile) != n:
        raise ValueError(f"profile has {len(profile)} layers but the model has {n}; profile this model")
    costs, cuts = layer_costs(profile, cost, bandwidth, recompute=recompute, n_microbatches=m)
    rows, inputs = _memory(profile, sched, recompute, optimizer_state_factor)
    limit: float | list[float] | None = None
    if memory_limit is not None:
        limit = memory_limit / v  # the rank's share for each of its stages
        if any(inputs):  # a recomputing stage keeps its inputs besides what its layers cost
            limit = _stage_limits(memory_limit, v, inputs, _largest_input(profile), recompute)
    try:
        balance = solve(costs, k, cut_costs=cuts, memory=None if limit is None else rows, memory_limit=limit)
    except ValueError as err:
        if memory_limit is None or not any(inputs):
            raise
        raise ValueError(_recompute_message(memory_limit, k, recompute, max(inputs))) from err
    return _predicted(profile, shape.replace(balance=balance), sched, cost, bandwidth, optimizer_state_factor)


def plan_for(
    profile: Profile,
    balance: Sequence[int],
    *,
    schedule: str = "1f1b",
    n_microbatches: int | None = None,
    n_virtual: int | None = None,
    recompute: str = "never",
    cost: str = "time",
    bandwidth: float | None = None,
    optimizer_state_factor: float = 2.0,
) -> Plan:
    """The ``Plan`` of any ``balance`` (k = p * v layer counts), with the predictions ``partition``
    makes: ours, equal counts, torchgpipe's. The options default as in ``partition``."""
    _check_options(cost, bandwidth, None, optimizer_state_factor)
    given: Any = balance  # Plan names what is wrong with it
    shape = Plan(balance=given, schedule=schedule, n_virtual=n_virtual or 0, recompute=recompute)
    v, m = schedule_options(schedule, shape.n_ranks, n_microbatches, n_virtual)  # the given m and v
    shape = shape.replace(n_microbatches=m, n_virtual=v)
    if shape.n_layers != len(profile):
        raise ValueError(
            f"balance {shape.balance} covers {shape.n_layers} layers but the profile has {len(profile)}; "
            "the layer counts must add up to the model's layers"
        )
    return _predicted(profile, shape, shape.build_schedule(), cost, bandwidth, optimizer_state_factor)


def layer_costs(
    profile: Profile,
    cost: str,
    bandwidth: float | None = None,
    *,
    recompute: str = "never",
    n_microbatches: int = 1,
) -> tuple[list[float], list[float] | None]:
    """Per-layer costs for ``cost`` and, with ``bandwidth``, per-cut costs in seconds."""
    if cost not in COSTS:
        raise ValueError(f"unknown cost {cost!r}; valid costs are {', '.join(COSTS)}")
    rho = _recomputed_share(recompute, n_microbatches)
    costs = [_layer_cost(lp, cost, rho) for lp in profile.layers]
    cuts = None if bandwidth is None else [2.0 * b / bandwidth for b in cut_bytes(profile.graph)]
    return costs, cuts


def _layer_cost(lp: LayerProfile, cost: str, rho: float) -> float:
    if cost == "time":
        return lp.forward_time + lp.backward_time + rho * lp.forward_time
    if cost == "flops":
        return float(lp.flops)  # forward flops; backward is about twice that in every layer alike
    if cost == "params":
        return float(lp.param_bytes)
    return 1.0


def _recomputed_share(recompute: str, m: int) -> float:
    """rho: the share of micro-batches whose forward runs twice."""
    if recompute == "always":
        return 1.0
    if recompute == "except_last":
        return (m - 1) / m
    return 0.0


def _predicted(
    profile: Profile,
    shape: Plan,
    sched: Schedule,
    cost: str,
    bandwidth: float | None,
    optimizer_state_factor: float,
) -> Plan:
    """``shape`` (balance and options, already checked) with the predictions of its balance."""
    balance, k, m = shape.balance, shape.n_stages, shape.n_microbatches
    costs, cuts = layer_costs(profile, cost, bandwidth, recompute=shape.recompute, n_microbatches=m)
    per_stage = stage_costs(costs, balance, cut_costs=cuts)
    rows, inputs = _memory(profile, sched, shape.recompute, optimizer_state_factor)
    mem = stage_memory(rows, balance)
    sent = cut_bytes(profile.graph)
    rho = _recomputed_share(shape.recompute, m)
    stages, start = [], 0
    for s, size in enumerate(balance):
        stop = start + size
        out = sent[stop - 1] if s < k - 1 else 0
        link = 0.0 if bandwidth is None else out / bandwidth  # activation out, its gradient back
        stage_input = profile.input_bytes if start == 0 else sent[start - 1]
        lps = profile.layers[start:stop]
        forward = math.fsum(lp.forward_time for lp in lps)
        stages.append(
            StagePlan(
                start=start,
                stop=stop,
                names=[lp.name for lp in lps],
                forward_time=forward + link,
                backward_time=math.fsum(lp.backward_time for lp in lps) + rho * forward + link,
                cost=per_stage[s],
                memory_bytes=mem[s] + float(stage_input * inputs[s]),
                sent_bytes=out,
                weight_time=math.fsum(lp.weight_time for lp in lps),
            )
        )
        start = stop
    step, bubble = predict(
        sched,
        [st.forward_time for st in stages],
        [st.backward_time for st in stages],
        [st.weight_time for st in stages],
    )
    return shape.replace(
        stages=stages,
        bottleneck=max(per_stage),
        step_time=step,
        bubble=bubble,
        cost=cost,
        prediction="simulator",
    )


def _memory(
    profile: Profile, sched: Schedule, recompute: str, optimizer_state_factor: float
) -> tuple[list[list[float]], list[int]]:
    """The memory rows ``solve`` takes (row s: what each layer costs on stage s) and, per stage,
    how many stage inputs it keeps on top (recomputation), both from the schedule's in-flight peaks."""
    sets, inputs = held(recompute, sched.n_microbatches, in_flight(sched))
    rows = layer_memory(
        [lp.param_bytes for lp in profile.layers],
        [lp.saved_bytes for lp in profile.layers],
        sets,
        optimizer_state_factor,
    )
    return rows, inputs


def _largest_input(profile: Profile) -> int:
    """The most bytes any stage's input can be: the sample, or what crosses any cut."""
    return max([profile.input_bytes, *cut_bytes(profile.graph)])


def _stage_limits(
    memory_limit: float, v: int, inputs: list[int], largest_input: int, recompute: str
) -> list[float]:
    """Per stage, the bytes its layers may take: the rank's share, less what a recomputing stage
    keeps of its inputs (charged at the largest input, so the balance fits whatever its cuts)."""
    limits = [memory_limit / v - float(largest_input * held_inputs) for held_inputs in inputs]
    if min(limits) < 0:
        raise ValueError(_recompute_message(memory_limit, len(limits), recompute, max(inputs)))
    return limits


def _recompute_message(memory_limit: float, k: int, recompute: str, most_inputs: int) -> str:
    return (
        f"memory_limit ({memory_limit:g}) is too small: no split into {k} stages fits it with "
        f"recompute={recompute!r}, where a stage keeps up to {most_inputs} stage inputs (each counted "
        "at the largest input any cut can have) besides its layers; raise memory_limit or use more ranks"
    )


def _check_options(
    cost: str, bandwidth: float | None, memory_limit: float | None, optimizer_state_factor: float
) -> None:
    """The partitioner's own options; the schedule's are checked by ``schedule_options``."""
    if cost not in COSTS:
        raise ValueError(f"unknown cost {cost!r}; valid costs are {', '.join(COSTS)}")
    if bandwidth is not None:
        if isinstance(bandwidth, bool) or not (math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"bandwidth ({bandwidth!r}) must be a finite number of bytes per second > 0")
        if cost != "time":
            raise ValueError(f"bandwidth turns bytes into seconds and needs cost='time', not cost={cost!r}")
    if memory_limit is not None and (isinstance(memory_limit, bool) or not memory_limit >= 0):
        raise ValueError(f"memory_limit ({memory_limit!r}) must be a number of bytes >= 0")
    if isinstance(optimizer_state_factor, bool) or not optimizer_state_factor >= 0:
        raise ValueError(
            f"optimizer_state_factor ({optimizer_state_factor!r}) must be >= 0: bytes of optimizer state "
            "per parameter byte (2.0 for Adam, 1.0 for SGD with momentum, 0.0 for plain SGD)"
        )
