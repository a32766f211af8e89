"""How a traced model's layers are made and charged, and what a plan may give a rank (issue 45).

    # p: ranks, k: stages, l: layer

Small models standing for what real ones do (tests/test_hf_models.py runs the real ones):

- an operation outside any module (a logits slice, a final scale, a softcap) joins a layer: no
  layer, so no rank, holds nothing to train;
- a tensor owned by a module with children of its own (BART's ``final_logits_bias`` on the whole
  model) is held alone: the layer reading it holds neither those children nor ties them;
- a module above a balanced stage (total / k of the calls) is split into its children, and every
  rank groups the layers as the plan says;
- partition never gives a stage no parameter (repaired when it can be, refused when it cannot), and
  ``plan_for`` names such a stage of a given balance.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import cut_groups, partition, plan_for, profile
from pipeline.plan import Plan
from pipeline.runtime.trace.graph_stages import plan_stages
from pipeline.runtime.trace.ties import find_ties
from pipeline.runtime.trace.traced import build_stages, holder
from pipeline.runtime.trace.tracing import trace

W = 8  # width


class Scaled(nn.Module):
    """(B, T, W) -> (B, 1, W): blocks, a norm, a head, then a last-position slice and a logit scale
    written in the top module's forward, as Cohere and Gemma 2 write them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(W, W) for _ in range(3))
        self.norm, self.head = nn.LayerNorm(W), nn.Linear(W, W)
        self.bias = nn.Parameter(torch.zeros(W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.bias  # a loose add that reads a parameter
        for block in self.blocks:
            x = x + torch.relu(block(x))  # a loose residual add
        h = self.norm(x)[:, -1:]  # a loose slice (logits_to_keep)
        return torch.tanh(self.head(h) / 30.0) * 30.0  # a loose softcap


def test_operations_outside_any_module_join_a_layer() -> None:
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(2, 5, W)
    traced = trace(model, x)
    names = [layer.name for layer in traced.layers]
    # the residual adds join the block they read, the slice the norm, the softcap the head; the first
    # add reads a parameter: it stays a layer of its own, named after its call
    assert names == ["add", "blocks.0", "blocks.1", "blocks.2", "norm", "head"], names
    nodes = {layer.name: layer.nodes for layer in traced.layers}
    assert any(n.startswith("slice") for n in nodes["norm"]) and any(
        n.startswith("tanh") for n in nodes["head"]
    )
    assert traced.layers[0].params == ("bias",)
    stages = build_stages(traced, [2, 2, 2])
    y = x
    for s in range(3):
        y = stages[s](y)
    assert torch.equal(y, model(x))


class Owner(nn.Module):
    """An encoder-decoder's top module that owns a bias of its own (BART's ``final_logits_bias``)
    beside its children, read after the head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W))
        self.head = nn.Linear(W, W)
        self.register_buffer("logits_bias", torch.randn(1, W))
        self.gain = nn.Parameter(torch.randn(W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)) * self.gain + self.logits_bias


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Owner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)  # type: ignore[no-any-return]


def test_a_tensor_of_a_module_with_children_is_held_alone() -> None:
    """The layer reading ``model.gain`` and ``model.logits_bias`` holds those two, not the whole
    ``Owner`` (every weight, tied across stages before); stages train as the model does."""
    torch.manual_seed(0)
    model, x = Wrapped(), torch.randn(4, W)
    prof = profile(model, x, warmup=0, repeat=1)
    assert prof.layers[-1].params == ("model.gain",), [lp.params for lp in prof.layers]
    plan = partition(model, 2, x, cost="flops", profile=prof)
    assert plan.ties == {}, plan.ties
    traced = trace(model, x)
    spans = ((0, plan.balance[0]), (plan.balance[0], len(traced.layers)))
    every = [holder(model, {t for at in range(a, b) for t in traced.layers[at].params}, {}) for a, b in spans]
    assert find_ties(every) == []
    last = dict(every[1].named_parameters())
    assert "model.gain" in last and not any(n.startswith("model.encoder") for n in last), sorted(last)
    assert last["model.gain"] is model.model.gain  # the model's own tensor, under its own name
    assert "model.logits_bias" in every[1].state_dict()  # a persistent buffer stays in the state dict
    stages = build_stages(traced, plan.balance)
    out = stages[1](stages[0](x))
    out.square().sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(x).square().sum().backward()
    assert got.keys() == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-5, atol=0), n  # type: ignore[arg-type]


class EncoderDecoder(nn.Module):
    """(B, W) -> (B, W): an encoder of 3 light blocks, a decoder of 3 heavier ones; the encoder
    holds about a third of the calls, T5's and BART's share."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(*(nn.Sequential(nn.Linear(W, W), nn.ReLU()) for _ in range(3)))
        self.decoder = nn.Sequential(
            *(nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU()) for _ in range(3))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))  # type: ignore[no-any-return]


def test_a_module_above_a_balanced_stage_is_split_and_every_rank_groups_the_same() -> None:
    torch.manual_seed(0)
    model, x = EncoderDecoder(), torch.randn(4, W)
    at_2 = [layer.name for layer in trace(model, x).layers]
    assert at_2 == ["encoder", "decoder.0", "decoder.1", "decoder.2"], at_2  # the encoder: a third
    at_4 = [layer.name for layer in trace(model, x, stages=4).layers]
    assert at_4 == ["encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1", "decoder.2"], at_4
    with pytest.raises(ValueError, match=r"stages \(0\) must be an integer >= 1"):
        trace(model, x, stages=0)
    plan = partition(model, 4, x, cost="flops")  # traced for its 4 stages
    assert plan.graph is not None and plan.graph.stages == 4 and plan.graph.layers == at_4
    assert plan.balance == [3, 1, 1, 1]  # the encoder's three blocks weigh one decoder block's two
    again = Plan.from_json(plan.to_json())
    mine, _ = plan_stages(model, again, [0, 1, 2, 3], torch.device("cpu"))  # a rank groups for 4 too
    y = x
    for s in range(4):
        y = mine[s](y)
    assert torch.equal(y, model(x))
    old = Plan.from_json(plan.to_json().replace('"stages": 4', '"stages": 2'))
    with pytest.raises(ValueError, match="made for another model"):  # grouped otherwise: refused
        plan_stages(model, old, [0], torch.device("cpu"))


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(W, W), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W))


def test_every_stage_holds_a_parameter() -> None:
    """Four equal layers on 3 ranks would be [2, 1, 1], the ReLU a rank of its own with nothing
    for an optimizer: the ReLU stays with the layer before it. On 4 ranks no split can give every
    rank a parameter: refused, naming the ReLU; ``plan_for`` names such a stage of a given balance."""
    model, x = _chain(), torch.randn(4, W)
    prof = profile(model, x, warmup=0, repeat=1)
    assert cut_groups(prof.layers)[0] == [1, 2, 1]
    plan = partition(model, 3, x, cost="uniform", profile=prof)
    assert plan.balance == [1, 2, 1] and plan.problems == []
    refused = r"4 stages but the model can be cut in only 2 places \(layer 2 \(2\) holds no parameter, so "
    with pytest.raises(ValueError, match=refused + r"it stays with a stage that does\); use at most 3 ranks"):
        partition(model, 4, x, cost="uniform", profile=prof)
    (problem,) = plan_for(prof, [2, 1, 1], cost="uniform").problems
    assert problem.startswith("stage 1: layer 2 (2) holds no parameter") and "optimizer" in problem
    auto = partition(model, 3, x, schedule="auto", profile=prof, batch_size=4)  # the search: the same rule
    assert auto.balance == [1, 2, 1]


def test_a_leading_layer_without_parameters_joins_the_next() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(W, W), nn.Linear(W, W))
    prof = profile(model, torch.randn(4, 2, 4), warmup=0, repeat=1)
    assert cut_groups(prof.layers)[0] == [2, 1]
