"""Layers the pipeline must treat with care: in-place entries (``nn.ReLU(inplace=True)``) and layers
that return a dict. Both profile; the partitioner never cuts where the pipeline could not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import cut_groups, partition, plan_for, profile


def _with_inplace() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8))


def test_inplace_relu_entries_profile_and_partition() -> None:
    model, x = _with_inplace(), torch.randn(4, 8)
    prof = profile(model, x, warmup=0, repeat=1)
    assert [lp.inplace for lp in prof.layers] == [False, False, True, False]
    relu = prof.layers[2]
    assert relu.saved_bytes == 4 * 8 * 4 and relu.backward_time > 0 and relu.input_time > 0
    # four equal layers over two stages would be [2, 2]: stage 1 would start with the ReLU, which
    # autograd refuses on a stage's input (a leaf); so the ReLU stays with the layer before it
    plan = partition(model, 2, x, cost="uniform", profile=prof)
    assert plan.balance == [3, 1] and plan.problems == []
    (problem,) = plan_for(prof, [2, 2], cost="uniform").problems
    assert problem == "the boundary between stages 0 and 1: layer 2 (2: ReLU) writes into its input"
    # the split runs as the pipeline runs it: each stage's input a leaf that takes a gradient
    first, second = plan.split(model)
    leaf = first(x).detach().requires_grad_()
    second(leaf).sum().backward()
    assert leaf.grad is not None
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):  # what [2, 2] would do
        nn.Sequential(model[2], model[3])(model[1](model[0](x)).detach().requires_grad_())


def test_too_many_stages_for_the_cuttable_places() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    prof = profile(model, torch.randn(2, 4), warmup=0, repeat=1)
    assert cut_groups(prof.layers)[0] == [2, 2]
    with pytest.raises(ValueError, match=r"3 stages but the model can be cut in only 1 places \(layer 1"):
        partition(model, 3, torch.randn(2, 4), profile=prof)


class _Heads(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": self.a(x), "b": self.b(x)}


class _Merge(nn.Module):
    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
        return d["a"] * d["b"]


def test_dict_returning_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Heads(8), _Merge(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    prof = profile(model, x, warmup=0, repeat=1)
    heads, merge = prof.layers[1], prof.layers[2]
    # every tensor of the dict counts: its bytes, its backward, the flops of both heads
    assert heads.activation_bytes == 2 * 4 * 8 * 4 and heads.output_shape == (4, 8)
    assert heads.backward_time > 0 and heads.weight_time > 0 and heads.flops == 2 * (2 * 4 * 8 * 8)
    assert merge.saved_bytes == 2 * 4 * 8 * 4 and merge.input_time > 0
    assert not heads.sendable and merge.sendable  # the pipeline sends tensors or tuples of them
    plan = partition(model, 2, x, cost="uniform", profile=prof)
    assert plan.balance == [3, 1]  # [2, 2] would send the dict
    (problem,) = plan_for(prof, [2, 2], cost="uniform").problems
    assert "layer 1 (1: _Heads) returns what the pipeline cannot send" in problem
