"""``partition``: profile, turn the profile into costs, cut costs and memory rows, solve, and plan.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, n: layers, s: stage, l: layer

    model, sample --profile--> per-layer figures --layer_costs(cost, recompute, split B/W)--> solve --> Plan
                               (autocast, loss)   --cut_rows(latency, bandwidth per link)------^  ^
    schedule(name, p, m, v) --in_flight--> held(recompute) --layer_memory------------------------'

The count is the pipeline's ranks, p; each holds v stages, so the balance has k = p * v entries and
stage s runs on rank s % p. The schedule is built once, from the same options the returned ``Plan``
carries, and both the memory model and the step-time prediction read that ``Schedule``. What a
layer and a cut cost is ``partitioner.costs``'s; the memory model ``partitioner.memory``'s.

``sample`` is ONE micro-batch: the figures (and so step-time predictions) are per micro-batch.
Per rank r: ``speeds[r]`` divides its stages' compute time (a rank twice as fast: 2.0), and
``memory_limit`` (one number for every rank, or one per rank) is split evenly among its v stages.
A recomputing stage also keeps its inputs, charged at the largest input any cut can have.

Before any search, the limits are checked by one O(k n) numpy pass (``partitioner._fit``);
when nothing fits, the error states the smallest ``memory_limit`` (or factor) that would.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from partitioner._options import Options, check_fit
from partitioner.costs import (
    COSTS,
    backward_time,
    cut_groups,
    cut_problems,
    cut_rows,
    layer_costs,
    recomputed_share,
    transfer,
    with_loss,
)
from partitioner.figures import LayerProfile, Profile
from partitioner.graph import cut_bytes
from partitioner.graph_profile import profile_graph
from partitioner.memory import held, in_flight, layer_memory
from partitioner.profile import LossFn, check_autocast, check_model
from partitioner.profile import profile as run_profile
from partitioner.shared import shared_across_ranks
from partitioner.solve import solve, stage_costs, stage_memory
from partitioner.timing import predict
from pipeline.plan import Plan, StagePlan
from pipeline.runtime.tracing import Traced, trace
from pipeline.schedules.schedule import Schedule, schedule_options

__all__ = ["COSTS", "layer_costs", "partition", "plan_for"]  # COSTS, layer_costs: costs.py's


@shared_across_ranks
def partition(
    model: nn.Module,
    n_ranks: int,
    sample: Any,
    *,
    schedule: str = "1f1b",
    n_microbatches: int | None = None,
    n_virtual: int | None = None,
    recompute: str = "never",
    dp: int = 1,
    cost: str = "time",
    memory_limit: float | Sequence[float] | None = None,
    speeds: Sequence[float] | None = None,
    bandwidth: float | Sequence[float] | None = None,
    latency: float | Sequence[float] | None = None,
    optimizer_state_factor: float = 2.0,
    autocast: torch.dtype | None = None,
    loss_fn: LossFn | None = None,
    target: Any = None,
    device: torch.device | str | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    profile: Profile | None = None,
) -> Plan:
    """The exact best split of ``model`` over ``n_ranks`` ranks, each holding ``n_virtual`` stages.

    ``n_microbatches`` (m) defaults to the number of ranks and ``n_virtual`` (v) to 2 for
    "interleaved-1f1b" and 1 otherwise (see ``schedule_options``). ``memory_limit``: bytes per
    rank; ``speeds``: one per rank; ``bandwidth`` (bytes/s) and ``latency`` (s): one number or one
    per link (see ``partitioner.costs``; ``partitioner.links.measure_links`` measures them).
    ``autocast``, ``loss_fn`` / ``target``, ``device`` and ``init_fn`` go to ``profile`` (see
    there) unless a ``profile`` is given. ``dp``: pipeline replicas, recorded in the plan (the
    split is one pipeline's: every replica runs the same, on its own share of the batch, so
    ``sample`` is one micro-batch of one replica). Every argument is checked before the model is
    profiled. Called on every rank of an initialised process group, it runs on rank 0 and every
    rank returns rank 0's plan (see ``partitioner.shared``).

    ``model`` is an ``nn.Sequential`` (its children are the layers) or any module that
    ``torch.export`` (or else ``torch.fx.symbolic_trace``) can trace with ``sample``: its layers
    are then groups of its traced calls (one per transformer block), a cut costs every tensor
    live across it, and the plan records in ``extra`` the ``cuts`` (the layer each stage after
    the first begins with) and the trace (``graph``), which ``Pipeline`` checks against the
    model. Parameters that layers of several stages hold (tied weights) are in ``extra["ties"]``
    (name -> stages).
    """
    v, m = schedule_options(schedule, n_ranks, n_microbatches, n_virtual)
    k = n_ranks * v
    check_autocast(autocast)
    shape = Plan(
        balance=[1] * k, schedule=schedule, n_microbatches=m, n_virtual=v, recompute=recompute, dp=dp
    )
    net = Options.make(cost, n_ranks, v, speeds, bandwidth, latency, memory_limit, optimizer_state_factor)
    check_model(model)
    traced = None
    if isinstance(model, nn.Sequential):
        n = len(model)
    elif profile is not None:
        n = len(profile)
    else:
        traced = trace(model, sample)
        n = len(traced.layers)
    if k > n:
        fix = f"use at most {n // v} ranks" + (" or fewer stages per rank (n_virtual)" if v > 1 else "")
        what = "layers" if traced is None else f"layers (groups of its traced calls: {_names(traced)})"
        raise ValueError(
            f"n_ranks ({n_ranks}) x n_virtual ({v}) is {k} stages but the model has {n} {what}, "
            f"and every stage needs at least one; {fix}"
        )
    if profile is None:
        options: dict[str, Any] = {"device": device, "autocast": autocast, "loss_fn": loss_fn}
        options.update(target=target, init_fn=init_fn)
        if traced is None:
            profile = run_profile(model, sample, **options)
        else:
            profile = profile_graph(traced, sample, **options)
    else:
        _check_given_profile(profile, n, autocast, loss_fn)
    sched = shape.build_schedule()
    sizes, reasons = cut_groups(profile.layers, profile.cut_reasons)
    if k > len(sizes):
        raise ValueError(
            f"n_ranks ({n_ranks}) x n_virtual ({v}) is {k} stages but the model can be cut in only "
            f"{len(sizes) - 1} places ({'; '.join(reasons)}); use at most {len(sizes) // v} ranks"
        )
    split = sched.split_backward
    costs = layer_costs(profile, cost, recompute=recompute, n_microbatches=m, split_backward=split)
    cuts = cut_rows(profile, k, n_ranks, net.latency, net.bandwidth)
    rows, inputs = _memory(profile, sched, recompute, optimizer_state_factor)
    limits, grouped = None, None
    if net.memory_limit is not None:
        grouped = [_grouped(row, sizes) for row in rows]
        limits = check_fit(net, grouped, inputs, _largest_input(profile), recompute, k, v)
    balance = _expand(
        solve(
            _grouped(costs, sizes),
            k,
            cut_costs=None if cuts is None else [_grouped_cut(row, sizes) for row in cuts],
            memory=None if limits is None else grouped,
            memory_limit=limits,
            speeds=net.stage_speeds(k),
        ),
        sizes,
    )
    return _predicted(profile, shape.replace(balance=balance), sched, net)


def plan_for(
    profile: Profile,
    balance: Sequence[int],
    *,
    schedule: str = "1f1b",
    n_microbatches: int | None = None,
    n_virtual: int | None = None,
    recompute: str = "never",
    dp: int = 1,
    cost: str = "time",
    speeds: Sequence[float] | None = None,
    bandwidth: float | Sequence[float] | None = None,
    latency: float | Sequence[float] | None = None,
    optimizer_state_factor: float = 2.0,
) -> Plan:
    """The ``Plan`` of any ``balance`` (k = p * v layer counts), with the predictions ``partition``
    makes: ours, equal counts, torchgpipe's. The options default as in ``partition``. A balance
    with a boundary where the model cannot be cut is planned, and ``extra["problems"]`` says why
    no pipeline can run it. ``dp``: pipeline replicas, recorded in the plan."""
    given: Any = balance  # Plan names what is wrong with it
    shape = Plan(balance=given, schedule=schedule, n_virtual=n_virtual or 0, recompute=recompute, dp=dp)
    v, m = schedule_options(schedule, shape.n_ranks, n_microbatches, n_virtual)  # the given m and v
    shape = shape.replace(n_microbatches=m, n_virtual=v)
    net = Options.make(cost, shape.n_ranks, v, speeds, bandwidth, latency, None, optimizer_state_factor)
    if shape.n_layers != len(profile):
        raise ValueError(
            f"balance {shape.balance} covers {shape.n_layers} layers but the profile has {len(profile)}; "
            "the layer counts must add up to the model's layers"
        )
    return _predicted(profile, shape, shape.build_schedule(), net)


def _check_given_profile(profile: Profile, n: int, autocast: torch.dtype | None, loss_fn: Any) -> None:
    if len(profile) != n:
        raise ValueError(f"profile has {len(profile)} layers but the model has {n}; profile this model")
    wanted = None if autocast is None else str(autocast).removeprefix("torch.")
    if autocast is not None and profile.autocast != wanted:
        raise ValueError(
            f"autocast={wanted} but the profile ran under {profile.autocast or 'fp32 (no autocast)'}; "
            "profile again with the run's autocast, or pass the profile's"
        )
    if loss_fn is not None and profile.loss is None:
        raise ValueError(
            "loss_fn is given but the profile has no loss figures; profile(..., loss_fn=..., target=...) "
            "or leave loss_fn out"
        )


def _grouped(values: Sequence[float], sizes: list[int]) -> list[float]:
    """Per group of layers that no cut splits: the members' sum."""
    if len(sizes) == len(values):
        return list(values)
    out, start = [], 0
    for size in sizes:
        out.append(math.fsum(values[start : start + size]))
        start += size
    return out


def _grouped_cut(row: Sequence[float], sizes: list[int]) -> list[float]:
    """Per group: the cut after its last layer."""
    if len(sizes) == len(row):
        return list(row)
    ends = itertools.accumulate(sizes)
    return [row[end - 1] for end in ends]


def _expand(group_balance: list[int], sizes: list[int]) -> list[int]:
    out, g = [], 0
    for count in group_balance:
        out.append(sum(sizes[g : g + count]))
        g += count
    return out


def _predicted(profile: Profile, shape: Plan, sched: Schedule, net: Options) -> Plan:
    """``shape`` (balance and options, already checked) with the predictions of its balance."""
    balance, k, m, p = shape.balance, shape.n_stages, shape.n_microbatches, shape.n_ranks
    split = sched.split_backward
    layers = with_loss(profile)
    costs = layer_costs(profile, net.cost, recompute=shape.recompute, n_microbatches=m, split_backward=split)
    cuts = cut_rows(profile, k, p, net.latency, net.bandwidth)
    speeds = net.stage_speeds(k) or [1.0] * k
    per_stage = stage_costs(costs, balance, cut_costs=cuts, speeds=net.stage_speeds(k))
    rows, inputs = _memory(profile, sched, shape.recompute, net.optimizer_state_factor)
    mem = stage_memory(rows, balance)
    sent = cut_bytes(profile.graph)
    rho = recomputed_share(shape.recompute, m)
    stages, start = [], 0
    for s, size in enumerate(balance):
        stop = start + size
        out = sent[stop - 1] if s < k - 1 else 0
        link = transfer(out, s, p, net.latency, net.bandwidth) if s < k - 1 else 0.0  # each way
        if s > 0:
            link += transfer(sent[start - 1], s - 1, p, net.latency, net.bandwidth)
        stage_input = profile.input_bytes if start == 0 else sent[start - 1]
        lps = layers[start:stop]
        forward = math.fsum(lp.forward_time for lp in lps) / speeds[s]
        backward = math.fsum(backward_time(lp, split) for lp in lps) / speeds[s]
        weight = math.fsum(lp.weight_time for lp in lps) / speeds[s]
        if not split:  # the weight share of the whole backward (W and B were timed apart from it)
            parts = math.fsum(backward_time(lp, True) for lp in lps) / speeds[s]
            weight = backward * (weight / parts) if parts > 0 else 0.0
        stages.append(
            StagePlan(
                start=start,
                stop=stop,
                names=[lp.name for lp in lps],
                forward_time=forward + link,
                backward_time=backward + rho * forward + link,
                cost=per_stage[s],
                memory_bytes=mem[s] + float(stage_input * inputs[s]),
                sent_bytes=out,
                weight_time=min(weight, backward),
            )
        )
        start = stop
    step, bubble = predict(
        sched,
        [st.forward_time for st in stages],
        [st.backward_time for st in stages],
        [st.weight_time for st in stages],
    )
    extra: dict[str, Any] = {"autocast": profile.autocast, "loss": profile.loss is not None}
    problems = cut_problems(profile.layers, balance, profile.cut_reasons)
    if problems:
        extra["problems"] = problems
    if profile.traced is not None:  # what Pipeline checks the model against, and where it cuts
        extra["graph"] = dict(profile.traced, layers=[lp.name for lp in profile.layers])
        extra["cuts"] = [st.names[0] for st in stages[1:]]
    ties = _ties(profile.layers, balance)
    if ties:
        extra["ties"] = ties
    return shape.replace(
        stages=stages,
        bottleneck=max(per_stage),
        step_time=step,
        bubble=bubble,
        cost=net.cost,
        prediction="simulator",
        extra=extra,
    )


def _memory(
    profile: Profile, sched: Schedule, recompute: str, optimizer_state_factor: float
) -> tuple[list[list[float]], list[int]]:
    """The memory rows ``solve`` takes (row s: what each layer costs on stage s) and, per stage,
    how many stage inputs it keeps on top (recomputation), both from the schedule's in-flight peaks."""
    sets, inputs = held(recompute, sched.n_microbatches, in_flight(sched))
    layers = with_loss(profile)
    rows = layer_memory(
        [lp.param_bytes for lp in layers],
        [lp.saved_bytes for lp in layers],
        sets,
        optimizer_state_factor,
        buffer_bytes=[lp.buffer_bytes for lp in layers],
        cache_bytes=[lp.cache_bytes for lp in layers],
    )
    return rows, inputs


def _ties(layers: list[LayerProfile], balance: list[int]) -> dict[str, list[int]]:
    """Parameter name -> the stages holding it, for those more than one stage holds."""
    held: dict[str, list[int]] = {}
    start = 0
    for s, size in enumerate(balance):
        for lp in layers[start : start + size]:
            for name in lp.params:
                stages = held.setdefault(name, [])
                if not stages or stages[-1] != s:
                    stages.append(s)
        start += size
    return {name: stages for name, stages in held.items() if len(stages) > 1}


def _names(traced: Traced) -> str:
    names = [layer.name for layer in traced.layers]
    return ", ".join(names) if len(names) <= 12 else ", ".join(names[:12]) + ", ..."


def _largest_input(profile: Profile) -> int:
    """The most bytes any stage's input can be: the sample, or what crosses any cut."""
    return max([profile.input_bytes, *cut_bytes(profile.graph)])
