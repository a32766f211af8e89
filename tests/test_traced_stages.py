"""Traced stages (``pipeline.runtime.trace.tracing`` / ``traced``): run in sequence, they ARE the model.

Each reference model written as users write it (tied GPT, U-Net with long skips, blocks passing
two tensors) is traced, cut at several balances, and its stages are run one after another in one
process: the output and every parameter's gradient must equal the model's own (fp32, rel < 1e-5).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from pipeline.reference.graph_models import gpt_tied, two_stream, unet
from pipeline.runtime.trace.layers import cut_blocks
from pipeline.runtime.trace.ties import find_ties
from pipeline.runtime.trace.traced import build_stages, stage_specs
from pipeline.runtime.trace.tracing import Traced, trace

BUILDERS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "gpt_tied": lambda: gpt_tied(vocab_size=11, width=16, n_layers=3, n_heads=2, max_seq_len=8, batch_size=4),
    "unet": lambda: unet(widths=(4, 8, 16), image_size=8, batch_size=4),
    "two_stream": lambda: two_stream(in_features=5, width=8, depth=4, batch_size=4),
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def traced(request: pytest.FixtureRequest) -> tuple[nn.Module, torch.Tensor, Traced]:
    torch.manual_seed(0)
    model, x = BUILDERS[request.param]()
    return model, x, trace(model, x)


def _balances(n: int) -> list[list[int]]:
    out = [[1, n - 1], [n - 1, 1]]
    for k in (2, 3, 4):
        base = n // k
        out.append([base] * (k - 1) + [n - base * (k - 1)])
    return out


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def test_stages_in_sequence_equal_the_model(traced: tuple[nn.Module, torch.Tensor, Traced]) -> None:
    model, x, tr = traced
    model.zero_grad()
    want = model(x)
    want.float().square().mean().backward()
    expected = _grads(model)
    n = len(tr.layers)
    for balance in _balances(n):
        model.zero_grad()
        stages = build_stages(tr, balance)
        y = x
        for s in range(len(balance)):
            y = stages[s](y)
        assert _rel(y, want) < 1e-5, balance
        y.float().square().mean().backward()
        got = _grads(model)
        assert got.keys() == expected.keys()
        for name, g in got.items():
            assert _rel(g, expected[name]) < 1e-5, (balance, name)


def test_a_smaller_batch_runs_and_other_shapes_are_refused(
    traced: tuple[nn.Module, torch.Tensor, Traced],
) -> None:
    model, x, tr = traced
    n = len(tr.layers)
    stages = build_stages(tr, [n // 2, n - n // 2])
    y = stages[1](stages[0](x[:3]))  # the last micro-batch of an uneven batch
    assert _rel(y, model(x[:3])) < 1e-5
    wrong = x[:, :4] if x.dim() == 2 else x[..., :4]
    with pytest.raises(ValueError, match=r"stage 0 was traced for inputs of shapes \[\[any, "):
        stages[0](wrong)


def test_names_are_the_models_and_ties_one_object(traced: tuple[nn.Module, torch.Tensor, Traced]) -> None:
    model, _, tr = traced
    n = len(tr.layers)
    balance = [1, n - 2, 1]
    stages = build_stages(tr, balance)
    names = dict(model.named_parameters(remove_duplicate=False))
    keys = set(model.state_dict())
    for stage in stages.values():
        for name, p in stage.named_parameters():
            assert names[name] is p  # the model's own parameter, under its own name
        assert set(stage.state_dict()) <= keys
    held = [set(stage.state_dict()) for stage in stages.values()]
    canonical = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    assert set().union(*held) == canonical  # each tensor once, by its first name (head.weight is tok.weight)
    ties = find_ties(list(stages.values()))
    if isinstance(model, type(gpt_tied()[0])):
        assert [(t.names, t.stages) for t in ties] == [(("tok.weight", "tok.weight"), (0, 2))]
        assert stages[0].tok.weight is stages[2].tok.weight is model.head.weight
    else:
        assert ties == []


def test_a_long_skip_crosses_every_cut_it_spans() -> None:
    torch.manual_seed(0)
    model, x = BUILDERS["unet"]()
    tr = trace(model, x)
    n = len(tr.layers)
    specs = stage_specs(tr, [1] * n)
    carried = [set(spec.inputs) for spec in specs[1:]]
    (image,) = tr.inputs
    assert all(image in names for names in carried)  # the input is read by the last layer: out + x
    stem = next(v for v in tr.values.values() if v.layer == 0 and v.last > 1)  # kept for the last up-block
    assert all(stem.name in names for names in carried[: stem.last])


class _Sizes(nn.Module):
    """``b = x.size(0)`` in one layer, read two layers later: an int no cut can carry (fx path)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.size(0)
        h = self.b(self.a(x))
        return self.c(h).reshape(rows, 2, 2)


def test_a_size_read_later_is_rebuilt_not_sent() -> None:
    model, x = _Sizes(), torch.randn(3, 4)
    for method in ("export", "symbolic_trace"):
        tr = trace(model, x, method=method)
        assert tr.method == method
        assert cut_blocks(tr.graph, tr.layers, tr.values, model) == [""] * (len(tr.layers) - 1)
        stages = build_stages(tr, [1] * len(tr.layers))
        y = x
        for s in range(len(tr.layers)):
            y = stages[s](y)
        assert torch.equal(y, model(x))


class _DataShaped(nn.Module):
    """The rows that pass a test on the data: a shape only the data decides, then a fixed one."""

    def __init__(self) -> None:
        super().__init__()
        self.pick = nn.Linear(4, 4)
        self.sum = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = self.pick(x)[x[:, 0] > 0]  # (u0, 4): data-dependent rows
        return self.sum(kept).sum(0)


def test_a_data_dependent_shape_never_crosses_a_cut() -> None:
    model = _DataShaped()
    tr = trace(model, torch.randn(5, 4))
    reasons = cut_blocks(tr.graph, tr.layers, tr.values, model)
    blocked = [why for why in reasons if why]
    assert blocked and all("depends on the data" in why for why in blocked)
    cut = next(at for at, why in enumerate(reasons) if "shape depends on the data" in why)
    balance = [cut + 1, len(tr.layers) - cut - 1]
    with pytest.raises(ValueError, match=r"between stages 0 and 1, would carry .* depends on the data"):
        build_stages(tr, balance)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y * 2
        return y


def test_an_untraceable_model_names_the_line_and_the_ways_out() -> None:
    with pytest.raises(ValueError) as info:
        trace(_Branchy(), torch.randn(2, 4))
    text = str(info.value)
    assert "test_traced_stages.py" in text and "if y.sum() > 0:" in text
    assert "nn.Sequential" in text and "torch.where or torch.cond" in text


def test_a_meta_model_traced_and_built_for_the_cpu() -> None:
    torch.manual_seed(0)
    model, x = BUILDERS["gpt_tied"]()
    with torch.device("meta"):
        meta, _ = BUILDERS["gpt_tied"]()
    real = trace(model, x)
    tr = trace(meta, torch.zeros(x.shape, dtype=x.dtype, device="meta"))
    assert tr.fingerprint == real.fingerprint
    stage = build_stages(tr, [2, len(tr.layers) - 2], stages=[0], device=torch.device("cpu"))[0]
    makes = [n for n in stage.graph.nodes if "arange" in str(n.target)]
    assert makes and all(n.kwargs["device"] == torch.device("cpu") for n in makes)  # moved off meta


class _Modal(nn.Module):
    """Dropout and batch norm: what a stage must do differently in eval()."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.norm = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.drop(self.lin(x))))


def test_stages_follow_train_and_eval_like_the_model() -> None:
    torch.manual_seed(0)
    model, x = _Modal().eval(), torch.randn(6, 4)
    tr = trace(model, x)
    assert not model.training  # put back as it was
    stages = build_stages(tr, [2, len(tr.layers) - 2])
    for stage in stages.values():
        stage.eval()
    want = model(x)
    y = stages[1](stages[0](x))
    assert torch.equal(y, want)  # no dropout, running statistics
    assert int(model.norm.num_batches_tracked) == 0
    for stage in stages.values():
        stage.train()
    model.train()
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)
    y = stages[1](stages[0](x))
    assert torch.equal(y, want)  # the same dropout masks, batch statistics
    assert int(model.norm.num_batches_tracked) == 2  # the model's step and the stages' step


def test_a_stage_with_a_data_dependent_size_inside_knows_its_output() -> None:
    from pipeline.runtime.step.stage import StageRuntime

    options = {"n_stages": 2, "n_microbatches": 1, "split_backward": False, "recompute": "never"}
    inside = StageRuntime(0, _DataShaped(), loss_fn=None, device=torch.device("cpu"), **options)  # type: ignore[arg-type]
    assert inside.infer((((5, 4), torch.float32),)) == (
        ((4,), torch.float32),
    )  # the rows vary, not the output
    leaks = nn.Sequential(_Rows())
    stage = StageRuntime(0, leaks, loss_fn=None, device=torch.device("cpu"), **options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stage 0's output 0 has a shape that depends on the data"):
        stage.infer((((5, 4), torch.float32),))


class _Rows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x[:, 0] > 0]  # as many rows as pass the test
