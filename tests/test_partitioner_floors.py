"""``partitioner._floors``: every floor at most the exact smallest limit it stands for (many schedules,
m, v, p, recomputation modes), the static refusal before any schedule is built, and the auto search's
pruning naming the same smallest fit as the whole grid."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
from torch import nn

from partitioner import LayerProfile, Profile, layer_graph, partition
from partitioner._balance import Modes
from partitioner._floors import (
    _ComputeOnly,
    group_floor,
    refuse_below_static,
    static_fits,
    static_floor,
    static_row,
)
from partitioner._options import Options
from partitioner.auto import search
from partitioner.costs import cut_groups
from pipeline.runtime.step.recompute import RECOMPUTE_MODES
from pipeline.schedules.peaks import coefficients
from pipeline.schedules.registry import entry
from pipeline.schedules.schedule import SCHEDULES, Schedule, schedule_options, unchecked

partition_module = sys.modules["partitioner.partition"]


def _profile(n: int, seed: int) -> Profile:
    """n layers of random static bytes, activations, saved graphs and transients."""
    rng = random.Random(seed)
    layers = []
    for i in range(n):
        act = rng.randint(1, 8) * 4096
        layers.append(
            LayerProfile(
                i,
                f"l{i}",
                "Linear",
                rng.uniform(1e-3, 3e-3),
                rng.uniform(2e-3, 6e-3),
                10,
                rng.randint(1, 16) * 8192,
                act,
                rng.randint(0, 3) * act,
                (4, 256),
                "float32",
                weight_time=1e-3,
                input_time=1e-3,
                forward_transient_bytes=rng.randint(0, 2) * act,
                backward_transient_bytes=rng.randint(0, 3) * act,
            )
        )
    return Profile(layers, "cpu", layer_graph(layers), input_bytes=4096)


def _groups(n: int, p: int) -> list[tuple[str, int, int]]:
    out = []
    for name in SCHEDULES:
        for v in entry(name).virtual_counts(n // p):
            for m in (1, 2, 3, 4, 2 * p):
                try:
                    schedule_options(name, p, m, v)
                except ValueError:
                    continue
                out.append((name, v, m))
    return out


def _net(prof: Profile, name: str, p: int, v: int, limit: float | list[float]) -> Options:
    net = Options.make("time", p, v, None, None, None, limit, 2.0, None, entry(name).placement)
    return net.measured(prof.device_memory)


def _compute_only(sched: Schedule) -> _ComputeOnly:
    every = frozenset(range(sched.n_ranks))
    return _ComputeOnly(f"{sched.name}/compute", sched.n_stages, sched.n_ranks, sched.n_microbatches,
                        sched.split_backward, sched.compute, sched.placement, every)  # fmt: skip


@pytest.mark.parametrize(("p", "seed"), [(2, 0), (3, 1), (4, 2)])
def test_the_compute_walk_holds_at_most_what_the_program_walk_holds(p: int, seed: int) -> None:
    # the floor's coefficients are the walk's own rule on the program without its posts and frees
    rng = random.Random(seed)
    for name, v, m in _groups(4 * p, p):
        sched = unchecked(name, p, m, v)
        for modes in [*RECOMPUTE_MODES, tuple(rng.choice(RECOMPUTE_MODES) for _ in range(p * v))]:
            low, exact = coefficients(_compute_only(sched), modes), coefficients(sched, modes)
            for s, (a, b) in enumerate(zip(low, exact, strict=True)):
                assert all(a[f] <= b[f] for f in a), (name, v, m, modes, s, a, b)


@pytest.mark.parametrize(
    ("p", "seed", "per_rank"), [(2, 0, False), (3, 1, False), (4, 2, False), (2, 3, True)]
)
def test_every_floor_is_at_most_the_exact_smallest_limit(p: int, seed: int, per_rank: bool) -> None:
    n = 4 * p
    prof = _profile(n, seed)
    sizes, _ = cut_groups(prof.layers, prof.cut_reasons)
    limit: float | list[float] = [1.0 + r for r in range(p)] if per_rank else 1.0
    checked = 0
    for name, v, m in _groups(n, p):
        net = _net(prof, name, p, v, limit)
        sched = unchecked(name, p, m, v)
        k = p * v
        every = Modes.build(prof, sched, net, sizes, [list(RECOMPUTE_MODES)] * k).smallest()
        floor = group_floor(prof, sched, net, sizes, RECOMPUTE_MODES)
        ends = group_floor(prof, sched, net, sizes, RECOMPUTE_MODES, ends=True)
        static = static_floor(prof, net, k, sizes)
        assert static <= ends <= floor <= every, (name, v, m, static, ends, floor, every)
        for mode in RECOMPUTE_MODES:  # each mode alone needs at least the group's floor
            alone = Modes.build(prof, sched, net, sizes, [[mode]] * k).smallest()
            assert every <= alone and floor <= alone, (name, v, m, mode)
            assert group_floor(prof, sched, net, sizes, [mode]) <= alone, (name, v, m, mode)
        checked += 1
    assert checked >= 8


def _refused(call: Callable[[], object]) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def test_below_the_static_bytes_partition_refuses_before_building_its_schedule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n, p = 12, 3
    prof = _profile(n, 5)
    model = nn.Sequential(*[nn.Identity() for _ in range(n)])
    opts: dict[str, Any] = {"profile": prof, "schedule": "1f1b", "n_microbatches": 6}
    sizes, _ = cut_groups(prof.layers, prof.cut_reasons)
    floor = static_floor(prof, _net(prof, "1f1b", p, 1, 1.0), p, sizes)

    def no_schedule(*args: object) -> None:
        raise AssertionError("a schedule was built for a limit below the static bytes")

    monkeypatch.setattr(partition_module, "unchecked", no_schedule)
    below = math.nextafter(floor, 0.0)
    text = _refused(lambda: partition(model, p, None, memory_limit=below, **opts))
    assert "fits even the weights, gradients, optimizer state and buffers alone" in text
    assert f"a limit of at least {floor!r} bytes per rank" in text
    with pytest.raises(AssertionError, match="a schedule was built"):  # at the floor: on to the walk
        partition(model, p, None, memory_limit=floor, **opts)
    monkeypatch.undo()
    text = _refused(lambda: partition(model, p, None, memory_limit=floor, **opts))
    exact = float(text.split("the smallest limit that fits is ")[1].split(";")[0])
    assert exact > floor
    assert max(partition(model, p, None, memory_limit=exact, **opts).rank_peaks) <= exact


@pytest.mark.parametrize(("n", "p", "batch", "seed"), [(8, 2, 4, 0), (9, 3, 6, 1), (12, 4, 8, 2)])
def test_the_pruned_search_names_the_smallest_fit_of_the_whole_grid(
    n: int, p: int, batch: int, seed: int
) -> None:
    prof = _profile(n, seed)
    kw: dict[str, Any] = {"batch_size": batch, "sample_rows": 4, "bandwidth": 1e8, "latency": 1e-4}
    static = max(
        static_floor(prof, _net(prof, "1f1b", p, 1, 1.0), p, cut_groups(prof.layers, prof.cut_reasons)[0]),
        1.0,
    )
    for limit in (static, static * 1.05):
        pruned = _refused(functools.partial(search, prof, p, memory_limit=limit, **kw))
        whole = _refused(functools.partial(search, prof, p, memory_limit=limit, prune=False, **kw))
        assert "the smallest memory_limit that fits is" in whole
        assert pruned == whole


@pytest.mark.parametrize(("p", "seed", "per_rank"), [(2, 0, False), (3, 1, False), (4, 2, True)])
def test_the_every_configuration_static_check_refuses_only_what_no_split_fits(
    p: int, seed: int, per_rank: bool
) -> None:
    # one rule, two strengths: with k None it is what every k's exact check implies
    prof = _profile(5 * p, seed)
    big = dataclasses.replace(prof.layers[p], param_bytes=sum(lp.param_bytes for lp in prof.layers))
    prof = dataclasses.replace(prof, layers=[*prof.layers[:p], big, *prof.layers[p + 1 :]])  # one outweighs
    sizes, _ = cut_groups(prof.layers, prof.cut_reasons)
    row = static_row(prof, _net(prof, "1f1b", p, 1, 1.0), sizes)
    total, largest = row[-1], max(b - a for a, b in itertools.pairwise(row))
    refused = passed = 0
    fractions = [largest * f for f in (0.5, 0.9, 0.99, 1.0, 1.01, 1.2, 2.0)]
    for x in fractions + [total / p * f for f in (0.99, 1.0, 1.5)]:
        limit: float | list[float] = [x * (1 + r / p) for r in range(p)] if per_rank else x
        every = _net(prof, "1f1b", p, 1, limit)
        some_k = any(
            static_fits(prof, _net(prof, name, p, v, limit), p * v, sizes)
            for name, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-v", 2))
        )
        try:
            refuse_below_static(prof, every, None, sizes)
        except ValueError as err:
            assert not some_k, (x, str(err))
            text = str(err)
            assert text.startswith(f"memory_limit ({every.memory_limit if per_rank else x!r})"), text
            assert "too small for every configuration" in text and "raise memory_limit" in text
            assert ("bytes per rank" in text) != per_rank and f"{total:.4g} bytes over {p} ranks" in text
            refused += 1
        else:
            passed += 1
        if not per_rank and x < max(total / p, largest):  # what it names is what it needs
            need = re.escape(f"at least {max(total / p, largest):.4g} bytes per rank")
            with pytest.raises(ValueError, match=need):
                refuse_below_static(prof, every, None, sizes)
    assert refused and passed
    assert largest > total / p  # the largest group, not only the sum, decides some of them


def test_the_auto_search_refuses_below_the_static_bytes_by_the_same_rule() -> None:
    p, prof = 3, _profile(12, 4)
    sizes, _ = cut_groups(prof.layers, prof.cut_reasons)
    every = _net(prof, "1f1b", p, 1, 1000.0)
    with pytest.raises(ValueError) as rule:
        refuse_below_static(prof, every, None, sizes)
    with pytest.raises(ValueError) as auto:
        search(prof, p, batch_size=4, sample_rows=4, memory_limit=1000.0)
    assert str(auto.value) == str(rule.value)
