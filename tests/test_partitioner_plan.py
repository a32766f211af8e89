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
    return Plan([2, 1], stages, 0.004, 0.02, 0.25, "1f1b", 4, "time", "simulator")


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
