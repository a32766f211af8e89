"""``pipeline.runtime.trace.sizes``: which traced calls are made again per stage (sizes, derived tensors).

A derived tensor comes from the input's sizes, constants and unwritten buffers alone: no layer of
its own, and a stage that reads it makes it again. A random draw, a parameter's value, a buffer the
model writes or the input's data each keep a call in its layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from partitioner import partition, profile
from pipeline.runtime.trace.layers import cut_blocks
from pipeline.runtime.trace.sizes import is_derived
from pipeline.runtime.trace.traced import build_stages
from pipeline.runtime.trace.tracing import trace


class Positions(nn.Module):
    """Position ids and a causal mask from the input's sizes, a scale from a buffer (B, T, C) -> same."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freq", torch.tensor([0.5, 2.0]), persistent=False)
        self.bias = nn.Parameter(torch.zeros(1))
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)[None, :, None] * self.freq.sum()  # (1, T, 1): derived
        mask = torch.ones(t, t, device=x.device).tril()  # (T, T): derived
        noise = torch.rand(t, device=x.device)  # random: a second draw would differ
        shifted = torch.ones(t, device=x.device) + self.bias  # reads a parameter: its gradient flows
        h = self.a(x) + pos
        h = (mask @ h) + noise[None, :, None] + shifted[None, :, None]
        return self.b(h) + pos


def _calls(traced: object, keep: str) -> list[str]:
    graph = traced.graph  # type: ignore[attr-defined]
    return [
        str(n.target).split(".")[-2] for n in graph.nodes if n.op == "call_function" and keep in str(n.target)
    ]


def test_sizes_constants_and_buffers_make_derived_tensors_the_rest_stays_in_layers() -> None:
    x = torch.randn(2, 5, 4)
    traced = trace(Positions(), x)
    by_target: dict[str, list[bool]] = {}
    for node in traced.graph.nodes:
        if node.op == "call_function":
            by_target.setdefault(str(node.target), []).append(is_derived(node))
    assert all(by_target["aten.arange.default"]), by_target  # position ids
    assert all(by_target["aten.tril.default"])  # the mask
    assert not any(by_target["aten.rand.default"])  # random: drawn once, in its layer
    layer_of = {name: at for at, layer in enumerate(traced.layers) for name in layer.nodes}
    derived = [n.name for n in traced.graph.nodes if is_derived(n)]
    assert derived and not any(name in layer_of for name in derived)  # no layer holds them
    ones = [n for n in traced.graph.nodes if str(n.target) == "aten.ones.default"]
    adds = [u for n in ones for u in n.users if "add" in str(u.target)]
    assert any(not is_derived(u) for u in adds)  # ones + bias: a parameter's value is no derived tensor
    assert any("freq" in layer.params for layer in traced.layers)  # a reader holds the buffer it needs


def test_every_stage_makes_its_derived_tensors_again_and_computes_what_the_model_does() -> None:
    torch.manual_seed(0)
    model = Positions()
    x = torch.randn(3, 5, 4)
    traced = trace(model, x[:2])
    n = len(traced.layers)
    for cut in range(1, n):
        stages = build_stages(traced, [cut, n - cut])
        torch.manual_seed(1)
        want = model(x)
        torch.manual_seed(1)
        got = stages[1](stages[0](x))
        assert torch.allclose(got, want, atol=1e-6), cut  # pos and mask made on both sides of the cut


def test_a_buffer_the_model_writes_makes_no_derived_tensor() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("steps", torch.zeros(1))
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = self.steps.exp()  # read before the write below: the value at this step's start
            self.steps.add_(1)
            return self.lin(x) * torch.ones(x.shape[1], device=x.device) + scale

    traced = trace(Counter(), torch.randn(2, 4))
    exps = [n for n in traced.graph.nodes if "exp" in str(n.target)]
    assert exps and not any(is_derived(n) for n in exps)  # it reads a written buffer: in its layer
    ones = [n for n in traced.graph.nodes if "ones" in str(n.target)]
    assert ones and all(is_derived(n) for n in ones)


class FxPositions(nn.Module):
    """(B, T, C) -> same, plus position ids written as torch.fx traces them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.size(1), device=x.device, dtype=x.dtype)[None, :, None]  # (1, T, 1)
        return self.b(self.a(x) + pos) + pos


def test_the_fx_tracer_reads_sizes_and_devices_as_constants_of_the_trace() -> None:
    """torch.fx writes ``x.device`` and ``x.size(1)`` as calls on the input: still no layer's."""
    torch.manual_seed(0)
    model = FxPositions()
    x = torch.randn(2, 5, 4)  # fx traces static shapes
    traced = trace(model, x, method="symbolic_trace")
    aranges = [n for n in traced.graph.nodes if "arange" in str(n.target)]
    assert aranges and all(is_derived(n) for n in aranges)
    assert [layer.name for layer in traced.layers] == ["a", "b"]  # each loose add joins its layer
    stages = build_stages(traced, [1, 1])
    assert torch.allclose(stages[1](stages[0](x)), model(x), atol=1e-6)


class Pooled(nn.Module):
    """(B, C) -> (B, C): the batch dimension is summed away, then a later layer needs B again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.a(x).sum(0))  # (C,): no batch dimension
        return self.c(h) * torch.ones(x.shape[0], 1, device=x.device)  # (B, C): needs B


def test_a_size_no_crossing_tensor_carries_is_never_cut_and_a_forced_cut_names_the_line() -> None:
    """Only the cut after ``a`` carries a tensor with the batch dimension: partition cuts there, the
    layers are still profiled (the input lends its size to the last one), and a stage built across
    another cut names the size, the model's line that needs it and the fix."""
    model = Pooled()
    x = torch.randn(3, 4)
    traced = trace(model, x)
    names = [layer.name for layer in traced.layers]
    assert names == ["a", "b", "c"]  # the loose sum joins b (the cut after it cannot be made), mul c
    reasons = cut_blocks(traced.graph, traced.layers, traced.values, traced.root)
    assert reasons[0] == ""
    assert (
        "layer 2 (c) reads the size" in reasons[1] and "which no tensor crossing this cut has" in reasons[1]
    )
    plan = partition(model, 2, x, profile=profile(model, x, warmup=0, repeat=1))
    assert plan.balance == [1, 2]
    with pytest.raises(
        ValueError, match=r"stage 1 needs the size s\d+ \(sym_size\w*, made at .*test_sizes.py.*but no tensor"
    ):
        build_stages(traced, [2, 1])


class ViewWrite(nn.Module):
    """(B, T, C) -> same: a tensor made from sizes, then written with data through a view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(x.shape[1], 4, device=x.device)  # (T, C): from sizes alone...
        m[:, :2].add_(self.a(x).mean())  # ...but then written with the data, through a view
        return self.b(x) + m


def test_a_tensor_written_through_a_view_is_no_derived_tensor() -> None:
    torch.manual_seed(0)
    model = ViewWrite()
    x = torch.randn(3, 5, 4)
    traced = trace(model, x[:2])
    zeros = [n for n in traced.graph.nodes if "zeros" in str(n.target)]
    assert zeros and not any(is_derived(n) for n in zeros)  # made again, it would lack the write
    n = len(traced.layers)
    for cut in range(1, n):
        reasons = cut_blocks(traced.graph, traced.layers, traced.values, traced.root)
        if reasons[cut - 1]:
            continue
        stages = build_stages(traced, [cut, n - cut])
        assert torch.allclose(stages[1](stages[0](x)), model(x), atol=1e-6), cut


class PooledPositions(nn.Module):
    """(B, C) -> ((C,), (B,)): the batch dimension is summed away; the positions are an output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.c(self.b(self.a(x).sum(0))), torch.arange(x.shape[0], device=x.device)


def test_a_derived_output_needs_its_size_at_the_last_stage() -> None:
    traced = trace(PooledPositions(), torch.randn(3, 4))
    reasons = cut_blocks(traced.graph, traced.layers, traced.values, traced.root)
    names = [layer.name for layer in traced.layers]
    assert names == ["a", "b", "c"]  # the loose sum joins b
    assert reasons[0] == "" and "reads the size" in reasons[1]  # after the sum, nothing carries B


def test_a_constant_read_twice_is_one_buffer_under_one_flat_name() -> None:
    """Constants the graph reads (export lifts tensors made in forward) get one flat name each."""
    from pipeline.runtime.trace.tracing import _constants

    g = fx.Graph()
    a, b = g.get_attr("sub.lifted_tensor_0"), g.get_attr("sub.lifted_tensor_0")
    c = g.get_attr("sub_lifted.tensor_0")  # flattens like the first: a name of its own
    g.output((a, b, c))
    holder = nn.Module()
    holder.register_module("sub", nn.Module())
    holder.sub.register_buffer("lifted_tensor_0", torch.ones(1))
    holder.register_module("sub_lifted", nn.Module())
    holder.sub_lifted.register_buffer("tensor_0", torch.zeros(1))
    found = _constants(g, holder, nn.Module())
    assert [str(n.target) for n in (a, b, c)] == ["_constant_sub_lifted_tensor_0"] * 2 + [
        "_constant_sub_lifted_tensor_0_"
    ]
    assert sorted(found) == ["_constant_sub_lifted_tensor_0", "_constant_sub_lifted_tensor_0_"]
    assert torch.equal(found["_constant_sub_lifted_tensor_0"], torch.ones(1))
