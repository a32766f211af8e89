"""What ``partition`` and the auto search share: the memory model's rows, grouping of layers that no
cut splits, and a plan's predictions (stage times, memory, simulated step).

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, s: stage, l: layer

``memory_rows`` (and ``least_memory``, the auto search's bound) turn ``partitioner.memory``'s
walk into the solver's rows: per stage, the walk's coefficients (unit bytes) times per-layer
bounds, plus an offset for its input and output buffers; the rows bound the walk from above, so
a balance fitting them fits what a run holds. ``predicted`` records the walk itself per rank
(``Plan.rank_peaks``): what decides fit, within each rank's usable bytes (``Plan.device_memory``),
and what ``memory_stats`` measures; and, for micro-batches
of other shapes (a variable-length step's, ``pipeline.runtime.inputs.varlen``), the walk's figures per
stage (``StagePlan.held``), each time's and figure's length² share (``partitioner.lengths``), the
profiled micro-batch's shape and the ``memory_limit`` it was given. ``recompute`` is
one mode for every stage or one per stage (``Plan.recompute``); each stage's rows follow its own
mode, and so does its recomputed forward time.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from partitioner._options import Options
from partitioner.composition import Composition, composition_of
from partitioner.costs import (
    backward_time,
    cut_problems,
    cut_rows,
    layer_costs,
    recomputed_share,
    transfer,
    with_loss,
)
from partitioner.figures import LayerProfile, Profile
from partitioner.graph import cut_bytes
from partitioner.lengths import held_bytes, squared_seconds
from partitioner.memory import coefficients, layer_bounds, least_bytes
from partitioner.memory import rank_peaks as walked_peaks
from partitioner.overhead import stage_extras
from partitioner.solve import stage_costs, stage_memory
from partitioner.timing import predict
from pipeline.plan import Plan, StagePlan, TracedGraph
from pipeline.runtime.step.recompute import Recompute, mode_of
from pipeline.schedules.schedule import Schedule

__all__ = [
    "expand",
    "grouped",
    "grouped_cut",
    "largest_input",
    "least_memory",
    "memory_rows",
    "predicted",
    "ties_of",
]


def grouped(values: Sequence[float], sizes: list[int]) -> list[float]:
    """Per group of layers that no cut splits: the members' sum."""
    if len(sizes) == len(values):
        return list(values)
    out, start = [], 0
    for size in sizes:
        out.append(math.fsum(values[start : start + size]))
        start += size
    return out


def grouped_cut(row: Sequence[float], sizes: list[int]) -> list[float]:
    """Per group: the cut after its last layer."""
    if len(sizes) == len(row):
        return list(row)
    ends = itertools.accumulate(sizes)
    return [row[end - 1] for end in ends]


def expand(group_balance: list[int], sizes: list[int]) -> list[int]:
    out, g = [], 0
    for count in group_balance:
        out.append(sum(sizes[g : g + count]))
        g += count
    return out


def predicted(profile: Profile, shape: Plan, sched: Schedule, net: Options) -> Plan:
    """``shape`` (balance and options, already checked) with the predictions of its balance."""
    balance, k, m, p = shape.balance, shape.n_stages, shape.n_microbatches, shape.n_ranks
    split = sched.split_backward
    layers = with_loss(profile)
    cuts = cut_rows(profile, k, p, net.latency, net.bandwidth, net.placement)
    speeds = net.stage_speeds(k) or [1.0] * k
    modes = [shape.recompute_of(s) for s in range(k)]
    by_mode = {  # each stage's cost under its own mode
        mode: stage_costs(
            layer_costs(profile, net.cost, recompute=mode, n_microbatches=m, split_backward=split),
            balance,
            cut_costs=cuts,
            speeds=net.stage_speeds(k),
        )
        for mode in set(modes)
    }
    per_stage = [by_mode[mode][s] for s, mode in enumerate(modes)]
    rows, offsets = memory_rows(profile, sched, shape.recompute, net.composition)
    mem = stage_memory(rows, balance)
    sent = cut_bytes(profile.graph)
    extras = stage_extras(k, p, net.runtime, net.rank_of)  # the runtime's own seconds per action and message
    w_extra = net.runtime.action if split else 0.0
    squared = squared_seconds(profile)  # per layer: (F, whole B, input, weight) seconds growing as length²
    # per stage: what the memory walk holds of one micro-batch, each figure with its length² share
    held = held_bytes(profile, balance, net.composition)
    rule = net.composition  # FSDP's collectives (tensor parallelism's are in the profile's times)
    local = [math.fsum(rule.local(lp.param_bytes, lp.linear_weight_bytes) for lp in layers[a:b])
             for a, b in itertools.pairwise([0, *itertools.accumulate(balance)])]  # fmt: skip
    stages, start = [], 0
    for s, size in enumerate(balance):
        stop = start + size
        out = sent[stop - 1] if s < k - 1 else 0
        link = (
            transfer(out, s, p, net.latency, net.bandwidth, net.placement) if s < k - 1 else 0.0
        )  # each way
        if s > 0:
            link += transfer(sent[start - 1], s - 1, p, net.latency, net.bandwidth, net.placement)
        lps = layers[start:stop]
        rho = recomputed_share(modes[s], m)
        forward = math.fsum(lp.forward_time for lp in lps) / speeds[s]
        backward = math.fsum(backward_time(lp, split) for lp in lps) / speeds[s]
        weight = math.fsum(lp.weight_time for lp in lps) / speeds[s]
        if not split:  # the weight share of the whole backward (W and B were timed apart from it)
            parts = math.fsum(backward_time(lp, True) for lp in lps) / speeds[s]
            weight = backward * (weight / parts) if parts > 0 else 0.0
        f_extra, b_extra = extras[s]
        gather = rule.per_microbatch(local[s], split)  # ZeRO-3: before each F and each B
        f_extra, b_extra = f_extra + gather, b_extra + gather
        weight = min(weight, backward) + w_extra
        backward += b_extra + w_extra  # B (input gradient, or the whole) and W each run as an action
        # the seconds that grow as length² (partitioner.lengths): F's; B's as the schedule runs it,
        # with its recomputed forward; W's, its own time's share
        sq_f, sq_whole, sq_input, sq_w = (
            math.fsum(q[j] for q in squared[start:stop]) / speeds[s] for j in range(4)
        )
        own_w = math.fsum(lp.weight_time for lp in lps) / speeds[s]
        sq_b = (sq_input + sq_w if split else sq_whole) + rho * sq_f
        sq_weight = (weight - w_extra) * sq_w / own_w if own_w > 0 else 0.0
        stages.append(
            StagePlan(
                start=start,
                stop=stop,
                names=[lp.name for lp in lps],
                forward_time=forward + link + f_extra,
                backward_time=backward + rho * forward + link,
                cost=per_stage[s],
                memory_bytes=mem[s] + offsets[s],
                sent_bytes=out,
                weight_time=weight,
                forward_squared=_share(sq_f, forward + link + f_extra),
                backward_squared=_share(sq_b, backward + rho * forward + link),
                weight_squared=_share(sq_weight, weight),
                held=held[s],
            )
        )
        start = stop
    step, bubble = predict(
        sched,
        [st.forward_time for st in stages],
        [st.backward_time for st in stages],
        [st.weight_time for st in stages],
    )
    step += rule.per_step(local, net.rank_of, p, split)  # FSDP's once-per-step collectives
    graph: TracedGraph | None = None
    begins: list[str] = []  # the layer each stage after the first begins with
    if profile.traced is not None:  # what Pipeline checks the model against, and where it cuts
        graph = TracedGraph(**profile.traced, layers=[lp.name for lp in profile.layers])
        begins = [st.names[0] for st in stages[1:]]
    beside = net.composition.replica_bytes  # each rank's, beside its stages (Composition)
    # per rank: the schedule walked action by action, each storage once (what memory_stats measures);
    # (the decision); the stages' memory_bytes above are the solver's rows, a bound of it per stage
    return shape.replace(
        stages=stages,
        bottleneck=max(per_stage),
        step_time=step,
        bubble=bubble,
        cost=net.cost,
        prediction="simulator",
        rank_peaks=[peak + beside for peak in walked_peaks(sched, held, shape.recompute)],
        ties=ties_of(profile.layers, balance),
        cuts=begins,
        problems=cut_problems(profile.layers, balance, profile.cut_reasons),
        graph=graph,
        autocast=profile.autocast,
        loss_profiled=profile.loss is not None,
        micro_batch_shape=list(profile.shape or ()),
        memory_limit=list(net.memory_limit or ()),
        device_memory=net.device,
    )


def _share(part: float, whole: float) -> float:
    return min(part / whole, 1.0) if whole > 0 else 0.0


def memory_rows(
    profile: Profile, sched: Schedule, recompute: Recompute, optimizer_state_factor: float | Composition
) -> tuple[list[list[float]], list[float]]:
    """The memory rows ``solve`` takes (row s: what each layer costs at most on stage s) and, per
    stage, the bytes on top whatever its layers (its input and output buffers, each at the largest
    activation a cut can carry); ``recompute``: one mode, or one per stage.

    Row s, entry l = static_l + sum over figures f of coef[s][f] * bound_f[l] (``coefficients``
    from the walk with unit bytes, ``layer_bounds``): a stage's row sum plus its offset is >= what
    the walk (``rank_peaks``) charges it, so every balance fitting the rows fits the walk."""
    k = sched.n_stages
    modes = tuple(mode_of(recompute, s) for s in range(k))
    coefs = _coefficients(sched, modes)
    bounds = {f: np.asarray(x) for f, x in layer_bounds(profile, optimizer_state_factor).items()}
    parts = ("saved", "chain", "grads", "transient_forward", "transient_backward", "transient_input_grad",
             "transient_weight", "transient_recompute")  # fmt: skip
    by_coef: dict[tuple[float, ...], list[float]] = {}  # stages of equal coefficients share a row
    rows = []
    for c in coefs:
        key = tuple(c[f] for f in parts)
        if key not in by_coef:
            row = bounds["static"] + sum(k * bounds[f] for k, f in zip(key, parts, strict=True))
            by_coef[key] = row.tolist()
        rows.append(by_coef[key])
    edge = float(max((lp.activation_bytes for lp in profile.layers[:-1]), default=0))
    offsets = [
        edge * ((c["input"] if s > 0 else 0.0) + (c["output"] if s < k - 1 else 0.0))
        for s, c in enumerate(coefs)
    ]
    if profile.loss is not None:  # the last stage's loss of each micro-batch, kept to the step's end
        offsets[-1] += sched.n_microbatches * float(profile.loss.activation_bytes)  # (StageBytes.kept)
    beside = composition_of(optimizer_state_factor).replica_bytes / (k // sched.n_ranks)
    return rows, [offset + beside for offset in offsets]  # each rank's v stages share its replicas' bytes


_COEFS: OrderedDict[tuple[str, int, int, int, tuple[str, ...]], list[dict[str, float]]] = OrderedDict()
COEFS_SIZE = 256  # the schedules' coefficients kept, the least recently used dropped first


def _coefficients(sched: Schedule, modes: tuple[str, ...]) -> list[dict[str, float]]:
    """``coefficients`` of the schedule under ``modes``, cached (the search asks for each many times:
    a search past the cache's size keeps those it asks again, not none, as a clear-all did)."""
    key = (sched.name, sched.n_ranks, sched.n_stages, sched.n_microbatches, modes)
    found = _COEFS.get(key)
    if found is None:
        found = _COEFS[key] = coefficients(sched, modes)
        if len(_COEFS) > COEFS_SIZE:
            _COEFS.popitem(last=False)
    else:
        _COEFS.move_to_end(key)
    return found


def least_memory(profile: Profile, optimizer_state_factor: float | Composition) -> list[float]:
    """Per layer, the least bytes it adds to its rank's walked peak under any schedule, mode and
    balance: its static bytes (weights, gradients, optimizer state, buffers, weight copies)."""
    return least_bytes(profile, optimizer_state_factor)  # layer_bounds' "least", its bounds unmade


def ties_of(layers: list[LayerProfile], balance: list[int]) -> dict[str, list[int]]:
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


def largest_input(profile: Profile) -> int:
    """The most bytes any stage's input can be: the sample, or what crosses any cut."""
    return max([profile.input_bytes, *cut_bytes(profile.graph)])
