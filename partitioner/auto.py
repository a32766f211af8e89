"""``schedule="auto"``: the schedule, m, v, recomputation per stage and balance chosen together.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, B: rows of one step, s: stage

The grid, for a profile taken at any rows (``partitioner.scaling`` prices each m at B / m rows)::

    group  = (schedule, v, m)    gpipe, 1f1b, zb-h1 (v = 1) and interleaved-1f1b (v = 2 .. as many
                                 as the cuttable places allow); m divides B and passes
                                 ``schedule_options``
    config = group x recompute   "never", "except_last" (m >= 2), "always" for every stage, or
                                 "per stage": each stage's mode chosen with the balance by the joint
                                 DP (``partitioner._joint``: the least bottleneck over all 3^k)

Each config gets its exact balance (``partitioner._balance``, memory model included) and its step
time from the simulator (F, B and W per stage from the profile, plus the links' latency and
bandwidth, plus the runtime's own seconds per action and per message: ``partitioner.overhead``,
``DEFAULT_RUNTIME`` unless ``runtime`` is given; they are what makes many tiny micro-batches
slow, and they do not depend on the balance); the answer is the fastest config whose every
rank's peak fits its limit, the peak being the schedule walked rank by rank
(``partitioner.memory``; the solver's rows bound it from above) and the limit what is left of it
beside the device's workspaces, rounding and headroom (``partitioner.device_memory``).

Pruning, with bounds that never cut off a config that could be faster than the best found::

    every rank runs all its actions in turn, so  step >= m * (busiest rank's work per micro-batch)
                                                 (its compute and its runtime seconds)
    group bound    m * max(least bottleneck of any balance, total compute / sum of speeds), with
                   no recomputation and no memory limit: <= every config of the group. Groups go
                   likely-fastest first (the bound times the usual bubble, (m v + p - 1) / (m v));
                   a group whose bound reaches the best step found is skipped unsimulated
    fit            a group where no balance fits even the static bytes (weights, gradients,
                   optimizer state) is skipped before its schedule is built, one where not even
                   its floor fits (``partitioner._floors``: the walk of its compute orders alone,
                   no program derived) before its walk; a config no balance fits (an O(k n) numpy
                   pass) is skipped before solving
    nothing fits   the error names the smallest limit of any config: groups in order of their
                   static floor, and one whose floor reaches the least found is not walked
    balance bound  m * (busiest rank's work under the solved balance), plus for v = 1 the fill
                   and drain in front of and behind each rank (``_balance_bound``): a config at or
                   above the best step found is not simulated

Both bounds are compared with the best step found times 1 + ``within`` (default 0.1), so every
config predicted within 10 % of the best is simulated: ``Plan.candidates`` lists exactly those
(the fastest ``keep`` of them), the runners-up a user may prefer. ``search(..., prune=False)``
evaluates the whole grid: the tests compare the two.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from partitioner._balance import Modes, balance_of
from partitioner._floors import (
    group_fits,
    group_reaches,
    refuse_below_static,
    static_fits,
    static_reaches,
    static_row,
)
from partitioner._options import Options, reserve_fix, reserve_text
from partitioner._planning import grouped, grouped_cut, predicted
from partitioner.composition import Composition, tensor_parallel
from partitioner.costs import (
    backward_time,
    cut_groups,
    cut_rows,
    layer_costs,
    n_links,
    recomputed_share,
    with_loss,
)
from partitioner.figures import Profile
from partitioner.overhead import DEFAULT_RUNTIME, RuntimeCosts, stage_extras
from partitioner.scaling import scale_profile
from partitioner.solve import solve, stage_costs
from pipeline.plan import Candidate, Plan, SearchStats, check_headroom
from pipeline.runtime.step.recompute import RECOMPUTE_MODES, Recompute
from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.registry import REGISTRY, entry
from pipeline.schedules.schedule import Schedule, schedule_options, unchecked

__all__ = ["PER_STAGE", "check_search", "rank_peaks", "search"]

PER_STAGE = "per stage"  # the config whose stages choose their modes


@dataclass
class _Group:
    schedule: str
    v: int
    m: int
    bound: float  # step >= bound for every config of the group
    guess: float  # the bound with the schedule's usual bubble: the order to try groups in


@dataclass
class _Stats:
    """``SearchStats``' counts while the search runs (the plan's record of them is frozen)."""

    grid: int = 0
    simulated: int = 0
    pruned_group: int = 0
    pruned_fit: int = 0
    pruned_balance: int = 0

    def done(self, seconds: float) -> SearchStats:
        return SearchStats(**asdict(self), seconds=seconds)


def search(
    profile: Profile,
    n_ranks: int,
    *,
    batch_size: int,
    sample_rows: int,
    memory_limit: float | Sequence[float] | None,
    schedules: Sequence[str] | None = None,
    n_microbatches: int | None = None,
    n_virtual: int | None = None,
    dp: int = 1,
    cost: str = "time",
    speeds: Sequence[float] | None = None,
    bandwidth: float | Sequence[float] | None = None,
    latency: float | Sequence[float] | None = None,
    optimizer_state_factor: float = 2.0,
    runtime: RuntimeCosts | None = None,
    memory_headroom: float | None = None,
    shard: int = 1,
    tp: int = 1,
    zero: int = 2,
    second: tuple[Profile, int] | None = None,
    keep: int = 10,
    within: float = 0.1,
    prune: bool = True,
) -> Plan:
    """The fastest plan that fits (see the module docstring); its ``candidates`` are the fastest
    ``keep`` configs within ``within`` of it and its ``search`` what the search did.
    ``profile`` was taken at ``sample_rows`` rows (``second``: another profile at other rows, for
    the per-call overhead); ``runtime``: the runtime's seconds per action and message
    (``partitioner.overhead``; None: ``DEFAULT_RUNTIME``); ``memory_headroom``: the share of each
    limit kept free (None: the profiled device's, ``partitioner.device_memory``); ``shard``, ``tp``,
    ``zero``: each rank's share of the composition (``partitioner.composition``; checked by
    ``partition``): its memory and time, and the plan records them."""
    start = time.perf_counter()
    p = n_ranks
    runtime = DEFAULT_RUNTIME if runtime is None else runtime  # m and v change how many actions run
    check_search(batch_size, memory_limit, schedules, keep)
    names = list(REGISTRY) if schedules is None else list(schedules)  # None: every registered one
    if isinstance(within, bool) or not within >= 0:
        raise ValueError(f"within ({within!r}) must be a fraction >= 0 (0.1: candidates within 10 %)")
    sizes, _ = cut_groups(profile.layers, profile.cut_reasons)
    if memory_headroom is not None:
        check_headroom(memory_headroom)
    if memory_limit is not None:  # every configuration's static check at once: milliseconds
        every = Options.make("time", p, 1, None, None, None, memory_limit, optimizer_state_factor,
                             memory_headroom=memory_headroom)  # fmt: skip
        # the profile's device: the least any m reserves (scaling to fewer rows only grows the
        # rounding), so it refuses no config that fits
        every.composed(shard, tp, zero, None, None, dp).measured(profile.device_memory)
        refuse_below_static(profile, every, None, sizes)
    ms = _microbatch_counts(batch_size, n_microbatches)
    scaled: dict[int, Profile] = {}
    nets: dict[tuple[int, str], Options] = {}  # per (v, placement)
    groups: list[_Group] = []
    bounds: dict[tuple[int, bool, int, str], float] = {}
    rows: dict[tuple[int, Composition], list[float]] = {}  # per scaled profile: its static row
    skipped: list[str] = []
    unfit: list[_Group] = []  # groups that no balance fits, whatever the schedule's order
    for name in names:
        for v in _virtual_range(name, p, len(sizes), n_virtual):
            if p * v > len(sizes):
                skipped.append(f"{name} v={v}: {p * v} stages but only {len(sizes)} cuttable layer groups")
                continue
            placement = entry(name).placement
            if (v, placement) not in nets:
                try:
                    nets[v, placement] = Options.make(
                        cost,
                        p,
                        v,
                        speeds,
                        _links(bandwidth, p, v, placement),
                        _links(latency, p, v, placement),
                        memory_limit,
                        optimizer_state_factor,
                        runtime,
                        placement,
                        memory_headroom,
                    ).composed(shard, tp, zero, bandwidth, latency, dp)  # the raw links: one figure for any v
                except ValueError as err:  # e.g. p - 1 links given: no interleaving
                    skipped.append(f"{name} v={v}: {err}")
                    continue
            for m in ms:
                try:
                    schedule_options(name, p, m, v)
                except ValueError as err:
                    skipped.append(f"{name} v={v} m={m}: {err}")
                    continue
                if m not in scaled:
                    # one tp rank's compute at m's rows (the collectives' link is every net's)
                    at_m = scale_profile(profile, sample_rows, batch_size // m, second)
                    scaled[m] = tensor_parallel(at_m, nets[v, placement].composition)
                    # the rounding grows at fewer rows: each m's nets see its own (set before use)
                net = nets[v, placement].measured(scaled[m].device_memory)
                if memory_limit is not None and not static_fits(
                    scaled[m], net, p * v, sizes, _row(rows, scaled[m], net, sizes)
                ):
                    skipped.append(
                        f"{name} v={v} m={m}: even the weights, gradients and optimizer state do not fit"
                    )
                    unfit.append(_Group(name, v, m, math.inf, math.inf))
                    continue  # before its time bound: a solve of every layer
                split = entry(name).split_backward
                key = (m, split, p * v, placement)
                if key not in bounds:
                    bounds[key] = m * (
                        _least_work(scaled[m], nets[v, placement], p * v, m, split, sizes)
                        + _least_runtime(nets[v, placement], p * v, split)
                    )
                guess = bounds[key] * (1.0 + (p - 1) / (m * v))  # ~ (m v + p - 1) / (m v): the bubble
                groups.append(_Group(name, v, m, bounds[key], guess))
    if not groups and not unfit:
        raise ValueError(
            f"no schedule runs batch_size={batch_size} on {p} ranks: {'; '.join(skipped[:4])}; choose a "
            "batch size with a divisor that the schedule accepts (e.g. a multiple of the number of ranks)"
        )
    groups.sort(key=lambda g: (g.guess, g.bound))  # likely fast first: the best found prunes the rest
    stats = _Stats()
    found: list[Plan] = []
    best = [math.inf]  # the best step found so far (a box: _evaluate updates it)
    built: dict[tuple[str, int, int], Schedule] = {}
    slack = 1.0 + within if prune else math.inf
    for group in unfit:
        stats.grid += 4 if group.m >= 2 else 3
        stats.pruned_fit += 4 if group.m >= 2 else 3
    for group in groups:
        n_configs = 4 if group.m >= 2 else 3
        stats.grid += n_configs
        if group.bound >= best[0] * slack:
            stats.pruned_group += n_configs
            continue
        prof, net = scaled[group.m], _net(nets, group, scaled[group.m])
        sched = _schedule(group, p, built)
        if memory_limit is not None and prune and not group_fits(prof, sched, net, sizes, RECOMPUTE_MODES):
            stats.pruned_fit += n_configs  # not even the group's floor fits: its walk is never run
            unfit.append(group)
            continue
        found += _evaluate(group, prof, net, sched, dp, sizes, best, slack, stats)
    if not found:
        raise ValueError(
            _nothing_fits(groups + unfit, scaled, nets, p, sizes, memory_limit, built, prune, rows)
        )
    found.sort(key=lambda plan: plan.step_time)
    winner = found[0]
    winner.build_schedule()  # validated (the search ran the generators' schedules unchecked)
    kept = [plan for plan in found if plan.step_time <= winner.step_time * (1.0 + within)][:keep]
    return winner.replace(
        candidates=[_candidate(plan) for plan in kept],
        search=stats.done(time.perf_counter() - start),
        batch_size=batch_size,
        micro_batch_rows=batch_size // winner.n_microbatches,
    )


def _evaluate(
    group: _Group,
    profile: Profile,
    net: Options,
    sched: Schedule,
    dp: int,
    sizes: list[int],
    best: list[float],
    slack: float,
    stats: _Stats,
) -> list[Plan]:
    """The plans of the group's configs that fit and may be within ``slack`` times the best step
    (``best[0]``, updated here)."""
    rule, p = net.composition, sched.n_ranks
    shape = Plan(balance=[1] * (p * group.v), schedule=group.schedule, n_microbatches=group.m,
                 n_virtual=group.v, dp=dp, shard=rule.shard, tp=rule.tp, zero=rule.zero)  # fmt: skip
    k = shape.n_stages
    per_stage = Modes.build(profile, sched, net, sizes, [list(RECOMPUTE_MODES)] * k)
    uniform = [mode for mode in RECOMPUTE_MODES if group.m >= 2 or mode != "except_last"]
    out: list[Plan] = []
    seen: set[tuple[tuple[int, ...], Recompute]] = set()
    paths: list[list[tuple[int, Kind, int]]] = []  # the order's chains: read once a config needs them
    for config in [*uniform, PER_STAGE]:
        if net.memory_limit is not None:
            allowed = None if config == PER_STAGE else [[per_stage.modes.index(config)]] * k
            if not per_stage.fits(allowed):
                stats.pruned_fit += 1
                continue
        if config == PER_STAGE:
            solved = per_stage.solve()
            assert solved is not None  # it fits (checked above)
            balance, modes = solved
            plan = shape.replace(balance=balance, recompute=modes[0] if len(set(modes)) == 1 else modes)
        else:
            plan = balance_of(profile, shape.replace(recompute=config), sched, net, sizes)
        if (tuple(plan.balance), plan.recompute) in seen:
            continue  # the per-stage choice came out as a uniform config already evaluated
        seen.add((tuple(plan.balance), plan.recompute))
        if _balance_bound(profile, plan, net, sched.split_backward) >= best[0] * slack:
            stats.pruned_balance += 1
            continue
        if best[0] < math.inf and slack < math.inf:  # the chains may prune it too (none before a best)
            paths = paths or _order_paths(sched)
            if _paths_bound(profile, plan, net, sched.split_backward, paths) >= best[0] * slack:
                stats.pruned_balance += 1
                continue
        plan = predicted(profile, plan, sched, net)
        stats.simulated += 1
        peaks = rank_peaks(plan)
        if net.memory_limit is not None and any(
            peak > net.device.usable(limit) for peak, limit in zip(peaks, net.memory_limit, strict=True)
        ):
            continue  # cannot happen: the rows bound the walk, and each stage fits its rank's usable / v
        out.append(plan)
        best[0] = min(best[0], plan.step_time)
    return out


def rank_peaks(plan: Plan) -> list[float]:
    """Per rank, the predicted peak bytes: the schedule walked action by action (what
    ``pipe.memory_stats()`` measures; ``predicted`` records it in ``Plan.rank_peaks``)."""
    return list(plan.rank_peaks)


def _balance_bound(profile: Profile, plan: Plan, net: Options, split: bool) -> float:
    """A lower bound on the simulated step of ``plan`` from its balance alone.

    Rank r runs m x its stages' F, B and W (cuts included) one after another: step >= m * work_r.
    With one stage per rank it also starts only once micro-batch 0's forward has crossed stages
    0 .. r-1, and (unsplit backward: its last action is a B) ends only after that micro-batch's
    backward has crossed them again; those are at least their compute time (links left out).
    The schedule's own waits (its bubble) bound it too: ``_paths_bound``, checked second, as it
    reads the order's chains."""
    k, p, m = plan.n_stages, plan.n_ranks, plan.n_microbatches
    cuts = cut_rows(profile, k, p, net.latency, net.bandwidth, net.placement)
    modes = [plan.recompute_of(s) for s in range(k)]
    speeds = net.stage_speeds(k)

    def per_stage(with_cuts: bool, forward_only: bool = False) -> list[float]:
        out = []
        for mode in set(modes):
            if forward_only:
                costs = [lp.forward_time for lp in with_loss(profile)]
            else:
                costs = layer_costs(profile, net.cost, recompute=mode, n_microbatches=m, split_backward=split)
            out.append(
                (mode, stage_costs(costs, plan.balance, cut_costs=cuts if with_cuts else None, speeds=speeds))
            )
        table = dict(out)
        return [table[mode][s] for s, mode in enumerate(modes)]

    work = per_stage(True)
    extra = _runtime_per_stage(net, k, split)
    ranks = [m * (math.fsum(on_rank(net, work, r)) + math.fsum(on_rank(net, extra, r))) for r in range(p)]
    if k == p and net.cost == "time":  # one stage per rank: the fill (and drain) in front of each
        path = per_stage(False, forward_only=split)
        ranks = [ranks[r] + math.fsum(path[:r]) for r in range(p)]
    return max(ranks)


def _paths_bound(
    profile: Profile, plan: Plan, net: Options, split: bool, paths: list[list[tuple[int, Kind, int]]]
) -> float:
    """A lower bound on the simulated step of ``plan`` from its schedule's order: each of ``paths``
    (``_order_paths``: chains of actions that the order runs one after another; (stage, kind, count)
    each) costs at least its actions' least seconds, its layers' compute (the recomputed forward in
    B) plus the runtime's seconds per action and message (links left out), and the step is at least
    the longest."""
    if not paths or net.cost != "time":
        return 0.0
    k, p, m = plan.n_stages, plan.n_ranks, plan.n_microbatches
    layers = with_loss(profile)
    speeds = net.stage_speeds(k) or [1.0] * k
    extras = stage_extras(k, p, net.runtime, net.rank_of)
    w_extra = net.runtime.action if split else 0.0
    cost: dict[Kind, list[float]] = {Kind.F: [], Kind.B: [], Kind.W: []}
    start = 0
    for s, size in enumerate(plan.balance):
        lps = layers[start : start + size]
        start += size
        forward = math.fsum(lp.forward_time for lp in lps) / speeds[s]
        rho = recomputed_share(plan.recompute_of(s), m)
        cost[Kind.F].append(forward + extras[s][0])
        cost[Kind.B].append(math.fsum(backward_time(lp, split) - (lp.weight_time if split else 0.0)
                                      for lp in lps) / speeds[s] + rho * forward + extras[s][1])  # fmt: skip
        cost[Kind.W].append(math.fsum(lp.weight_time for lp in lps) / speeds[s] + w_extra)
    return max(math.fsum(n * cost[kind][s] for s, kind, n in path) for path in paths) * (1.0 - 1e-12)


def _order_paths(sched: Schedule) -> list[list[tuple[int, Kind, int]]]:
    """Chains of ``sched``'s actions, each one after another in every run (in a rank's order, or after
    what it needs: ``Action.needs``), as (stage, kind, how many) counts: the longest at unit costs,
    and per rank the longest through all its actions. Read off the schedule's order, whatever its
    name: where ranks wait (the bubble)."""
    index = {a: j for j, a in enumerate(a for order in sched.compute for a in order)}
    acts = list(index)
    n = len(acts)
    preds: list[list[int]] = [[] for _ in acts]
    succ: list[list[int]] = [[] for _ in acts]

    def edge(a: Action, b: int) -> None:
        if a in index:
            preds[b].append(index[a])
            succ[index[a]].append(b)

    for order in sched.compute:
        for a, after in itertools.pairwise(order):
            edge(a, index[after])
    for j, a in enumerate(acts):
        for d in a.needs:  # a B's own F also precedes it through the later stages: same chains
            edge(d, j)
    count = [len(ps) for ps in preds]
    topo, ready = [], [j for j in range(n) if count[j] == 0]
    while ready:
        j = ready.pop()
        topo.append(j)
        for q in succ[j]:
            count[q] -= 1
            if count[q] == 0:
                ready.append(q)
    if len(topo) < n:  # a cycle: the schedule cannot run (the validator says why); no chains
        return []
    head, via = [0.0] * n, [-1] * n  # the longest chain ending with j, unit costs
    for j in topo:
        for q in preds[j]:
            if head[q] > head[via[j]] if via[j] >= 0 else True:
                via[j] = q
        head[j] = 1.0 + (head[via[j]] if via[j] >= 0 else 0.0)
    tail, nxt = [0.0] * n, [-1] * n  # the longest chain starting with j
    for j in reversed(topo):
        for q in succ[j]:
            if tail[q] > tail[nxt[j]] if nxt[j] >= 0 else True:
                nxt[j] = q
        tail[j] = 1.0 + (tail[nxt[j]] if nxt[j] >= 0 else 0.0)

    def walk(j: int, step: list[int]) -> list[int]:
        out = []
        while j >= 0:
            out.append(j)
            j = step[j]
        return out

    chains = [walk(max(range(n), key=head.__getitem__), via)]
    for order in sched.compute:
        if order:
            mine = [index[a] for a in order]
            chains.append(walk(via[mine[0]], via) + mine + walk(nxt[mine[-1]], nxt))
    out = []
    for chain in chains:
        counts: dict[tuple[int, Kind], int] = {}
        for j in chain:
            counts[acts[j].stage, acts[j].kind] = counts.get((acts[j].stage, acts[j].kind), 0) + 1
        out.append([(s, kind, c) for (s, kind), c in counts.items()])
    return out


def _runtime_per_stage(net: Options, k: int, split: bool) -> list[float]:
    """Per stage, the runtime's seconds per micro-batch (its F, B and, split, W actions)."""
    w = net.runtime.action if split else 0.0
    return [f + b + w for f, b in stage_extras(k, net.n_ranks, net.runtime, net.rank_of)]


def _least_runtime(net: Options, k: int, split: bool) -> float:
    """The least runtime seconds per micro-batch of any rank: step >= m * (every rank's work),
    and a rank's runtime seconds do not depend on the balance."""
    extra = _runtime_per_stage(net, k, split)
    return min(math.fsum(on_rank(net, extra, r)) for r in range(net.n_ranks))


def on_rank(net: Options, per_stage: list[float], r: int) -> list[float]:
    """The figures of ``per_stage`` that belong to rank r's stages (the schedule's placement)."""
    return [x for s, x in enumerate(per_stage) if net.rank_of(s) == r]


def _row(
    rows: dict[tuple[int, Composition], list[float]], prof: Profile, net: Options, sizes: list[int]
) -> list[float]:
    """``static_row`` of a scaled profile, once per search (every group of its m reads it; the
    profiles live in ``scaled`` for the whole search, so their ids stay theirs)."""
    key = (id(prof), net.composition)
    if key not in rows:
        rows[key] = static_row(prof, net, sizes)
    return rows[key]


def _least_work(profile: Profile, net: Options, k: int, m: int, split: bool, sizes: list[int]) -> float:
    """Per micro-batch, the least work of the busiest rank over every balance into k stages, with no
    recomputation and no memory limit: at least the least bottleneck of a stage, and the whole
    model's compute spread over the ranks' speeds."""
    costs = grouped(layer_costs(profile, net.cost, n_microbatches=m, split_backward=split), sizes)
    cuts = cut_rows(profile, k, net.n_ranks, net.latency, net.bandwidth, net.placement)
    cut = None if cuts is None else [grouped_cut(row, sizes) for row in cuts]
    balance = solve(costs, k, cut_costs=cut, speeds=net.stage_speeds(k))
    bottleneck = max(stage_costs(costs, balance, cut_costs=cut, speeds=net.stage_speeds(k)))
    speeds = net.speeds or [1.0] * net.n_ranks
    return max(bottleneck, math.fsum(costs) / math.fsum(speeds))


def _candidate(plan: Plan) -> Candidate:
    return Candidate(
        schedule=plan.schedule,
        n_microbatches=plan.n_microbatches,
        n_virtual=plan.n_virtual,
        recompute=plan.recompute,
        balance=plan.balance,
        step_time=plan.step_time,
        bubble=plan.bubble,
        peak_bytes=rank_peaks(plan),
    )


def _nothing_fits(
    groups: list[_Group],
    scaled: dict[int, Profile],
    nets: dict[tuple[int, str], Options],
    p: int,
    sizes: list[int],
    memory_limit: float | Sequence[float] | None,
    built: dict[tuple[str, int, int], Schedule],
    prune: bool = True,
    rows: dict[tuple[int, Composition], list[float]] | None = None,
) -> str:
    """The error when no config fits: the smallest limit (or factor) that would, and for which config
    (the first of the least, groups by v, then in the search's order).

    Each group's floors (``partitioner._floors``) are below its exact smallest limit: the static
    bytes' (no schedule built), then its ranks' compute orders walked (no program derived). A group
    whose floor does not fit the least limit found cannot beat it and is not walked (``prune=False``:
    every group is, the floors unread). ``rows``: the search's static rows, kept (``_row``)."""
    rows = {} if rows is None else rows
    least, where = math.inf, ""
    for i in sorted(range(len(groups)), key=lambda i: (groups[i].v, i)):  # the fewest stages first
        group = groups[i]
        prof, net = scaled[group.m], _net(nets, group, scaled[group.m])
        if (
            prune
            and least < math.inf
            and static_reaches(prof, net, p * group.v, sizes, least, _row(rows, prof, net, sizes))
        ):
            continue
        sched = _schedule(group, p, built)
        if prune and least < math.inf and group_reaches(prof, sched, net, sizes, RECOMPUTE_MODES, least):
            continue
        modes = Modes.build(prof, sched, net, sizes, [list(RECOMPUTE_MODES)] * (p * group.v))
        x = modes.smallest()
        if x < least:
            least, where = x, f"schedule={group.schedule!r}, n_microbatches={group.m}, n_virtual={group.v}"
    net = _net(nets, groups[0], scaled[groups[0].m])
    if net.scalar_limit:
        need = (
            f"the smallest memory_limit that fits is {least!r} bytes per rank ({where}, recompute per stage)"
        )
    else:
        need = f"the limits must grow by a factor of at least {least!r} ({where}, recompute per stage)"
    return (
        f"memory_limit ({memory_limit!r}) is too small for every configuration searched (schedules, "
        f"micro-batch counts, recomputation per stage, balances); {need}{reserve_text(net.device)}; raise "
        f"memory_limit {reserve_fix(net.device)}or use more ranks"
    )


def _schedule(group: _Group, p: int, built: dict[tuple[str, int, int], Schedule]) -> Schedule:
    """The group's schedule, straight from its generator (validated once it wins), built once per
    search (``built``): its programs, once derived, are kept with it."""
    key = (group.schedule, group.v, group.m)
    if key not in built:
        built[key] = unchecked(group.schedule, p, group.m, group.v)
    return built[key]


def check_search(
    batch_size: int,
    memory_limit: float | Sequence[float] | None,
    schedules: Sequence[str] | None = None,
    keep: int = 1,
) -> None:
    """The search's own arguments, checked (a ValueError naming the value and the fix)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size ({batch_size!r}) must be an integer >= 1: the rows of one step")
    limits = [memory_limit] if isinstance(memory_limit, (int, float)) else list(memory_limit or [])
    for r, x in enumerate(limits):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 or math.isinf(x):
            where = (
                "memory_limit"
                if len(limits) == 1 and not isinstance(memory_limit, Sequence)
                else f"memory_limit[{r}]"
            )
            raise ValueError(f"{where} ({x!r}) must be a finite number of bytes > 0 per rank")
    names = list(REGISTRY) if schedules is None else list(schedules)
    unknown = [name for name in names if name not in REGISTRY]
    if unknown or not names:
        raise ValueError(f"schedules {names!r} must be some of {', '.join(REGISTRY)}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep ({keep!r}) must be an integer >= 1: how many candidates to keep")


def _net(nets: dict[tuple[int, str], Options], group: _Group, profile: Profile) -> Options:
    """The group's options, on the device as ``profile`` (its m's) measured it."""
    return nets[group.v, entry(group.schedule).placement].measured(profile.device_memory)


def _links(
    value: float | Sequence[float] | None, p: int, v: int, placement: str
) -> float | Sequence[float] | None:
    """p figures (every link, p - 1 -> 0 included) serve v = 1 and the V too: their p - 1 links are
    the first."""
    wanted = n_links(placement, p, v)
    if wanted == p - 1 and isinstance(value, Sequence) and not isinstance(value, str) and len(value) == p:
        return list(value)[: p - 1]
    return value


def _microbatch_counts(batch_size: int, n_microbatches: int | None) -> list[int]:
    if n_microbatches is None:
        return [m for m in range(1, batch_size + 1) if batch_size % m == 0]
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches ({n_microbatches!r}) must be an integer >= 1 or 'auto'")
    if batch_size % n_microbatches != 0:
        raise ValueError(
            f"n_microbatches ({n_microbatches}) does not divide batch_size ({batch_size}); pass a divisor "
            "of the batch size, or n_microbatches='auto'"
        )
    return [n_microbatches]


def _virtual_range(name: str, p: int, n_groups: int, n_virtual: int | None) -> list[int]:
    """The v to try: the schedule's own (registry.py), up to what the cuttable places allow."""
    e = entry(name)
    if e.max_virtual == 1:  # one stage per rank (more ranks than groups is refused with its reason)
        return [1] if n_virtual in (None, 1) else []
    if n_virtual is not None:
        return [n_virtual] if e.takes_virtual(n_virtual) and p * n_virtual <= n_groups else []
    return e.virtual_counts(n_groups // p)
