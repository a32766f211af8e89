"""Timing noise (``partitioner.noise``): the plan a noisy profile gives is the noise-free one.

    # l: layer, q: one of a layer's times (forward, backward, input, weight)

The clock is faked: ``_measure.one_sample`` (one timed run of a layer) is replaced by one that
returns each layer's set time (``layer.base``) times a small jitter, and for the disturbed layers
the disturbance a shared machine adds: outliers (one sample in five 100x slower) or a slowdown
in every sample. Each run draws from its own seed; every run must plan what the noise-free one does.
"""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import _measure, noise
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

    def use(seed: int, disturbed: dict[int, Disturb]) -> None:
        rng = random.Random(seed)

        def sample(fn: Any, x: Any, params: Any, first: bool, sync: Any) -> _measure.Sample:
            index, base = fn.fake
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


def _set_times(model: nn.Sequential, base: list[tuple[float, float, float, float]]) -> None:
    for index, (layer, times) in enumerate(zip(model, base, strict=True)):
        layer.fake = (index, times)  # copied into the working copy the profile times


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
    model, sample = _model([16] * 9)
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
        assert noisy.noisy_layers == [5] and not noisy.trusted
        five = noisy.layers[5]
        assert five.noisy and five.error > noise.NOISE_LIMIT and five.samples == noise.MAX_REPEAT_FACTOR * 10
        assert five.timing is not None and five.timing.forward.measured >= 1.5 * base[5][0]
        assert five.forward_time == pytest.approx(base[5][0], rel=0.03)  # its flops' prediction
        assert five.timing.forward.predicted == pytest.approx(base[5][0], rel=0.01)
        (message,) = warned
        assert "layer 5 (5: Linear)" in message and "repeat=N) (now 10)" in message
        assert "cost='flops'" in message and "quieter machine" in message
