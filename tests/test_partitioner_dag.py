"""The DAG partitioner: a cut costs every tensor live across it, the solver is exact on DAG orders, and
a traced model's plan charges exactly what its stages send."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

from partitioner import LayerProfile, Profile, cut_bytes, layer_graph, partition, profile, solve
from pipeline.plan import Plan, TracedGraph
from pipeline.reference.graph_models import gpt_tied, unet
from pipeline.runtime.trace.traced import build_stages
from pipeline.runtime.trace.tracing import trace


def _layer(at: int, forward: float) -> LayerProfile:
    return LayerProfile(at, f"l{at}", "Block", forward, 0.0, 0, 0, 0, 0, (1,), "float32")


# one skip: l1 -> l3 (1000 bytes) besides the chain's 10-byte tensors; l1 and l2 cost nothing
SKIP = [("t0", 0, (1,), 10), ("t1", 1, (2,), 10), ("skip", 1, (3,), 1000), ("t2", 2, (3,), 10)]
_HAND = {"method": "export", "fingerprint": "hand", "sample": [([1], "float32")]}  # a trace's record, by hand


def test_a_skip_is_paid_at_every_cut_it_crosses() -> None:
    layers = [_layer(at, f) for at, f in enumerate([1.0, 0.0, 0.0, 1.0])]
    assert cut_bytes(layer_graph(layers, tensors=SKIP)) == [10, 1010, 1010, 0]
    # a tensor read by two later layers is live until the last one, and counted once per cut
    fan = [("x", 0, (2, 3), 7), ("y", -1, (1,), 5), ("z", 2, (4,), 3)]  # 4 = n: the model's output
    assert cut_bytes(layer_graph(layers, tensors=fan)) == [7 + 5, 7, 7 + 3, 0]


def test_the_cheaper_cut_of_equal_compute_balance_is_chosen() -> None:
    # [1 | 0 0 1], [1 0 | 0 1], [1 0 0 | 1]: the same compute on both stages (1), but the last two
    # cuts also carry the skip. 2 * 10 B / (1000 B/s) = 0.02 s per stage vs 2 * 1010 / 1000 = 2.02 s.
    layers = [_layer(at, f) for at, f in enumerate([1.0, 0.0, 0.0, 1.0])]
    prof = Profile(layers, "cpu", layer_graph(layers, tensors=SKIP), traced=_HAND)
    plan = partition(nn.Module(), 2, None, profile=prof, bandwidth=1000.0)
    assert plan.balance == [1, 3]
    assert plan.bottleneck == pytest.approx(1.02)
    assert plan.cuts == ["l1"] and plan.graph == TracedGraph(**_HAND, layers=["l0", "l1", "l2", "l3"])
    assert [st.sent_bytes for st in plan.stages] == [10, 0]


def _brute_cut(tensors: list[tuple[str, int, tuple[int, ...], int]], cut: int) -> int:
    return sum(size for _, made, readers, size in tensors if made <= cut < max(readers))


def test_exact_against_brute_force_on_random_dag_orders() -> None:
    rng = random.Random(7)
    for _ in range(150):
        n, k = rng.randint(3, 8), rng.randint(2, 4)
        k = min(k, n)
        costs = [rng.choice([0.0, 0.5, 1.0, rng.random() * 3]) for _ in range(n)]
        tensors = []
        for j in range(rng.randint(1, 2 * n)):
            made = rng.randint(-1, n - 2)
            readers = tuple(sorted(rng.sample(range(made + 1, n + 1), rng.randint(1, min(3, n - made)))))
            tensors.append((f"v{j}", made, readers, rng.randint(0, 100)))
        layers = [_layer(at, c) for at, c in enumerate(costs)]
        cuts = [b / 50.0 for b in cut_bytes(layer_graph(layers, tensors=tensors))]
        assert cuts == [_brute_cut(tensors, c) / 50.0 for c in range(n - 1)] + [0.0]
        balance = solve(costs, k, cut_costs=cuts)

        best = min(
            _price(costs, cuts, tuple(b - a for a, b in itertools.pairwise((0, *ends, n))))
            for ends in itertools.combinations(range(1, n), k - 1)
        )
        assert _price(costs, cuts, tuple(balance)) == pytest.approx(best, rel=1e-12, abs=1e-12)


def _price(costs: list[float], cuts: list[float], balance: tuple[int, ...]) -> float:
    """The bottleneck by the definition: each stage's compute plus the cuts on both its sides."""
    worst, start, k = 0.0, 0, len(balance)
    for s, size in enumerate(balance):
        stop = start + size
        c = math.fsum(costs[start:stop])
        c += cuts[stop - 1] if s < k - 1 else 0.0
        c += cuts[start - 1] if s > 0 else 0.0
        worst, start = max(worst, c), stop
    return worst


@pytest.fixture(scope="module")
def small_unet() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return unet(widths=(4, 8, 16), image_size=8, batch_size=2)


def test_a_traced_plan_charges_what_its_stages_send(small_unet: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = small_unet
    prof = profile(model, x, warmup=0, repeat=1)
    assert prof.traced is not None and prof.traced["method"] == "export"
    for p in (2, 3, 4):
        plan = partition(model, p, x, profile=prof, bandwidth=1e9)
        stages = build_stages(trace(model, x), plan.balance)
        y, sent = x, []
        for s in range(p):
            y = stages[s](y)
            sent.append(sum(t.numel() * t.element_size() for t in (y if isinstance(y, tuple) else (y,))))
        assert [st.sent_bytes for st in plan.stages[:-1]] == sent[:-1]  # the skips included, each once
        assert plan.cuts == [prof.layers[sum(plan.balance[:s])].name for s in range(1, p)]
        again = Plan.from_json(plan.to_json())
        assert again == plan


def test_the_plan_names_tied_weights() -> None:
    torch.manual_seed(0)
    model, x = gpt_tied(vocab_size=11, width=16, n_layers=2, n_heads=2, max_seq_len=8, batch_size=2)
    prof = profile(model, x, warmup=0, repeat=1)
    plan = partition(model, 2, x, profile=prof)
    assert plan.ties == {"tok.weight": [0, 1]} and plan.graph is not None
    assert plan.graph.layers == [  # the positions' arange is no layer: each stage makes it
        "tok",
        "pos",  # with the loose add of the two embeddings
        "blocks.0",
        "blocks.1",
        "norm",
        "head",
    ]
    shared = nn.Linear(4, 4)
    seq = nn.Sequential(shared, nn.ReLU(), shared)  # a Parameter object referenced twice
    plan = partition(seq, 2, torch.randn(3, 4))
    assert plan.ties == {"0.weight": [0, 1], "0.bias": [0, 1]} and plan.cuts == [] and plan.graph is None
