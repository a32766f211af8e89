"""``partition``: profile, turn the profile into costs, cut costs and memory rows, solve, and plan.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, n: layers, s: stage, l: layer

    model, sample --profile--> per-layer figures --layer_costs(cost, recompute, split B/W)--> solve --> Plan
                               (autocast, loss)   --cut_rows(latency, bandwidth per link)------^  ^
    schedule(name, p, m, v) --coefficients(recompute): the walk, unit bytes--> memory_rows -------'

The count is the pipeline's ranks, p; each holds v stages, so the balance has k = p * v entries and
stage s runs on rank rank_of(s) (s % p; the V for zb-v). The schedule is built once, from the
same options the returned ``Plan`` carries, and both the memory model and the step-time prediction
read that ``Schedule``. What a layer and a cut cost is ``partitioner.costs``'s; the memory model
``partitioner.memory``'s.

``sample`` is ONE micro-batch: the figures (and so step-time predictions) are per micro-batch.
Per rank r: ``speeds[r]`` divides its stages' compute time (a rank twice as fast: 2.0), and
``memory_limit`` (one number for every rank, or one per rank) is split evenly among its v stages,
less what the device holds beyond the tensors the plan counts and the headroom kept free
(``plan.device_memory``, measured by the profile: ``partitioner.device_memory``; nothing on CPU).
The rows bound the schedule walked rank by rank (``partitioner.memory``): every plan returned
under ``memory_limit`` has each rank's walked peak (``plan.rank_peaks``, what
``pipe.memory_stats()`` measures) within its usable bytes (``plan.usable_limits()``); the plan
records the limit (``plan.memory_limit``), which a variable-length run's steps are held to as
well. A stage's input and output buffers are charged at the largest activation any cut can carry.

Before the schedule is built, a limit below what the layers' static bytes alone need (weights,
gradients, optimizer state, buffers) is refused naming that floor (``partitioner._floors``: no walk,
milliseconds). Before any search, the limits are checked by one O(k n) numpy pass
(``partitioner._fit``); when nothing fits, the error states the smallest ``memory_limit`` (or
factor) that would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from partitioner._balance import balance_of
from partitioner._floors import refuse_below_static
from partitioner._options import Options
from partitioner._planning import predicted
from partitioner._trees import tree_map
from partitioner.auto import _microbatch_counts, check_search, search
from partitioner.composition import check_composition, check_tensor_parallel, tensor_parallel
from partitioner.costs import COSTS, cut_groups, layer_costs
from partitioner.figures import Profile
from partitioner.graph_profile import profile_graph
from partitioner.overhead import RuntimeCosts
from partitioner.profile import LossFn, check_autocast, check_model
from partitioner.profile import profile as run_profile
from partitioner.scaling import batch_rows, second_rows
from partitioner.shared import shared_across_ranks
from pipeline.plan import Plan
from pipeline.runtime.step.recompute import Recompute
from pipeline.runtime.trace.tracing import Traced, trace
from pipeline.schedules.registry import entry
from pipeline.schedules.schedule import schedule_options, unchecked

# COSTS, layer_costs: costs.py's
__all__ = ["COSTS", "check_balance_layers", "check_stage_count", "layer_costs", "partition", "plan_for"]


def _check_weights_fit(
    model: nn.Module,
    n_ranks: int,
    memory_limit: float | Sequence[float] | None,
    shard: int | str,
    tp: int | str,
    world_size: int | None,
) -> None:
    """Refuse at once, before any profiling, a ``memory_limit`` that cannot hold the model's parameters
    alone: a pipeline's ranks hold every parameter at least once between them, each divided by at
    most shard x tp (sharded at rest, split by tp), so the limits of one pipeline must add up to at
    least P / (shard x tp) (with "auto", the largest shard x tp the world allows). A bound that never
    refuses a plan that fits; the search prices everything else, and names a malformed limit."""
    if memory_limit is None or isinstance(n_ranks, bool) or not isinstance(n_ranks, int) or n_ranks < 1:
        return
    if isinstance(memory_limit, str | bytes) or not isinstance(memory_limit, int | float | Sequence):
        return
    limits = [memory_limit] * n_ranks if isinstance(memory_limit, int | float) else list(memory_limit)
    if not limits or not all(
        isinstance(x, int | float) and not isinstance(x, bool) and 0 < x < math.inf for x in limits
    ):
        return
    seen: set[int] = set()
    weights = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            weights += param.numel() * param.element_size()
    split = (world_size // n_ranks if world_size else 1) if "auto" in (shard, tp) else 1
    if split == 1:
        split = (shard if isinstance(shard, int) else 1) * (tp if isinstance(tp, int) else 1)
    if sum(limits) * split >= weights:
        return
    per = f"{limits[0]:.4g} bytes per rank" if len(set(limits)) == 1 else f"{sum(limits):.4g} bytes in all"
    raise ValueError(
        f"memory_limit ({memory_limit!r}) is too small for every configuration: the weights alone are "
        f"{weights:.4g} bytes, at most divided by shard x tp = {split}, so the pipeline's {n_ranks} ranks "
        f"need {weights / split:.4g} bytes between them before any gradient, optimizer state or "
        f"activation (it gives {per}); raise memory_limit, use more ranks (n_ranks), or shard the stages "
        "(shard=, or shard='auto' with world_size=). Checked before profiling"
    )


@shared_across_ranks
def partition(
    model: nn.Module,
    n_ranks: int,
    sample: Any,
    *,
    schedule: str = "1f1b",
    n_microbatches: int | str | None = None,
    n_virtual: int | None = None,
    recompute: Recompute = "never",
    dp: int = 1,
    shard: int | str = 1,
    tp: int | str = 1,
    zero: int = 2,
    world_size: int | None = None,
    cost: str = "time",
    memory_limit: float | Sequence[float] | None = None,
    batch_size: int | None = None,
    speeds: Sequence[float] | None = None,
    bandwidth: float | Sequence[float] | None = None,
    latency: float | Sequence[float] | None = None,
    optimizer_state_factor: float = 2.0,
    runtime: RuntimeCosts | None = None,
    memory_headroom: float | None = None,
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
    rank, of which the device's workspaces, its allocator's rounding and ``memory_headroom`` (the
    share kept free; None: the device's default, 10 % on CUDA and 0 on CPU) are reserved
    (``partitioner.device_memory``); ``recompute``: one mode, or a tuple of one per stage
    (k = p * v; the balance is then solved with each stage priced and sized by its own mode);
    ``speeds``: one per rank; ``bandwidth`` (bytes/s) and ``latency`` (s): one number or one per link (see
    ``partitioner.costs``; ``partitioner.links.measure_links`` measures them). ``runtime``: the
    runtime's own seconds per action and per message that the predicted step charges
    (``partitioner.overhead``; ``measure_runtime`` measures them on the run's ranks). None: none
    for one schedule and m (they add the same to every balance, which they never change), and
    ``DEFAULT_RUNTIME`` for the auto search, whose m and v change how many actions run.
    ``autocast``, ``loss_fn`` / ``target``, ``device`` and ``init_fn`` go to ``profile`` (see
    there) unless a ``profile`` is given. ``dp``: pipeline replicas, recorded in the plan (the
    split is one pipeline's: every replica runs the same, on its own share of the batch, so
    ``sample`` is one micro-batch of one replica). Every argument is checked before the model is
    profiled. Called on every rank of an initialised process group, it runs on rank 0 and every
    rank returns rank 0's plan (see ``partitioner.shared``).

    ``shard``, ``tp``, ``zero``: FSDP parts per stage, tensor-parallel ranks per stage and the ZeRO
    stage, recorded in the plan; every rank's memory and the step's time are then one rank's of
    that composition (``partitioner.composition``: parameters, gradients and optimizer state
    sharded, Linear weights and their layers' compute split over tp, the collectives costed over
    the links' ``bandwidth`` and ``latency``). Tensor parallelism needs an ``nn.Sequential`` whose
    layers hold ``nn.Linear`` weights (what a parallelize_fn splits).

    ``model`` is an ``nn.Sequential`` (its children are the layers) or any module that
    ``torch.export`` (or else ``torch.fx.symbolic_trace``) can trace with ``sample``: its layers
    are then groups of its traced calls (one per transformer block; grouped for the p x v stages,
    p for the auto search, so that a module holding more than a balanced stage's share of the
    calls, an encoder, is split into its children: ``pipeline.runtime.trace.layers``; a given
    ``profile`` keeps its own grouping), a cut costs every tensor live across it,
    and the plan records its ``cuts`` (the layer each stage after the first begins with) and the
    trace (``graph``), which ``Pipeline`` checks against the model. Every stage holds a parameter
    (``partitioner.costs.cut_groups``): a layer without one stays with a neighbour.
    Parameters that layers of several stages hold (tied weights) are in ``plan.ties``
    (name -> stages).

    ``schedule="auto"`` and/or ``n_microbatches="auto"`` search the schedule (all, or the one
    named), m (the divisors of ``batch_size``, the rows of one step; default: the sample's rows),
    v (interleaved-1f1b: every v the layers allow, unless ``n_virtual`` is given) and recomputation
    per stage, with the exact balance of each, and return the fastest predicted plan whose every
    rank fits ``memory_limit`` (``recompute`` is then searched, not given). ``sample`` may then
    have any rows: the profile is scaled to each micro-batch (``partitioner.scaling``). The plan's
    ``candidates`` lists the runners-up; see ``partitioner.auto``.

    ``world_size`` (with the auto search): every rank of the run, dp x shard x n_ranks x tp.
    ``shard="auto"`` and/or ``tp="auto"`` then search those sizes (each a divisor of
    world_size / n_ranks; an integer pins it), dp being what is left: dp = world_size /
    (n_ranks x shard x tp) (so ``dp`` is not given). Each (dp, shard, tp) gets the whole search
    above (``batch_size``: one pipeline's rows, as ever), and the answer is the plan of the most
    rows per second over the world, dp x shard x batch_size / step_time (data parallelism is
    taken as free; sharding costs its collectives, tensor parallelism its all-reduces); the others
    that fit are its ``candidates``' peers, not listed. When no (dp, shard, tp) fits, the error
    names each one's smallest limit.
    """
    check_composition(shard, tp, zero, world_size)
    if profile is None:  # a given profile's layers are what the search prices
        _check_weights_fit(model, n_ranks, memory_limit, shard, tp, world_size)
    if schedule == "auto" or n_microbatches == "auto":
        return _auto(model, n_ranks, sample, schedule, n_microbatches, n_virtual, recompute, dp, cost,
                     memory_limit, batch_size, speeds, bandwidth, latency, optimizer_state_factor, runtime,
                     memory_headroom,
                     dict(autocast=autocast, loss_fn=loss_fn, target=target, device=device, init_fn=init_fn),
                     profile, (shard, tp, zero, world_size))  # fmt: skip
    if world_size is not None:
        raise ValueError(
            f"world_size ({world_size!r}) is for the auto search of shard and tp (schedule='auto'); "
            "without it, omit world_size (the plan's world is dp x shard x n_ranks x tp)"
        )
    assert isinstance(shard, int) and isinstance(tp, int)  # check_composition refused "auto" without a world
    if batch_size is not None:
        raise ValueError(
            "batch_size is for the auto search (schedule='auto' or n_microbatches='auto'); without it, "
            "sample is one micro-batch: omit batch_size"
        )
    if isinstance(n_microbatches, str):
        raise ValueError(f"n_microbatches ({n_microbatches!r}) must be an integer >= 1, or 'auto'")
    v, m = schedule_options(schedule, n_ranks, n_microbatches, n_virtual)
    k = n_ranks * v
    check_autocast(autocast)
    shape = Plan(balance=[1] * k, schedule=schedule, n_microbatches=m, n_virtual=v, recompute=recompute,
                 dp=dp, shard=shard, tp=tp, zero=zero)  # fmt: skip
    net = Options.make(
        cost,
        n_ranks,
        v,
        speeds,
        bandwidth,
        latency,
        memory_limit,
        optimizer_state_factor,
        runtime,
        entry(schedule).placement,
        memory_headroom,
    ).composed(shard, tp, zero, bandwidth, latency, dp)
    check_model(model)
    check_tensor_parallel(model, profile, tp)
    profile = _profiled(model, n_ranks, v, sample, profile, autocast, loss_fn, target, device, init_fn)
    check_tensor_parallel(model, profile, tp)
    profile = tensor_parallel(profile, net.composition)  # one tp rank's compute: the costs and times
    net.measured(profile.device_memory)
    sizes, reasons = cut_groups(profile.layers, profile.cut_reasons)
    if k > len(sizes):
        raise ValueError(
            f"n_ranks ({n_ranks}) x n_virtual ({v}) is {k} stages but the model can be cut in only "
            f"{len(sizes) - 1} places ({'; '.join(reasons)}); use at most {len(sizes) // v} ranks"
        )
    refuse_below_static(profile, net, k, sizes)  # before the schedule and its walk: milliseconds
    sched = unchecked(schedule, n_ranks, m, v)  # validated below, once a plan fits: a refusal is quick
    plan = predicted(profile, balance_of(profile, shape, sched, net, sizes), sched, net)
    _check_walk(plan, net)
    plan.build_schedule()  # the generator's order, validated (cached per shape for the run)
    return plan


def _check_walk(plan: Plan, net: Options) -> None:
    """Never return a plan a run would not fit in: the rows the solver fits bound the walk, so this
    cannot fail unless the memory model has a bug (then say so rather than plan an out-of-memory)."""
    if net.memory_limit is None:
        return
    over = [
        f"rank {r}: {peak:g} > {usable:g}"
        for r, (peak, usable) in enumerate(zip(plan.rank_peaks, plan.usable_limits(), strict=True))
        if peak > usable
    ]
    if over:
        raise RuntimeError(
            f"partitioner bug: balance {plan.balance} fits the solver's memory rows but not the schedule "
            f"walked rank by rank ({'; '.join(over)}); the rows must bound the walk (partitioner.memory)"
        )


def plan_for(
    profile: Profile,
    balance: Sequence[int],
    *,
    schedule: str = "1f1b",
    n_microbatches: int | None = None,
    n_virtual: int | None = None,
    recompute: Recompute = "never",
    dp: int = 1,
    shard: int = 1,
    tp: int = 1,
    zero: int = 2,
    cost: str = "time",
    speeds: Sequence[float] | None = None,
    bandwidth: float | Sequence[float] | None = None,
    latency: float | Sequence[float] | None = None,
    optimizer_state_factor: float = 2.0,
    runtime: RuntimeCosts | None = None,
    memory_headroom: float | None = None,
) -> Plan:
    """The ``Plan`` of any ``balance`` (k = p * v layer counts), with the predictions ``partition``
    makes: ours, equal counts, torchgpipe's. The options default as in ``partition``. A balance
    with a boundary where the model cannot be cut is planned, and ``plan.problems`` says why
    no pipeline can run it (and names a stage that would hold no parameter). ``dp``: pipeline
    replicas, recorded in the plan; ``shard``, ``tp``, ``zero``: as in ``partition``
    (``partitioner.composition``)."""
    check_composition(shard, tp, zero)
    given: Any = balance  # Plan names what is wrong with it
    shape = Plan(balance=given, schedule=schedule, n_virtual=n_virtual or 0, recompute=recompute, dp=dp,
                 shard=shard, tp=tp, zero=zero)  # fmt: skip
    v, m = schedule_options(schedule, shape.n_ranks, n_microbatches, n_virtual)  # the given m and v
    shape = shape.replace(n_microbatches=m, n_virtual=v)
    net = Options.make(
        cost,
        shape.n_ranks,
        v,
        speeds,
        bandwidth,
        latency,
        None,
        optimizer_state_factor,
        runtime,
        entry(shape.schedule).placement,
        memory_headroom,
    ).composed(shard, tp, zero, bandwidth, latency, dp)
    check_balance_layers(shape.balance, len(profile))
    check_tensor_parallel(nn.Sequential(), profile, tp)  # a profile is of a model's layers: not traced
    profile = tensor_parallel(profile, net.composition)
    return predicted(profile, shape, shape.build_schedule(), net.measured(profile.device_memory))


def check_balance_layers(balance: Sequence[int], n_layers: int, source: str = "the profile") -> None:
    """ValueError unless ``balance`` covers ``n_layers`` layers (those of ``source``). For an
    ``nn.Sequential`` (its children are the layers) it needs no profile: callers can make it first."""
    covered = sum(balance)
    if covered != n_layers:
        raise ValueError(
            f"balance {list(balance)} covers {covered} layers but {source} has {n_layers}; "
            "the layer counts must add up to the model's layers"
        )


def check_stage_count(n_layers: int, n_ranks: int, n_virtual: int = 1, what: str = "layers") -> None:
    """ValueError unless n_ranks x n_virtual stages of at least one layer each fit ``n_layers``: a
    check that needs no profile, so callers can make it before profiling."""
    k = n_ranks * n_virtual
    if k > n_layers:
        fix = f"use at most {n_layers // n_virtual} ranks"
        fix += " or fewer stages per rank (n_virtual)" if n_virtual > 1 else ""
        raise ValueError(
            f"n_ranks ({n_ranks}) x n_virtual ({n_virtual}) is {k} stages but the model has {n_layers} "
            f"{what}, and every stage needs at least one; {fix}"
        )


def _profiled(
    model: nn.Module,
    n_ranks: int,
    v: int,
    sample: Any,
    profile: Profile | None,
    autocast: torch.dtype | None,
    loss_fn: LossFn | None,
    target: Any,
    device: torch.device | str | None,
    init_fn: Callable[[nn.Module], None] | None,
) -> Profile:
    """The model's profile (``profile`` checked against it, when given), once k = p * v stages are
    known to fit its layers."""
    traced = None
    if isinstance(model, nn.Sequential):
        n = len(model)
    elif profile is not None:
        n = len(profile)
    else:
        traced = trace(model, sample, stages=n_ranks * v)  # a module above a balanced stage: split
        n = len(traced.layers)
    what = "layers" if traced is None else f"layers (groups of its traced calls: {_names(traced)})"
    check_stage_count(n, n_ranks, v, what)
    if profile is None:
        options: dict[str, Any] = {"device": device, "autocast": autocast, "loss_fn": loss_fn}
        options.update(target=target, init_fn=init_fn)
        if traced is None:
            return run_profile(model, sample, **options)
        return profile_graph(traced, sample, **options)
    _check_given_profile(profile, n, autocast, loss_fn)
    return profile


def _auto(
    model: nn.Module,
    n_ranks: int,
    sample: Any,
    schedule: str,
    n_microbatches: int | str | None,
    n_virtual: int | None,
    recompute: Recompute,
    dp: int,
    cost: str,
    memory_limit: float | Sequence[float] | None,
    batch_size: int | None,
    speeds: Sequence[float] | None,
    bandwidth: float | Sequence[float] | None,
    latency: float | Sequence[float] | None,
    optimizer_state_factor: float,
    runtime: RuntimeCosts | None,
    memory_headroom: float | None,
    profiling: dict[str, Any],
    profile: Profile | None,
    composed: tuple[int | str, int | str, int, int | None],
) -> Plan:
    """``partition`` with schedule and/or m searched (``partitioner.auto``), arguments checked first;
    ``composed``: (shard, tp, zero, world_size), each (dp, shard, tp) of the world searched."""
    if schedule != "auto":
        schedule_options(schedule, n_ranks, None, n_virtual)  # the name and v, checked
    if recompute != "never":
        raise ValueError(
            f"recompute ({recompute!r}) is searched per stage with schedule='auto' or n_microbatches='auto'; "
            "omit recompute"
        )
    m = None if n_microbatches == "auto" else n_microbatches
    if isinstance(m, str):
        raise ValueError(f"n_microbatches ({m!r}) must be an integer >= 1, or 'auto'")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp ({dp!r}) must be an integer >= 1: the number of pipeline replicas")
    shard, tp, zero, world = composed
    worlds = factorizations(n_ranks, dp, shard, tp, world)
    check_autocast(profiling["autocast"])
    rows = batch_rows(sample) if profile is None or batch_size is None else 0
    if profile is not None and batch_size is None:
        raise ValueError(
            "batch_size is required when a profile is given to the auto search: the rows of one step"
        )
    batch = rows if batch_size is None else batch_size
    check_search(batch, memory_limit)
    Options.make(  # checked
        cost, n_ranks, 1, speeds, None, None, memory_limit, optimizer_state_factor, runtime,
        memory_headroom=memory_headroom,
    )  # fmt: skip
    check_model(model)
    for _, _, t in worlds if world is None or tp != "auto" else ():  # a pinned tp: refused before profiling
        check_tensor_parallel(model, None, t)
    prof = _profiled(model, n_ranks, 1, sample, profile, **profiling)
    if world is None or tp != "auto":
        for _, _, t in worlds:
            check_tensor_parallel(model, prof, t)
    else:  # tp searched: only the sizes this model can be split by
        worlds = [(d, s, t) for d, s, t in worlds if t == 1 or _splits(model, prof, t)]
    sample_rows = rows if profile is None else _profile_rows(prof, sample)
    second = None
    if profile is None:  # a second size gives each layer's per-call overhead (partitioner.scaling)
        other = second_rows(rows, batch, _microbatch_counts(batch, m))
        at_other = dict(profiling, target=_with_rows(profiling["target"], rows, other))
        second = (_profiled(model, n_ranks, 1, _with_rows(sample, rows, other), None, **at_other), other)
    plans, refused = [], []
    for d, s, t in worlds:
        try:
            plans.append(search(
                prof, n_ranks, batch_size=batch, sample_rows=sample_rows, memory_limit=memory_limit,
                second=second, schedules=None if schedule == "auto" else [schedule], n_microbatches=m,
                n_virtual=n_virtual, dp=d, cost=cost, speeds=speeds, bandwidth=bandwidth, latency=latency,
                optimizer_state_factor=optimizer_state_factor, runtime=runtime,
                memory_headroom=memory_headroom, shard=s, tp=t, zero=zero if s > 1 else 2,
            ))  # fmt: skip
        except ValueError as err:
            if len(worlds) == 1:
                raise
            refused.append(f"dp={d}, shard={s}, tp={t}: {err}")
    if not plans:
        raise ValueError(
            f"no (dp, shard, tp) of world_size={world} with n_ranks={n_ranks} fits: " + "; ".join(refused)
        )
    # the most rows per second over the world: every (replica, shard) pipeline runs batch_size rows
    return max(plans, key=lambda plan: plan.dp * plan.shard / plan.step_time if plan.step_time > 0 else 0.0)


def factorizations(
    n_ranks: int, dp: int, shard: int | str, tp: int | str, world_size: int | None
) -> list[tuple[int, int, int]]:
    """The (dp, shard, tp) the auto search plans: the given ones without ``world_size``; with it,
    every one with dp x shard x n_ranks x tp = world_size, ``"auto"`` sizes searched over the divisors
    of world_size / n_ranks and dp what is left. A ValueError naming the value and the fix."""
    if world_size is None:
        assert isinstance(shard, int) and isinstance(tp, int)  # check_composition: "auto" needs a world
        return [(dp, shard, tp)]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size ({world_size!r}) must be an integer >= 1: every rank of the run")
    if world_size % n_ranks:
        raise ValueError(
            f"world_size ({world_size}) is not a multiple of n_ranks ({n_ranks}): the world is dp x shard x "
            f"n_ranks x tp ranks; pass a world_size that n_ranks divides, or other n_ranks"
        )
    if dp != 1:
        raise ValueError(
            f"dp ({dp!r}) is what world_size leaves, dp = world_size / (n_ranks x shard x tp); omit dp, or "
            "omit world_size and give dp, shard and tp"
        )
    rest = world_size // n_ranks
    sizes = [x for x in range(1, rest + 1) if rest % x == 0]
    out = [
        (rest // (s * t), s, t)
        for s in (sizes if shard == "auto" else [shard])
        for t in (sizes if tp == "auto" else [tp])
        if isinstance(s, int) and isinstance(t, int) and rest % (s * t) == 0
    ]
    if not out:
        raise ValueError(
            f"shard={shard!r} x tp={tp!r} does not divide world_size / n_ranks = {world_size} / {n_ranks} = "
            f"{rest}; pass sizes whose product divides {rest}, or 'auto'"
        )
    return out


def _splits(model: nn.Module, profile: Profile, tp: int) -> bool:
    """Whether tensor parallelism of ``tp`` ranks can split this model (``check_tensor_parallel``)."""
    try:
        check_tensor_parallel(model, profile, tp)
    except ValueError:
        return False
    return True


def _with_rows(x: Any, rows: int, to_rows: int) -> Any:
    """``x``'s tensors with ``to_rows`` rows: its first rows, or its rows repeated."""
    if x is None:
        return None
    if to_rows <= rows:
        return tree_map(x, lambda t: t[:to_rows])
    times = -(-to_rows // rows)
    return tree_map(x, lambda t: t.repeat_interleave(times, 0)[:to_rows])


def _profile_rows(profile: Profile, sample: Any) -> int:
    """The rows a given profile was taken at: the sample's, or else its first layer's output's."""
    if sample is not None:
        return batch_rows(sample)
    shape = profile.layers[0].output_shape
    if not shape:
        raise ValueError("the given profile's rows are unknown: pass the sample it was taken with")
    return int(shape[0])


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


def _names(traced: Traced) -> str:
    names = [layer.name for layer in traced.layers]
    return ", ".join(names) if len(names) <= 12 else ", ".join(names[:12]) + ", ..."
