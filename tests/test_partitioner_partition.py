"""``partitioner.partition`` on real small models: cost modes, memory model, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from partitioner import partition, plan_for, profile, solve
from partitioner.memory import in_flight
from pipeline.reference.models import gpt, mlp


@pytest.fixture(scope="module")
def small_gpt() -> tuple[nn.Sequential, torch.Tensor, object]:
    torch.manual_seed(0)
    model, sample = gpt(vocab_size=64, width=32, n_layers=4, n_heads=2, max_seq_len=16, batch_size=2)
    return model, sample, profile(model, sample, warmup=1, repeat=2)


def test_cost_modes(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, sample, prof = small_gpt
    uni = partition(model, 3, sample, cost="uniform", profile=prof)
    assert uni.balance == [3, 3, 1] and uni.bottleneck == 3.0  # ties: earlier stages take more
    params = partition(model, 2, sample, cost="params", profile=prof)
    assert params.balance == solve([float(lp.param_bytes) for lp in prof.layers], 2)
    flops = partition(model, 2, sample, cost="flops", profile=prof)
    assert flops.balance == solve([float(lp.flops) for lp in prof.layers], 2)
    t = partition(model, 2, sample, cost="time", profile=prof)
    assert t.balance == solve([lp.forward_time + lp.backward_time for lp in prof.layers], 2)
    assert t.bottleneck == max(s.cost for s in t.stages)
    assert t.stages[0].sent_bytes == prof.layers[t.balance[0] - 1].activation_bytes
    assert t.prediction == "simulator" and t.step_time > 0


def test_memory_model_and_limit(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, sample, prof = small_gpt
    plan = partition(model, 2, sample, schedule="gpipe", n_microbatches=4, cost="uniform", profile=prof)
    for st in plan.stages:
        lps = prof.layers[st.start : st.stop]
        want = sum(4 * lp.param_bytes + 4 * lp.saved_bytes for lp in lps)  # (1 + 1 + 2) x params, m = 4
        assert st.memory_bytes == want
    one = partition(model, 2, sample, schedule="1f1b", n_microbatches=4, cost="uniform", profile=prof)
    assert in_flight("1f1b", 2, 4) == [2, 1]
    last = one.stages[1]
    assert last.memory_bytes == sum(
        4 * lp.param_bytes + lp.saved_bytes for lp in prof.layers[last.start : last.stop]
    )
    # The smallest feasible limit, by brute force over the 6 two-stage splits, is what the error states;
    # at that limit the plan fits exactly, and it moves the boundary when time alone wanted another.
    opts = {"schedule": "gpipe", "n_microbatches": 4}
    free = partition(model, 2, sample, profile=prof, **opts)
    peaks = {b: max(s.memory_bytes for s in plan_for(prof, [b, 7 - b], **opts).stages) for b in range(1, 7)}
    smallest = min(peaks.values())
    with pytest.raises(ValueError, match=f"smallest limit that fits is {smallest!r}"):
        partition(model, 2, sample, profile=prof, memory_limit=smallest - 1, **opts)
    ok = partition(model, 2, sample, profile=prof, memory_limit=smallest, **opts)
    assert peaks[ok.balance[0]] == smallest
    if peaks[free.balance[0]] > smallest:
        assert ok.balance != free.balance


def test_bandwidth_adds_cut_costs(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, sample, prof = small_gpt
    plan = partition(model, 2, sample, profile=prof, bandwidth=1e6)
    times = [lp.forward_time + lp.backward_time for lp in prof.layers]
    cuts = [2.0 * lp.activation_bytes / 1e6 for lp in prof.layers]
    assert plan.balance == solve(times, 2, cut_costs=cuts)
    assert plan.stages[0].forward_time == pytest.approx(
        sum(lp.forward_time for lp in prof.layers[: plan.balance[0]]) + plan.stages[0].sent_bytes / 1e6
    )


def test_interleaved_plan(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, sample, prof = small_gpt
    plan = partition(model, 4, sample, schedule="interleaved-1f1b", n_microbatches=4, profile=prof)
    assert len(plan.balance) == 4 and plan.step_time > 0


def test_profiles_when_not_given_and_split_runs() -> None:
    model, sample = mlp(width=16, depth=4, batch_size=4)
    plan = partition(model, 2, sample)
    parts = plan.split(model)
    assert torch.equal(parts[1](parts[0](sample)), model(sample))
    assert dataclasses.asdict(plan)["balance"] == plan.balance


@pytest.mark.parametrize(
    ("k", "kw", "match"),
    [
        (0, {}, r"n_stages \(0\)"),
        (8, {}, r"n_stages \(8\).*\(7\)"),
        (2, {"cost": "joules"}, "unknown cost 'joules'"),
        (2, {"schedule": "nope"}, "unknown schedule 'nope'"),
        (2, {"bandwidth": 0.0}, r"bandwidth \(0.0\)"),
        (2, {"bandwidth": 1e9, "cost": "flops"}, "needs cost='time'"),
        (3, {"schedule": "interleaved-1f1b"}, r"multiple of n_virtual \(2\)"),
    ],
)
def test_bad_input(small_gpt, k: int, kw: dict, match: str) -> None:  # type: ignore[no-untyped-def, type-arg]
    model, sample, prof = small_gpt
    with pytest.raises(ValueError, match=match):
        partition(model, k, sample, profile=prof, **kw)


def test_bad_input_before_profiling() -> None:
    with pytest.raises(ValueError, match="empty"):
        partition(nn.Sequential(), 1, torch.randn(1))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 2))
    with pytest.raises(ValueError, match=r"layer 1 .* shape \(2, 4\)"):
        partition(model, 2, torch.randn(2, 4))
    with pytest.raises(ValueError, match="profile has 7 layers"):
        prof = profile(
            *gpt(vocab_size=8, width=8, n_layers=4, n_heads=2, max_seq_len=4, batch_size=1),
            warmup=0,
            repeat=1,
        )
        partition(model, 2, torch.randn(2, 4), profile=prof)
    assert plan_for is not None
