"""``plan_stages``: a rank's stages from a plan, for a traced model or a Sequential, checked against it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import partition, profile
from pipeline.plan import Plan
from pipeline.reference.graph_models import gpt_tied
from pipeline.runtime.trace.graph_stages import plan_stages

KW = {"vocab_size": 11, "width": 16, "n_heads": 2, "max_seq_len": 8, "batch_size": 2}


@pytest.fixture(scope="module")
def planned() -> tuple[nn.Module, torch.Tensor, Plan]:
    torch.manual_seed(0)
    model, x = gpt_tied(n_layers=2, **KW)  # type: ignore[arg-type]
    plan = partition(model, 3, x, profile=profile(model, x, warmup=0, repeat=1))
    return model, x, plan


def test_a_meta_model_gives_this_ranks_stages_and_every_tie(
    planned: tuple[nn.Module, torch.Tensor, Plan],
) -> None:
    model, x, plan = planned
    with torch.device("meta"):
        meta, _ = gpt_tied(n_layers=2, **KW)  # type: ignore[arg-type]
    mine, ties = plan_stages(meta, plan, [0, 2], torch.device("cpu"))
    assert sorted(mine) == [0, 2]
    assert [(t.names, t.stages) for t in ties] == [(("tok.weight", "tok.weight"), (0, 2))]
    assert mine[0].get_parameter("tok.weight") is mine[2].get_parameter("tok.weight")  # one tensor here
    assert not any(p.is_meta for m in mine.values() for p in m.parameters())
    # the same stages on a real model compute what the model computes
    real, _ = plan_stages(model, plan, [0, 1, 2], torch.device("cpu"))
    assert torch.equal(real[2](real[1](real[0](x))), model(x))


def test_a_plan_for_another_model_is_refused(planned: tuple[nn.Module, torch.Tensor, Plan]) -> None:
    _, _, plan = planned
    deeper, _ = gpt_tied(n_layers=3, **KW)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"made for another model \(layer 4 is blocks.2 in this TiedGPT but norm"
    ):
        plan_stages(deeper, plan, [0], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"splits an nn.Sequential of 8 layers, but the model is a TiedGPT"):
        plan_stages(deeper, Plan(balance=[4, 4]), [0], torch.device("cpu"))


def test_a_sequential_plan_slices_and_finds_its_ties() -> None:
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    mine, ties = plan_stages(model, Plan(balance=[2, 1]), [1], torch.device("cpu"))
    assert list(mine) == [1] and mine[1][0] is shared
    assert [(t.names, t.stages) for t in ties] == [
        (("0.weight", "2.weight"), (0, 1)),
        (("0.bias", "2.bias"), (0, 1)),
    ]


def test_a_replaced_submodule_is_traced_again(planned: tuple[nn.Module, torch.Tensor, Plan]) -> None:
    _, _, plan = planned
    torch.manual_seed(0)
    model, _ = gpt_tied(n_layers=2, **KW)  # type: ignore[arg-type]
    plan_stages(model, plan, [0], torch.device("cpu"))  # traced, and kept for this model
    plan_stages(model, plan, [1], torch.device("cpu"))  # the kept trace
    model.norm = nn.Identity()  # the same model object, another graph
    with pytest.raises(ValueError, match=r"made for another model"):
        plan_stages(model, plan, [0], torch.device("cpu"))
