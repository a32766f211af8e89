"""``partitioner.plan``: split keeps the model's layers and names, JSON round trip, the table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner.plan import Plan, StagePlan


def _plan() -> Plan:
    stages = [
        StagePlan(0, 2, ["0", "1"], 0.001, 0.002, 0.003, 1e6, 512),
        StagePlan(2, 3, ["2"], 0.002, 0.002, 0.004, 2e6, 0),
    ]
    return Plan([2, 1], stages, 0.004, 0.02, 0.25, "1f1b", 4, "time", prediction="simulator")


def test_split_keeps_layers_and_names() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    first, second = _plan().split(model)
    assert first[0] is model[0] and first[1] is model[1] and second[0] is model[2]
    assert [n for n, _ in second.named_parameters()] == ["2.weight", "2.bias"]
    names = [n for part in (first, second) for n, _ in part.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    x = torch.randn(5, 3)
    assert torch.equal(second(first(x)), model(x))


def test_split_rejects_another_model() -> None:
    with pytest.raises(ValueError, match=r"nn\.Sequential of 3 layers, got 2"):
        _plan().split(nn.Sequential(nn.ReLU(), nn.ReLU()))


def test_json_round_trip() -> None:
    plan = _plan()
    assert Plan.from_json(plan.to_json()) == plan


def test_table() -> None:
    text = str(_plan())
    assert "stage" in text and "0-1" in text and "balance [2, 1]" in text and "bubble 0.250" in text
    assert "(2.000x ours)" in _plan().table(reference=0.002)


def test_predicted_busy_sums_each_ranks_stages() -> None:
    def stage(start: int, fwd: float, bwd: float) -> StagePlan:
        return StagePlan(start, start + 1, [str(start)], fwd, bwd, fwd + bwd, 0.0, 0)

    stages = [stage(0, 1.0, 2.0), stage(1, 0.5, 0.5), stage(2, 2.0, 2.0), stage(3, 0.25, 0.25)]
    plan = Plan([1, 1, 1, 1], stages, 4.0, 0.0, 0.0, "interleaved-1f1b", 3, "time", n_virtual=2)
    # rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; every stage runs m = 3 micro-batches
    assert plan.predicted_busy() == [3 * (3.0 + 4.0), 3 * (1.0 + 0.5)]
    flat = Plan([1, 1, 1, 1], stages, 4.0, 0.0, 0.0, "1f1b", 2, "time")
    assert flat.predicted_busy() == [6.0, 2.0, 8.0, 1.0]
