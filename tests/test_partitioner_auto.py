"""The auto search: schedule, m, v, recomputation per stage and balance, chosen under a memory limit.

Small synthetic profiles make brute force cheap: the pruned search must find the step time of the
whole grid (same simulator), fit every rank, and beat every uniform configuration that
``partition`` plans on its own; the joint DP of balance and per-stage modes must match a brute
force over every balance and every mode vector. A 100-layer profile on 8 ranks shows the pruning.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
import random
import re
import time

import pytest
import torch
from torch import nn

from partitioner import partition, plan_for
from partitioner._balance import Modes
from partitioner._options import Options
from partitioner._planning import least_memory, predicted
from partitioner.auto import _balance_bound, _least_work, _order_paths, _paths_bound, rank_peaks, search
from partitioner.costs import cut_groups, recomputed_share
from partitioner.figures import LayerProfile, Profile
from partitioner.graph import layer_graph
from partitioner.overhead import DEFAULT_RUNTIME, RuntimeCosts
from partitioner.scaling import batch_rows, scale_profile
from pipeline.plan import Candidate, DeviceMemory, Plan
from pipeline.runtime.step.recompute import RECOMPUTE_MODES
from pipeline.schedules.registry import entry
from pipeline.schedules.schedule import SCHEDULES, schedule_options


def synthetic(n: int, rows: int = 4, seed: int = 0, heavy: int | None = None) -> Profile:
    """n layers with random times and sizes at ``rows`` rows (``heavy``: one layer 8x the activations)."""
    rng = random.Random(seed)
    layers = []
    for i in range(n):
        act = rng.randint(1, 4) * rows * 1024 * (8 if i == heavy else 1)
        layers.append(
            LayerProfile(
                i,
                f"l{i}",
                "Linear",
                rng.uniform(1e-3, 3e-3),
                rng.uniform(2e-3, 6e-3),
                10,
                rng.randint(1, 4) * 65536,
                act,
                2 * act,
                (rows, 256),
                "float32",
                weight_time=rng.uniform(0.5e-3, 1.5e-3),
                input_time=rng.uniform(1e-3, 2e-3),
            )
        )
    return Profile(layers, "cpu", layer_graph(layers), input_bytes=rows * 1024)


# the runtime's seconds per action and message: the same on both sides of every comparison
RUNTIME = RuntimeCosts(action=2e-4, message=1e-4)


def _identity(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Identity() for _ in range(n)])


def _fits(plan: Plan, limit: float) -> bool:
    return all(peak <= limit for peak in rank_peaks(plan))


def _least(prof: Profile, p: int, **kw: object) -> float:
    """The smallest limit that fits, as the search's error states it (for a limit that holds the
    static bytes: one below them is refused at once, with what they need)."""
    static = least_memory(prof, float(kw.get("optimizer_state_factor", 2.0)))  # type: ignore[arg-type]
    floor = max(sum(static) / p, max(static))
    with pytest.raises(ValueError, match="the smallest memory_limit that fits is") as info:
        search(prof, p, memory_limit=floor, **kw)  # type: ignore[arg-type]
    return float(str(info.value).split("that fits is ")[1].split(" bytes")[0])


# -- the search against brute force ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "p", "batch", "seed", "heavy"), [(6, 2, 8, 0, None), (8, 2, 4, 1, 0), (9, 3, 6, 2, 8)]
)
def test_pruned_search_finds_the_best_of_the_whole_grid(
    n: int, p: int, batch: int, seed: int, heavy: int
) -> None:
    prof = synthetic(n, seed=seed, heavy=heavy)
    free = search(prof, p, batch_size=batch, sample_rows=4, memory_limit=None, bandwidth=1e8, latency=1e-4)
    least = _least(prof, p, batch_size=batch, sample_rows=4, bandwidth=1e8, latency=1e-4)
    tight = (least + max(rank_peaks(free))) / 2  # the unconstrained winner no longer fits
    assert least < max(rank_peaks(free))
    for limit in (None, tight):
        kw = dict(batch_size=batch, sample_rows=4, memory_limit=limit, bandwidth=1e8, latency=1e-4,
                  runtime=RUNTIME)  # fmt: skip
        auto = search(prof, p, **kw)  # type: ignore[arg-type]
        grid = search(prof, p, prune=False, keep=10_000, within=math.inf, **kw)  # type: ignore[arg-type]
        assert auto.step_time == grid.step_time
        assert auto.search is not None and grid.search is not None
        assert auto.search.simulated < grid.search.simulated
        if limit is not None:
            assert _fits(auto, limit)
            assert all(max(c.peak_bytes) <= limit for c in grid.candidates)
        # every uniform configuration partition() plans by itself, on the profile scaled to its m
        for name in SCHEDULES:
            for m in [d for d in range(1, batch + 1) if batch % d == 0]:
                for v in entry(name).virtual_counts(n // p):
                    try:
                        schedule_options(name, p, m, v)
                    except ValueError:
                        continue
                    for mode in RECOMPUTE_MODES:
                        scaled = scale_profile(prof, 4, batch // m)
                        try:
                            plan = partition(_identity(n), p, None, profile=scaled, schedule=name,
                                             n_microbatches=m, n_virtual=v, recompute=mode,
                                             memory_limit=limit, bandwidth=1e8, latency=1e-4,
                                             runtime=RUNTIME)  # fmt: skip
                        except ValueError as err:
                            assert "too small" in str(err)
                            continue
                        assert auto.step_time <= plan.step_time, (name, m, v, mode)


def _brute_bottleneck(modes: Modes, n_groups: int) -> float:
    """min over balances and mode vectors of the bottleneck, every stage within its mode's limit."""
    limits = modes.limits(1.0, modes.net.memory_limit)
    best = math.inf
    for cuts in itertools.combinations(range(1, n_groups), modes.k - 1):
        ends = [0, *cuts, n_groups]
        worst = 0.0
        for s, (a, b) in enumerate(itertools.pairwise(ends)):
            costs = [
                modes.prefix[o][b] - modes.prefix[o][a]
                for o in modes.allowed[s]
                if modes.memory[o][s if len(modes.memory[o]) > 1 else 0][b]
                - modes.memory[o][s if len(modes.memory[o]) > 1 else 0][a]
                <= limits[o][s]
            ]
            worst = max(worst, min(costs, default=math.inf))
        best = min(best, worst)
    return best


@pytest.mark.parametrize(
    ("schedule", "v", "seed"), [("1f1b", 1, 0), ("gpipe", 1, 1), ("interleaved-1f1b", 2, 2)]
)
def test_joint_dp_is_the_best_over_every_balance_and_mode_vector(schedule: str, v: int, seed: int) -> None:
    n, p, m = 8, 2, 4
    prof = synthetic(n, seed=seed, heavy=seed)
    sizes, _ = cut_groups(prof.layers)
    sched = Plan(balance=[1] * (p * v), schedule=schedule, n_microbatches=m).build_schedule()
    everything = [list(RECOMPUTE_MODES)] * (p * v)
    unlimited = Modes.build(
        prof, sched, Options.make("time", p, v, None, None, None, 1e18, 2.0), sizes, everything
    )
    solved = unlimited.solve()
    assert solved is not None
    balance, _ = solved
    high = max(predicted(prof, Plan(balance=balance, schedule=schedule, n_microbatches=m), sched,
                         unlimited.net).stages[s].memory_bytes for s in range(p * v)) * v  # fmt: skip
    for factor in (1.0, 0.8, 0.6, 0.45):
        net = Options.make("time", p, v, None, None, None, high * factor, 2.0)
        modes = Modes.build(prof, sched, net, sizes, everything)
        brute = _brute_bottleneck(modes, len(sizes))
        solved = modes.solve()
        if math.isinf(brute):
            assert solved is None and not modes.fits()
            continue
        assert solved is not None and modes.fits()
        balance, chosen = solved
        plan = predicted(
            prof, Plan(balance=balance, schedule=schedule, n_microbatches=m, recompute=chosen), sched, net
        )
        assert max(st.cost for st in plan.stages) == pytest.approx(brute, rel=1e-12)
        assert _fits(plan, high * factor)


def test_smallest_limit_in_the_error_is_exact() -> None:
    prof = synthetic(8, seed=3)
    kw = dict(batch_size=4, sample_rows=4, bandwidth=1e8, latency=1e-4)
    static = least_memory(prof, 2.0)
    floor = max(sum(static) / 2, max(static))  # below it, refused at once (the next test)
    with pytest.raises(
        ValueError, match=r"the smallest memory_limit that fits is ([0-9.e+]+) bytes per rank \(sch"
    ) as info:
        search(prof, 2, memory_limit=floor * 1.001, **kw)  # type: ignore[arg-type]
    least = float(str(info.value).split("that fits is ")[1].split(" bytes")[0])
    plan = search(prof, 2, memory_limit=least, **kw)  # type: ignore[arg-type]
    assert _fits(plan, least)
    with pytest.raises(ValueError, match="too small for every configuration"):
        search(prof, 2, memory_limit=least * (1 - 1e-9), **kw)  # type: ignore[arg-type]


def test_the_search_keeps_each_ranks_device_reserve() -> None:
    """A device's workspaces and headroom come off every rank's limit before anything is fitted: a
    limit that holds the weights is refused at once when it does not hold them beside the reserve;
    the smallest limit is the CPU's grown by exactly the reserve; the winner fits within it."""
    prof = synthetic(8, seed=3)
    kw = dict(batch_size=4, sample_rows=4, bandwidth=1e8, latency=1e-4)
    least = _least(prof, 2, **kw)  # on CPU: nothing reserved
    device = DeviceMemory(device="cuda:0", workspace_bytes=8 * 2**20, block_bytes=512, headroom=0.1)
    gpu = dataclasses.replace(prof, device_memory=device)
    static = least_memory(prof, 2.0)
    floor = max(sum(static) / 2, max(static))
    kept = (
        r"each rank's limit keeps 8.00 MiB for the matrix products' workspaces on cuda:0 .*memory_headroom=\)"
    )
    with pytest.raises(ValueError, match=rf"before any activation \({kept}\); it needs at least .* lower"):
        search(gpu, 2, memory_limit=floor * 1.001, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"that fits is ([0-9.e+]+) bytes per rank .*\({kept}\)") as info:
        search(gpu, 2, memory_limit=device.limit_for(floor) * 1.001, **kw)  # type: ignore[arg-type]
    reserved = float(str(info.value).split("that fits is ")[1].split(" bytes")[0])
    assert reserved == pytest.approx(device.limit_for(least), rel=1e-9)
    plan = search(gpu, 2, memory_limit=reserved, **kw)  # type: ignore[arg-type]
    assert plan.device_memory == device and max(plan.rank_needs) <= reserved * 0.9 * (1 + 1e-12)
    assert plan.candidates[0].peak_bytes == rank_peaks(plan)  # the runners-up's peaks: the walk, as before
    with pytest.raises(ValueError, match="too small for every configuration"):
        search(gpu, 2, memory_limit=reserved * (1 - 1e-9), **kw)  # type: ignore[arg-type]
    # the headroom is the caller's to set: none keeps only the workspaces
    none = search(gpu, 2, memory_limit=reserved, memory_headroom=0.0, **kw)  # type: ignore[arg-type]
    assert none.device_memory == dataclasses.replace(device, headroom=0.0)
    with pytest.raises(ValueError, match=r"memory_headroom \(-0.1\) must be a fraction in \[0, 1\)"):
        search(gpu, 2, memory_limit=reserved, memory_headroom=-0.1, **kw)  # type: ignore[arg-type]


def test_a_limit_below_the_static_bytes_is_refused_before_any_schedule_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prof = synthetic(8, seed=3)
    static = least_memory(prof, 2.0)
    need = max(sum(static) / 2, max(static))
    from partitioner import auto

    monkeypatch.setattr(auto, "unchecked", lambda *a: pytest.fail("a schedule was built"))
    total, least = re.escape(f"{sum(static):.4g}"), re.escape(f"{need:.4g}")
    expected = rf"alone are {total} bytes over 2 ranks .* at least {least} bytes per rank: raise memory_limit"
    with pytest.raises(ValueError, match=expected):
        search(prof, 2, memory_limit=need * 0.999, batch_size=4, sample_rows=4)
    with pytest.raises(ValueError, match=r"limits that add up to at least"):
        search(prof, 2, memory_limit=[need * 0.9, need * 0.9], batch_size=4, sample_rows=4)


def test_a_tight_limit_turns_recomputation_on_where_it_pays() -> None:
    """Between the smallest limit and the free plan's peak, recomputing on some stages only is
    faster than recomputing everywhere (what a uniform mode would need)."""
    prof = synthetic(12, seed=4)
    kw = dict(batch_size=8, sample_rows=4, schedules=["1f1b"], n_microbatches=8)
    free = search(prof, 4, memory_limit=None, **kw)  # type: ignore[arg-type]
    assert free.recompute == "never"
    limit = (max(rank_peaks(free)) + _least(prof, 4, **kw)) / 2
    tight = search(prof, 4, memory_limit=limit, **kw)  # type: ignore[arg-type]
    assert tight.recompute != "never" and _fits(tight, limit)
    assert isinstance(tight.recompute, tuple) and "never" in tight.recompute
    everywhere = partition(_identity(12), 4, None, profile=scale_profile(prof, 4, 1), n_microbatches=8,
                           recompute="always", memory_limit=limit, runtime=DEFAULT_RUNTIME)  # fmt: skip
    assert tight.step_time < everywhere.step_time


# -- fast on 100 layers and 8 ranks -------------------------------------------------------------------


def test_100_layers_on_8_ranks_is_pruned_not_simulated_whole() -> None:
    prof = synthetic(100, rows=8, seed=5)
    free = search(prof, 8, batch_size=64, sample_rows=8, memory_limit=None, bandwidth=1e9, latency=1e-5)
    start = time.perf_counter()
    least = _least(prof, 8, batch_size=64, sample_rows=8, bandwidth=1e9, latency=1e-5)
    assert time.perf_counter() - start < 120  # the error path is pruned too
    limit = least + (max(rank_peaks(free)) - least) * 0.3
    start = time.perf_counter()
    plan = search(prof, 8, batch_size=64, sample_rows=8, memory_limit=limit, bandwidth=1e9, latency=1e-5)
    seconds = time.perf_counter() - start
    stats = plan.search
    assert seconds < 120, seconds  # a sanity bound on a loaded machine: seconds when idle
    assert stats is not None and stats.grid > 200 and stats.simulated * 20 < stats.grid, stats
    assert stats.pruned_fit > 0 and stats.pruned_group + stats.pruned_balance > 0, stats
    unlimited = free.search  # no limit: the time bounds alone prune
    assert unlimited is not None, free
    assert unlimited.pruned_group > 0 and unlimited.simulated * 20 < unlimited.grid, unlimited


# -- candidates and the plan ---------------------------------------------------------------------------


def test_candidates_are_ranked_kept_in_json_and_printed() -> None:
    prof = synthetic(8, seed=6)
    plan = search(prof, 2, batch_size=8, sample_rows=4, memory_limit=None, within=1.0)
    rows = plan.candidates
    assert len(rows) >= 2 and all(isinstance(c, Candidate) for c in rows)
    assert [c.step_time for c in rows] == sorted(c.step_time for c in rows)
    first = rows[0]
    config = (first.schedule, first.n_microbatches, first.n_virtual, first.recompute, first.balance)
    assert config == (plan.schedule, plan.n_microbatches, plan.n_virtual, plan.recompute, plan.balance)
    assert first.step_time == plan.step_time and first.peak_bytes == rank_peaks(plan)
    assert all(c.step_time <= plan.step_time * 2.0 for c in rows)  # within=1.0: within 100 %
    again = Plan.from_json(plan.to_json())
    assert again.candidates == rows and again.search == plan.search
    table = plan.candidates_table()
    assert len(table.splitlines()) == len(rows) + 1 and plan.schedule in table.splitlines()[1]
    assert "candidates (auto search" in plan.table()
    assert Plan(balance=[1, 1]).candidates == []


def test_partition_auto_on_a_real_model_with_any_sample_rows() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)])
    sample = torch.randn(3, 32)  # any rows: the profile is scaled to each micro-batch
    plan = partition(model, 2, sample, schedule="auto", batch_size=8, memory_limit=10e6)
    assert plan.batch_size == 8 and 8 % plan.n_microbatches == 0
    assert plan.micro_batch_rows == 8 // plan.n_microbatches
    assert _fits(plan, 10e6) and plan.prediction == "simulator"
    fixed = partition(model, 2, sample, schedule="1f1b", n_microbatches="auto", batch_size=8)
    assert fixed.schedule == "1f1b" and {c.schedule for c in fixed.candidates} == {"1f1b"}


@pytest.mark.parametrize("rows", [1, 6])
def test_partition_auto_profiles_a_second_size_for_the_per_call_overhead(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without it, times are linear in rows and the smallest micro-batches look free. It is the
    smallest micro-batch searched (1 row: m = 8 divides 8), or the largest when the sample has 1 row."""
    part = importlib.import_module("partitioner.partition")  # the module (the package exports the function)
    seen: dict[str, object] = {}

    def spy(profile: Profile, n_ranks: int, **kwargs: object) -> Plan:
        seen.update(kwargs, first=profile)
        return search(profile, n_ranks, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(part, "search", spy)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    loss = nn.MSELoss()
    partition(
        model,
        2,
        torch.randn(rows, 8),
        schedule="auto",
        batch_size=8,
        loss_fn=loss,
        target=torch.randn(rows, 8),
    )
    second = seen["second"]
    assert isinstance(second, tuple) and seen["sample_rows"] == rows
    other, other_rows = second
    assert other_rows == (8 if rows == 1 else 1) and len(other) == len(model)
    assert other.layers[0].output_shape[0] == other_rows  # profiled at those rows, target too
    assert other.loss is not None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"memory_limit": 0}, r"memory_limit \(0\) must be a finite number of bytes > 0 per rank"),
        ({"memory_limit": -5.0}, r"memory_limit \(-5.0\) must be a finite number of bytes > 0"),
        ({"memory_limit": [1e6, 0]}, r"memory_limit\[1\] \(0\) must be a finite number of bytes > 0"),
        ({"batch_size": 0}, r"batch_size \(0\) must be an integer >= 1"),
        (
            {"schedule": "interleaved-1f1b", "n_microbatches": "auto", "batch_size": 3},
            r"no schedule runs batch_size=3 on 2 ranks: .*multiple of the number of ranks",
        ),
        ({"n_microbatches": 3, "batch_size": 8}, r"n_microbatches \(3\) does not divide batch_size \(8\)"),
        ({"recompute": "always"}, r"recompute \('always'\) is searched per stage"),
        (
            {"memory_limit": 1e3},
            r"too small for every configuration: the weights, gradients and optimizer state alone",
        ),
    ],
)
def test_bad_input_is_refused(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"schedule": "auto", "batch_size": 8, "profile": synthetic(6)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        partition(_identity(6), 2, torch.zeros(4, 1), **args)  # type: ignore[arg-type]


# -- scaling ------------------------------------------------------------------------------------------


def test_scaling_is_linear_or_fits_a_per_call_overhead() -> None:
    prof = synthetic(3, rows=4)
    twice = scale_profile(prof, 4, 8)
    for a, b in zip(prof.layers, twice.layers, strict=True):
        assert b.forward_time == pytest.approx(2 * a.forward_time) and b.saved_bytes == 2 * a.saved_bytes
        assert b.param_bytes == a.param_bytes and b.output_shape[0] == 8
    assert twice.input_bytes == 2 * prof.input_bytes
    # two sizes: t(4) = t, t(8) = t + 1 ms -> overhead t - 1 ms, 0.25 ms per row
    other = Profile([
        LayerProfile(**{**lp.__dict__, "forward_time": lp.forward_time + 1e-3}) for lp in prof.layers
    ], "cpu", prof.graph, input_bytes=2 * prof.input_bytes)  # fmt: skip
    at16 = scale_profile(prof, 4, 16, second=(other, 8))
    for a, b in zip(prof.layers, at16.layers, strict=True):
        assert b.forward_time == pytest.approx(a.forward_time + 3e-3)
    # the allocator's rounding, a share of the bytes: fixed per tensor, so it weighs more at fewer rows
    rounded = dataclasses.replace(
        prof, device_memory=DeviceMemory(device="cuda:0", block_bytes=512, rounding=0.01)
    )
    assert scale_profile(rounded, 4, 1).device_memory.rounding == pytest.approx(0.04)
    assert scale_profile(rounded, 4, 8).device_memory == rounded.device_memory  # at more rows: kept (a bound)
    assert twice.device_memory == prof.device_memory == DeviceMemory()
    assert batch_rows((torch.zeros(5, 2), {"y": torch.zeros(5)})) == 5
    with pytest.raises(ValueError, match=r"disagree on their rows"):
        batch_rows((torch.zeros(5, 2), torch.zeros(4)))


def test_bytes_scale_as_a_fixed_part_and_a_part_per_row() -> None:
    # a transient of 100 bytes at 4 rows and 40 at 1 row: 20 per row and 20 fixed (a weight's gradient)
    prof = synthetic(2, rows=4)

    def at(transient: int, saved: int) -> Profile:
        layers = [
            dataclasses.replace(lp, backward_transient_bytes=transient, saved_bytes=saved)
            for lp in prof.layers
        ]
        return Profile(layers, "cpu", prof.graph)

    at4, at1 = at(100, 64), at(40, 16)
    # between the two sizes: the line through both (exact for c + s r, above a convex figure)
    assert [lp.backward_transient_bytes for lp in scale_profile(at4, 4, 2, (at1, 1)).layers] == [60, 60]
    assert [lp.saved_bytes for lp in scale_profile(at4, 4, 2, (at1, 1)).layers] == [32, 32]
    # beyond the larger: in proportion to it (c >= 0: never under), below the smaller: its figure
    assert [lp.backward_transient_bytes for lp in scale_profile(at4, 4, 8, (at1, 1)).layers] == [200, 200]
    # one profile: a transient never below its figure nor the rows' share of it; saved bytes per row
    alone = scale_profile(at4, 4, 1)
    assert [(lp.backward_transient_bytes, lp.saved_bytes) for lp in alone.layers] == [(100, 16)] * 2
    assert [lp.backward_transient_bytes for lp in scale_profile(at4, 4, 8).layers] == [200, 200]


def test_plan_with_modes_per_stage_prices_each_stage_by_its_mode() -> None:
    prof = synthetic(6, seed=7)
    per = partition(_identity(6), 2, None, profile=prof, n_microbatches=4, recompute=("always", "never"))
    both = {mode: partition(_identity(6), 2, None, profile=prof, n_microbatches=4, recompute=mode,)
            for mode in ("always", "never")}  # fmt: skip
    net = Options.make("time", 2, 1, None, None, None, None, 2.0)
    plans = {
        mode: predicted(prof, both[mode].replace(balance=per.balance), both[mode].build_schedule(), net)
        for mode in both
    }
    assert per.stages[0] == plans["always"].stages[0] and per.stages[1] == plans["never"].stages[1]
    assert recomputed_share("always", 4) == 1.0


@pytest.mark.parametrize("seed", [0, 1])
def test_the_pruning_bounds_never_exceed_a_simulated_step(seed: int) -> None:
    """Both bounds, checked on every config of the whole grid (a bound above a step would prune it)."""
    prof = synthetic(8, seed=seed, heavy=seed)
    links = dict(bandwidth=1e8, latency=1e-4, runtime=RUNTIME)
    grid = search(prof, 2, batch_size=8, sample_rows=4, memory_limit=None, prune=False, keep=10_000,
                  within=math.inf, **links)  # type: ignore[arg-type]  # fmt: skip
    assert len(grid.candidates) > 20
    for c in grid.candidates:
        m, v = c.n_microbatches, c.n_virtual
        scaled = scale_profile(prof, 4, 8 // m)
        plan = plan_for(scaled, c.balance, schedule=c.schedule, n_microbatches=m, n_virtual=v,
                        recompute=c.recompute, **links)  # type: ignore[arg-type]  # fmt: skip
        assert plan.step_time == c.step_time
        net = Options.make("time", 2, v, None, 1e8, 1e-4, None, 2.0, RUNTIME, entry(c.schedule).placement)
        split = entry(c.schedule).split_backward
        assert _balance_bound(scaled, plan, net, split) <= plan.step_time * (1 + 1e-12), c
        paths = _order_paths(plan.build_schedule())
        assert _paths_bound(scaled, plan, net, split, paths) <= plan.step_time * (1 + 1e-12), c
        sizes, _ = cut_groups(scaled.layers)
        assert m * _least_work(scaled, net, 2 * v, m, split, sizes) <= plan.step_time * (1 + 1e-12), c


# -- one memory model decides fit: what a run holds (the walk) ------------------------------------------


def _with_shares(prof: Profile, seed: int) -> Profile:
    """``prof`` with each layer saving some of its input and output (shared with its neighbours)."""
    rng = random.Random(seed)
    layers = [
        dataclasses.replace(
            lp,
            saved_input_bytes=rng.choice([0, lp.activation_bytes // 2]),
            saved_output_bytes=rng.choice([0, lp.activation_bytes]),
        )
        for lp in prof.layers
    ]
    return dataclasses.replace(prof, layers=layers)


@pytest.mark.parametrize("seed", range(3))
def test_every_plan_returned_under_a_limit_fits_by_the_walk(seed: int) -> None:
    rng = random.Random(seed)
    p = rng.choice([2, 3])
    prof = _with_shares(synthetic(rng.randint(2 * p + 1, 10), seed=seed), seed)
    kw = dict(batch_size=rng.choice([4, 6, 8]), sample_rows=4, bandwidth=1e8, latency=1e-4)
    free = search(prof, p, memory_limit=None, **kw)  # type: ignore[arg-type]
    least = _least(prof, p, **kw)
    for limit in (least, (least + max(rank_peaks(free))) / 2):
        plan = search(prof, p, memory_limit=limit, **kw)  # type: ignore[arg-type]
        assert max(plan.rank_peaks) <= limit
        assert all(max(c.peak_bytes) <= limit for c in plan.candidates)
        name = rng.choice([s for s in SCHEDULES if entry(s).min_virtual == 1])
        m = plan.n_microbatches
        modes = tuple(rng.choice(RECOMPUTE_MODES) for _ in range(p))
        scaled = scale_profile(prof, 4, int(kw["batch_size"]) // m)
        opts = dict(profile=scaled, schedule=name, n_microbatches=m, recompute=modes)
        try:
            fixed = partition(_identity(len(prof.layers)), p, None, memory_limit=limit, **opts)  # type: ignore[arg-type]
        except ValueError as err:  # too small: at the limit it names, the plan fits by the walk
            text = str(err).split("the smallest limit that fits is ")[1].split(";")[0]
            fixed = partition(_identity(len(prof.layers)), p, None, memory_limit=float(text), **opts)  # type: ignore[arg-type]
            limit = float(text)
        assert max(fixed.rank_peaks) <= limit


# -- the static-bytes fit check prunes a group before its schedule is built ----------------------------


def test_a_group_whose_static_bytes_exceed_the_rank_limit_over_v_is_never_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The module's promise: "a group where no balance fits even the static bytes ... is skipped
    before its schedule is built", each of its stages getting its rank's limit / v. One layer
    holds static bytes H (weights, gradients, optimizer state) with H < limit < 2 H: 1f1b (v = 1)
    fits, while no interleaved-1f1b group (v = 2 .. 4, a stage limit of limit / v < H) may build
    its schedule; all its configs count as pruned by fit, none is simulated. The check is no time
    bound: it holds with ``prune=False`` too, which here builds every group it lets through. A limit
    without the division by v (H <= limit) would let those groups through to be built, then rejected."""
    from partitioner import auto
    from partitioner._planning import least_memory

    heavy = 3
    base = synthetic(8, seed=8)
    layers = list(base.layers)
    layers[heavy] = dataclasses.replace(layers[heavy], param_bytes=16 << 20)  # static >> the rest
    prof = dataclasses.replace(base, layers=layers)
    static = least_memory(prof, 2.0)
    assert static[heavy] > 4 * sum(x for i, x in enumerate(static) if i != heavy)
    built: list[tuple[str, int]] = []
    unchecked = auto.unchecked

    def spy(name: str, p: int, m: int, v: int) -> object:
        built.append((name, v))
        return unchecked(name, p, m, v)

    monkeypatch.setattr(auto, "unchecked", spy)
    # prune=False: no time bound skips a group, so every group the fit check lets through is built
    kw = dict(batch_size=4, sample_rows=4, n_microbatches=4, schedules=["1f1b", "interleaved-1f1b"],
              prune=False, within=math.inf, keep=100)  # fmt: skip
    roomy = search(prof, 2, memory_limit=1e12, **kw)  # type: ignore[arg-type]
    assert sorted(built) == [("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                             ("interleaved-1f1b", 4)]  # fmt: skip
    assert roomy.search is not None and roomy.search.pruned_fit == 0

    built.clear()
    limit = 1.5 * static[heavy]
    plan = search(prof, 2, memory_limit=limit, **kw)  # type: ignore[arg-type]
    assert plan.schedule == "1f1b" and _fits(plan, limit)
    assert built == [("1f1b", 1)], built  # no interleaved schedule built: its static bytes do not fit
    stats = plan.search
    assert stats is not None
    assert stats.grid == 4 * 4 and stats.pruned_fit == 3 * 4, stats  # v = 2, 3, 4: 4 configs each
    assert all(c.schedule == "1f1b" for c in plan.candidates)
