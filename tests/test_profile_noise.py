"""Timing noise (``partitioner.noise``): the plan a noisy profile gives is the noise-free one.

    # l: layer, q: one of a layer's times (forward, backward, input, weight)

The clock is faked: ``_measure.one_sample`` (one timed run of a layer) is replaced by one that
returns each layer's set times (``_set_times``) times a small jitter, and for the disturbed layers
the disturbance a shared machine adds: outliers (one sample in five 100x slower) or a slowdown
in every sample. Each run draws from its own seed; every run must plan what the noise-free one does.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import _measure, noise
from partitioner.figures import LayerProfile, LayerTiming, TimeEstimate
from partitioner.partition import partition
from partitioner.profile import Profile, profile

Disturb = Callable[[random.Random], float]  # the factor one sample of a disturbed layer is slowed by


def _outliers(rng: random.Random) -> float:
    return 100.0 if rng.random() < 0.2 else 1.0


def _always(rng: random.Random) -> float:
    return rng.uniform(1.5, 4.0)  # never undisturbed: no sample finds the layer's own time


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int, dict[int, Disturb]], None]]:
    """``use(seed, disturbed)``: from now on a sample of layer l takes ``base`` x (1 + up to 1 %)
    x ``disturbed[l](rng)`` for each of its times; the layer is not run at all. Sampling stops when
    the times settle or at the cap on samples, not on the (real) time budget."""
    monkeypatch.setattr(noise, "BUDGET_FLOOR_S", 60.0)
    _FAKES.clear()

    def use(seed: int, disturbed: dict[int, Disturb]) -> None:
        rng = random.Random(seed)

        def sample(fn: Any, x: Any, params: Any, first: bool, sync: Any) -> _measure.Sample:
            # the working copy shares the layer's parameters' storage: that names the layer
            index, base = next(_FAKES[p.data_ptr()] for p in fn.parameters() if p.data_ptr() in _FAKES)
            times = [t * (1.0 + 0.01 * rng.random()) for t in base]
            if index in disturbed:
                times = [t * disturbed[index](rng) for t in times]
            return times[0], times[1], times[2], times[3]

        monkeypatch.setattr(_measure, "one_sample", sample)

    yield use


def _model(widths: list[int]) -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))
    return model, torch.randn(8, widths[0])


_FAKES: dict[int, tuple[int, tuple[float, float, float, float]]] = {}  # weight's storage -> layer, times


def _set_times(layers: Iterable[nn.Module], base: Sequence[tuple[float, float, float, float]]) -> None:
    for index, (layer, times) in enumerate(zip(layers, base, strict=True)):
        _FAKES[next(layer.parameters()).data_ptr()] = (index, times)


def _balance(model: nn.Sequential, sample: torch.Tensor, prof: Profile) -> list[int]:
    return partition(model, 3, sample, profile=prof).balance


def _best_bottlenecks(costs: list[float]) -> list[tuple[float, tuple[int, int, int]]]:
    """Every split of ``costs`` into 3 stages by its bottleneck, best first (an oracle)."""
    n = len(costs)
    found = [
        (max(sum(costs[:a]), sum(costs[a:b]), sum(costs[b:])), (a, b - a, n - b))
        for a in range(1, n - 1)
        for b in range(a + 1, n)
    ]
    return sorted(found)


def _profile_quietly(model: nn.Module, sample: torch.Tensor) -> tuple[Profile, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = profile(model, sample)
    return prof, [str(w.message) for w in caught if issubclass(w.category, noise.NoisyProfileWarning)]


def test_outliers_change_neither_the_times_nor_the_plan(fake_clock: Any) -> None:
    # forward times (x 0.1 ms) whose best 3-stage split, [2, 3, 3] at 10, beats the next by 20 %
    forward = [4, 4, 5, 2, 3, 2, 6, 2]
    base = [(1e-4 * f, 2e-4 * f, 0.0 if i == 0 else 1e-4 * f, 1e-4 * f) for i, f in enumerate(forward)]
    ranked = _best_bottlenecks([3.0 * f for f in forward])
    assert ranked[0][1] == (2, 3, 3) and ranked[1][0] >= 1.2 * ranked[0][0]
    model, sample = _model([16 + k for k in range(9)])  # of other shapes: each is timed (partitioner._reuse)
    _set_times(model, base)
    fake_clock(0, {})
    quiet, warned = _profile_quietly(model, sample)
    assert not warned and quiet.trusted
    expected = _balance(model, sample, quiet)
    assert expected == [2, 3, 3]
    disturbed = {index: _outliers for index in (1, 2, 3, 6)}  # on both sides of each boundary
    for seed in range(1, 7):
        fake_clock(seed, disturbed)
        noisy, warned = _profile_quietly(model, sample)
        assert _balance(model, sample, noisy) == expected, seed
        for lp, (f, b, _, _) in zip(noisy.layers, base, strict=True):
            # the least-disturbed sample (jitter: up to 1 %), a stable layer barely moved by the prior
            assert lp.forward_time == pytest.approx(f, rel=0.01), (seed, lp.index)
            assert lp.backward_time == pytest.approx(b, rel=0.01), (seed, lp.index)
            assert lp.timing is not None and lp.timing.forward.spread >= 0.0
        assert not warned and noisy.trusted  # outliers leave a clear floor: nothing to warn about
        assert max(lp.spread for lp in noisy.layers) > 1.0  # yet they were there, and are on record


def test_a_layer_disturbed_in_every_sample_leans_on_its_flops(fake_clock: Any) -> None:
    # times that flops predict exactly (one rate per time); layer 5, slowed in every sample by 1.5x to
    # 4x, would move the plan were its measured time used
    model, sample = _model([16, 16, 16, 32, 32, 16, 48, 16, 16])
    fake_clock(0, {})
    _set_times(model, [(1.0, 1.0, 1.0, 1.0)] * len(model))
    counted = profile(model, sample, warmup=0, repeat=1).layers
    rates = (1e-9, 2e-9, 1.5e-9, 0.8e-9)
    base = [
        tuple(
            r * n
            for r, n in zip(
                rates, (lp.flops, lp.backward_flops, lp.input_flops, lp.weight_flops), strict=True
            )
        )
        for lp in counted
    ]
    _set_times(model, base)  # type: ignore[arg-type]
    costs = [f + b for f, b, _, _ in base]
    assert (
        _best_bottlenecks(costs)[0][1]
        != _best_bottlenecks([c * (1.5 if index == 5 else 1.0) for index, c in enumerate(costs)])[0][1]
    )
    quiet, warned = _profile_quietly(model, sample)
    assert not warned
    expected = _balance(model, sample, quiet)
    assert tuple(expected) == _best_bottlenecks(costs)[0][1]
    for seed in range(1, 7):
        fake_clock(seed, {5: _always})
        noisy, warned = _profile_quietly(model, sample)
        assert _balance(model, sample, noisy) == expected, seed
        assert noisy.noisy_layers == [5] and not noisy.trusted and noisy.from_flops == []  # one: blended
        five = noisy.layers[5]
        assert five.noisy and five.error > noise.NOISE_LIMIT and five.samples == noise.MAX_REPEAT_FACTOR * 10
        assert five.timing is not None and five.timing.forward.measured >= 1.5 * base[5][0]
        assert five.forward_time == pytest.approx(base[5][0], rel=0.03)  # its flops' prediction
        assert five.timing.forward.predicted == pytest.approx(base[5][0], rel=0.01)
        (message,) = warned
        assert "layer 5 (5: Linear)" in message and "repeat=N) (now 10)" in message
        assert "cost='flops'" in message and "quieter machine" in message


def _flop_times(model: nn.Sequential, sample: torch.Tensor) -> list[tuple[float, float, float, float]]:
    """Per layer, times that its flops predict exactly (one rate per time), set on the fake clock."""
    _set_times(model, [(1.0, 1.0, 1.0, 1.0)] * len(model))
    counted = profile(model, sample, warmup=0, repeat=1).layers
    rates = (1e-9, 2e-9, 1.5e-9, 0.8e-9)
    flops = [(lp.flops, lp.backward_flops, lp.input_flops, lp.weight_flops) for lp in counted]
    base = [(rates[0] * f, rates[1] * b, rates[2] * i, rates[3] * w) for f, b, i, w in flops]
    _set_times(model, base)
    return base


def test_a_profile_noisy_in_most_of_its_time_is_priced_by_its_flops(fake_clock: Any) -> None:
    model, sample = _model([16, 16, 16, 32, 32, 16, 48, 16, 16])
    fake_clock(0, {})
    base = _flop_times(model, sample)
    big = (3, 4, 5, 6)  # most of the time
    assert sum(base[k][0] + base[k][1] for k in big) > 0.5 * sum(f + b for f, b, _, _ in base)
    fake_clock(1, dict.fromkeys(big, _always))
    prof, warned = _profile_quietly(model, sample)
    assert prof.noisy_layers == list(big) and prof.from_flops == list(range(len(model)))
    rate = prof.layers[0].forward_time / prof.layers[0].flops
    for lp in prof.layers:  # one rate for every time of every layer: the flops' balance, in seconds
        assert lp.timing is not None and lp.forward_time == lp.timing.forward.predicted
        for got, flops in ((lp.forward_time, lp.flops), (lp.backward_time, lp.backward_flops),
                           (lp.input_time, lp.input_flops), (lp.weight_time, lp.weight_flops)):  # fmt: skip
            assert got == pytest.approx(rate * flops)
    assert _balance(model, sample, prof) == partition(model, 3, sample, profile=prof, cost="flops").balance
    (message,) = warned
    assert "4 of 8 layers are too noisy" in message and "every time is what its flops predict" in message
    assert "\n" not in message and len(message) < 400, message


def test_the_time_budget_leaves_later_layers_to_their_flops(fake_clock: Any) -> None:
    model, sample = _model([16, 16, 16, 32, 32, 16, 48, 16, 16])
    fake_clock(0, {})
    base = _flop_times(model, sample)
    with pytest.warns(noise.NoisyProfileWarning) as caught:
        prof = profile(model, sample, budget=1e-9)  # spent at once: the first layer alone is timed
    (message,) = [str(w.message) for w in caught]
    assert "time budget (1e-09 s) ran out at layer 1 (1)" in message and "budget=None" in message
    assert prof.from_flops == list(range(1, len(model))) and prof.layers[0].samples >= 10
    timed = prof.layers[0]
    assert timed.timing is not None and timed.forward_time == pytest.approx(
        base[0][0], rel=0.01
    )  # as measured
    rate = (timed.timing.forward.measured + timed.timing.backward.measured) / (
        timed.flops + timed.backward_flops
    )
    for lp in prof.layers[1:]:  # untimed, at the first layer's seconds per flop
        assert lp.samples == 0 and lp.timing is not None and lp.timing.forward.measured == 0.0
        for got, flops in ((lp.forward_time, lp.flops), (lp.backward_time, lp.backward_flops),
                           (lp.input_time, lp.input_flops), (lp.weight_time, lp.weight_flops)):  # fmt: skip
            assert flops > 0 and got == pytest.approx(rate * flops), lp.index
    fake_clock(1, {0: _always})  # never settles: the deadline stops it at repeat samples, not 10 x
    with pytest.warns(noise.NoisyProfileWarning):
        assert profile(model, sample, budget=1e-9).layers[0].samples == 10
    for bad in (0, -1.0, "5", True):
        with pytest.raises(ValueError, match=rf"budget \({bad!r}\) must be a number of seconds > 0"):
            profile(model, sample, budget=bad)  # type: ignore[arg-type]


def test_the_statistic_the_spread_and_the_floor_gap() -> None:
    samples = [1.3, 1.0, 100.0, 1.2, 1.1]  # one outlier, 100x
    est = noise.estimate(samples)
    assert est.measured == est.value == 1.0  # the least-disturbed sample; the mean would be 20.9
    assert est.spread == pytest.approx((1.3 - 1.1) / 1.2)  # quartiles 1.1 and 1.3, median 1.2
    assert est.error == pytest.approx((1.2 - 1.0) / 1.0)  # the median's distance above the floor
    assert noise.floor_gap([2.0, 2.0, 2.0, 9.0]) == 0.0  # most samples on the floor
    assert noise.floor_gap([2.0, 4.0, 5.0, 9.0]) == pytest.approx(1.25)  # no floor: every sample slowed
    assert noise.spread([1.0, 5.0]) == 0.0 and noise.floor_gap([1.0, 5.0]) == 0.0  # too few to judge
    assert noise.estimate([0.0, 0.0, 0.0]) == TimeEstimate()  # a part that does not exist (no parameters)


def test_repeats_adapt_until_the_floor_is_found() -> None:
    floor = [1.0, 1.01, 1.02, 1.0, 1.01]
    assert not noise.settled(floor[:4], repeat=5, spent=0.0, first=1.0)  # fewer than asked for
    assert noise.settled(floor, repeat=5, spent=0.0, first=1.0)
    assert not noise.settled([1.5, 1.5, 1.5, 1.0, 1.0, 1.0], repeat=5, spent=0.0, first=1.0)  # still dropping
    assert not noise.settled([1.0, 3.0, 2.0, 4.0, 2.5], repeat=5, spent=0.0, first=1.0)  # no floor yet
    wild = [1.0, 3.0, 2.0, 4.0, 2.5] * 10
    assert noise.settled(wild, repeat=5, spent=0.0, first=1.0)  # the cap: MAX_REPEAT_FACTOR x repeat
    assert len(wild) == noise.MAX_REPEAT_FACTOR * 5 and not noise.settled(wild[:-1], 5, 0.0, 1.0)
    # the budget: as long again as the first samples took, at least BUDGET_FLOOR_S
    assert noise.settled(wild[:6], repeat=5, spent=2.0, first=1.0)
    assert not noise.settled(wild[:6], repeat=5, spent=1.9, first=1.0)
    assert noise.settled(wild[:6], repeat=5, spent=0.001 + noise.BUDGET_FLOOR_S, first=0.001)
    assert noise.settled([1.0, 9.0], repeat=2, spent=0.0, first=1.0)  # repeat=2: nothing to judge by


def _layer(index: int, kind: str, flops: int, measured: float, error: float) -> LayerProfile:
    est = TimeEstimate(measured=measured, error=error, value=measured)
    return LayerProfile(
        index, str(index), kind, measured, 0.0, flops, 0, 0, 0, (1,), "float32",
        error=error, noisy=error > noise.NOISE_LIMIT, timing=LayerTiming(forward=est),
    )  # fmt: skip


def test_the_flop_prior_moves_noisy_times_by_their_precision() -> None:
    # three stable Linear layers at 1, 1.1 and 0.9 ns per flop; a Conv at 5 ns; two noisy layers
    stable = [_layer(0, "Linear", 1000, 1e-6, 0.0), _layer(1, "Linear", 2000, 2.2e-6, 0.05)]
    stable += [_layer(2, "Linear", 1000, 0.9e-6, 0.02), _layer(3, "Conv", 1000, 5e-6, 0.01)]
    noisy = [_layer(4, "Linear", 3000, 9e-6, 0.5), _layer(5, "Norm", 1000, 9e-6, 0.5)]
    layers, _, rates = noise.with_prior([*stable, *noisy])
    logs = sorted(math.log(t) for t in (1e-9, 1.1e-9, 0.9e-9, 5e-9))
    assert rates["forward"] == pytest.approx(math.exp((logs[1] + logs[2]) / 2))  # all layers' median
    assert "backward" not in rates  # no layer has backward flops: no prior
    assert layers[0].forward_time == 1e-6  # error 0: exactly as measured
    for lp, group in ((layers[4], [1e-9, 1.1e-9, 0.9e-9]), (layers[5], [1e-9, 1.1e-9, 0.9e-9, 5e-9])):
        # layer 4: its kind's prior (three Linear layers); layer 5, alone of its kind: all layers'
        centre = statistics_median([math.log(r) for r in group])
        sd = max(noise.PRIOR_FLOOR, 1.4826 * statistics_median([abs(math.log(r) - centre) for r in group]))
        predicted = math.exp(centre) * lp.flops
        w_m, w_p = 1 / 0.5**2, 1 / sd**2
        want = math.exp((w_m * math.log(9e-6) + w_p * math.log(predicted)) / (w_m + w_p))
        assert lp.timing is not None and lp.timing.forward.predicted == pytest.approx(predicted)
        assert lp.forward_time == pytest.approx(want) and lp.timing.forward.measured == 9e-6
    assert layers[4].forward_time < 4e-6  # 3 ns per flop measured, about 1 predicted: near the prior
    # fewer than MIN_STABLE stable layers: no prior at all
    alone, _, none = noise.with_prior([stable[3], *noisy])
    assert none == {} and [lp.forward_time for lp in alone] == [5e-6, 9e-6, 9e-6]


def test_copies_add_no_evidence_to_the_prior() -> None:
    # one stable layer measured and two copies of it (profiled once): one layer's evidence, too few for
    # a prior (MIN_STABLE), so the noisy layer keeps its measurement
    block = _layer(0, "Block", 1000, 1e-6, 0.01)
    copies = [dataclasses.replace(block, index=k, same_as=0) for k in (1, 2)]
    layers, _, rates = noise.with_prior([block, *copies, _layer(3, "Head", 1000, 9e-6, 0.5)])
    assert rates == {} and layers[3].forward_time == 9e-6
    assert [lp.forward_time for lp in layers[:3]] == [1e-6] * 3


def statistics_median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def test_the_warning_names_the_noisy_layers_and_the_fixes() -> None:
    layers = [
        _layer(0, "Linear", 10, 1e-6, 0.01),
        _layer(3, "GELU", 10, 1e-6, 0.4),
        _layer(-1, "loss", 10, 1e-6, 0.3),
    ]
    with pytest.warns(noise.NoisyProfileWarning) as caught:
        assert noise.warn_noisy(layers, repeat=7) == [3, -1]
    (message,) = [str(w.message) for w in caught]
    assert "2 of 3 layers are too noisy to trust" in message
    assert "layer 3 (3: GELU) (floor gap 40%" in message and "the loss (floor gap 30%" in message
    assert "repeat=N) (now 7)" in message and "cost='flops'" in message and "quieter machine" in message
    many = [_layer(k, "GELU", 10, 1e-6, 0.4) for k in range(40)]
    with pytest.warns(noise.NoisyProfileWarning) as caught:
        noise.warn_noisy(many, repeat=7)
    (message,) = [str(w.message) for w in caught]  # one short line however many layers are noisy
    assert "40 of 40 layers" in message and "and 37 more" in message and len(message) < 400, message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert noise.warn_noisy(layers[:1], repeat=7) == []


def test_a_traced_model_is_trusted_the_same_way_and_the_figures_serialise(fake_clock: Any) -> None:
    class Net(nn.Module):  # not an nn.Sequential: traced, one layer per submodule
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16 + k, 17 + k) for k in range(5))  # each timed

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    net, sample = Net(), torch.randn(4, 16)
    size = [(16 + k) * (17 + k) / (18 * 19) for k in range(5)]  # times as their flops: each the others' prior
    _set_times(net.blocks, [(1e-4 * r, 2e-4 * r, 1e-4 * r, 1e-4 * r) for r in size])
    fake_clock(3, {2: _always})
    with pytest.warns(noise.NoisyProfileWarning, match=r"layer 2 \(blocks\.2: Linear\)"):
        prof = profile(net, sample)
    assert prof.traced is not None and prof.noisy_layers == [2] and not prof.trusted
    assert prof.layers[2].forward_time == pytest.approx(1e-4, rel=0.03)  # its four siblings' time
    record = json.loads(json.dumps([dataclasses.asdict(lp) for lp in prof.layers]))
    assert record[2]["noisy"] and record[2]["timing"]["forward"]["measured"] >= 1.5e-4
    assert (
        record[0]["samples"] >= 10
        and record[0]["timing"]["backward"]["value"] == prof.layers[0].backward_time
    )
