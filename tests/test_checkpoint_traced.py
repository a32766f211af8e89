"""Checkpoints of traced plans (the tied GPT) at any stage count: saved once, resumed bit-exactly.

    # p: ranks, v: stages per rank

One launch of 2 ranks runs the layouts in sequence, each from a freshly (differently) seeded
model that loads a checkpoint, then trains on; the single process (p = 1, the model itself) runs
in the test around it::

    1 process   train 4 steps, save at 2 --------------------------.          (dir "one")
    2 x 2       train 4 steps, save at 2 (dir "a")                  |          the uninterrupted run
    2 x 2       load a -> the same losses, bit for bit              |          resume
    2 x 1       load a -> every copy's parameters and optimizer state equal the saved ones; save (dir "b")
    2 x 2       load b -> the same losses as the uninterrupted run, bit for bit
    2 x 2       load one, save (dir "a_one") <----------------------'
    1 process   load a -> the saved parameters; load a_one -> the single process's losses, bit for bit

A round trip through another layout that reproduces the losses bit for bit means every parameter
and optimizer entry came back exactly (the tied weight's copies included: a copy left behind would
move the losses). The tied weight (``head.weight`` is ``tok.weight``) is one entry in the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from partitioner import partition, profile
from pipeline import checkpointing
from pipeline.plan import Plan
from pipeline.reference.graph_models import gpt_tied
from pipeline.reference.models import gpt_loss
from pipeline.runtime.pipe import Pipeline
from tests.dist import run_ranks

STEPS, SAVED_AT, BATCH, M = 4, 2, 8, 4


def _close(got: list[float], ref: list[float]) -> None:
    """Losses of two layouts from the same state: fp32 relative error < 1e-5 each."""
    assert len(got) == len(ref) and all(abs(g - r) <= 1e-5 * abs(r) for g, r in zip(got, ref, strict=True)), (
        got,
        ref,
    )


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return gpt_tied(vocab_size=16, width=16, n_layers=4, n_heads=2, max_seq_len=8)[0]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 16, (BATCH, 8), generator=g), torch.randint(0, 16, (BATCH, 8), generator=g)


def _train(step: Any, opt: torch.optim.Optimizer, steps: range, at: Path | None, model: Any) -> list[float]:
    """Steps ``steps`` (each on its own batch), saving into ``at`` after step SAVED_AT."""
    losses = []
    for _ in steps:
        losses.append(float(step()))
        opt.step()
        opt.zero_grad()
        if at is not None and len(losses) + steps.start == SAVED_AT:
            checkpointing.save(at, SAVED_AT, pipe=model, optimizer=opt)
    return losses


def _opt_state(named: Any, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in named}


def _layouts(root: str, plan_a: str, plan_b: str) -> dict[str, Any]:
    """Every 2-rank layout of the module docstring, in order; what the test compares."""
    x, y = _batch()
    out: dict[str, Any] = {}
    model = _model(0)  # one model object, traced once: each layout sets its values afresh

    def run(plan: str, seed: int, load: str | None = None, save: str | None = None) -> tuple[Any, ...]:
        model.load_state_dict(_model(seed).state_dict())
        pipe = Pipeline(model, Plan.from_json(plan), loss_fn=gpt_loss, timeout=60.0)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        start = 0
        if load is not None:
            checkpointing.load(Path(root) / load, pipe=pipe, optimizer=opt)
            start = SAVED_AT
        loaded = (
            {n: p.detach().clone() for n, p in pipe.named_parameters()},
            _opt_state(pipe.named_parameters(), opt),
        )
        if save is not None and load is not None:
            checkpointing.save(Path(root) / save, SAVED_AT, pipe=pipe, optimizer=opt)
        at = Path(root) / save if save is not None and load is None else None
        losses = _train(lambda: pipe.step(x, y), opt, range(start, STEPS), at, pipe)
        pipe.close()
        return losses, loaded

    out["a"], _ = run(plan_a, 0, save="a")
    out["a_resumed"], out["a_loaded"] = run(plan_a, 7, load="a")
    out["b"], out["b_loaded"] = run(plan_b, 8, load="a", save="b")
    out["a_from_b"], _ = run(plan_a, 9, load="b")
    out["a_from_one"], _ = run(plan_a, 10, load="one", save="a_one")
    return out


def _single(root: Path, seed: int, load: str | None, save: str | None) -> tuple[list[float], nn.Module, Any]:
    x, y = _batch()
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if load is not None:
        checkpointing.load(root / load, pipe=model, optimizer=opt)
    loaded = (
        {n: p.detach().clone() for n, p in model.named_parameters()},
        _opt_state(model.named_parameters(), opt),
    )
    start = SAVED_AT if load is not None else 0
    at = root / save if save is not None else None

    def step() -> torch.Tensor:
        loss = gpt_loss(model(x), y)
        loss.backward()
        return loss.detach()

    return _train(step, opt, range(start, STEPS), at, model), model, loaded


def test_traced_checkpoints_reshard_across_stage_counts_and_resume_exactly(tmp_path: Path) -> None:
    model = _model(0)
    sample = _batch()[0][: BATCH // M]
    prof = profile(model, sample, warmup=0, repeat=1)
    # balanced by flops: the same layouts on any machine, every stage with parameters to save
    plan_a = partition(
        model,
        2,
        sample,
        profile=prof,
        schedule="interleaved-1f1b",
        n_virtual=2,
        n_microbatches=M,
        cost="flops",
    )
    plan_b = partition(model, 2, sample, profile=prof, schedule="1f1b", n_microbatches=M, cost="flops")
    assert (plan_a.n_virtual, plan_b.n_virtual) == (2, 1)

    one, _, _ = _single(tmp_path, 0, None, "one")
    results = run_ranks(
        tmp_path, _layouts, 2, str(tmp_path), plan_a.to_json(), plan_b.to_json(), timeout=300.0
    )

    for r, got in enumerate(results):
        assert got["a"] == results[0]["a"]  # the last stage's loss, on every rank
        assert got["a"][0] > got["a"][-1]  # it trains
        assert got["a_resumed"] == got["a"][SAVED_AT:], r  # 2 x 2 -> 2 x 2
        assert got["a_from_b"] == got["a"][SAVED_AT:], r  # 2 x 2 -> 2 x 1 -> 2 x 2
        _close(got["b"], got["a"][SAVED_AT:])  # 2 x 1 trains on from 2 x 2's state
        _close(got["a_from_one"], one[SAVED_AT:])  # 2 x 2 trains on from one process's

    # 2 x 1 holds exactly 2 x 2's state: every parameter and optimizer entry, every copy of tok.weight
    (params_a, opt_a), (params_b, opt_b) = ({}, {}), ({}, {})
    for got in results:
        params_a.update(got["a_loaded"][0])
        opt_a.update(got["a_loaded"][1])
        params_b.update(got["b_loaded"][0])
        opt_b.update(got["b_loaded"][1])
    for got in results:  # each 2 x 1 rank, its copy of a tied weight included
        for name, p in got["b_loaded"][0].items():
            assert torch.equal(p, params_a[name]), name
    assert "tok.weight" in results[0]["b_loaded"][0] and "tok.weight" in results[1]["b_loaded"][0]
    assert params_a.keys() == params_b.keys() == opt_a.keys() == opt_b.keys()
    for name, entries in opt_a.items():
        assert entries.keys() == opt_b[name].keys()
        assert all(torch.equal(v, opt_b[name][k]) for k, v in entries.items()), name

    # one process: 2 x 2's state exactly; and a round trip 1 -> 2 x 2 -> 1 reproduces its losses
    losses, _, (params_one, opt_one) = _single(tmp_path, 11, "a", None)
    assert params_one.keys() == params_a.keys()
    assert all(torch.equal(p, params_a[n]) for n, p in params_one.items())
    assert all(torch.equal(v, opt_a[n][k]) for n, e in opt_one.items() for k, v in e.items())
    _close(losses, results[0]["a"][SAVED_AT:])
    round_trip, _, _ = _single(tmp_path, 12, "a_one", None)
    assert round_trip == one[SAVED_AT:]

    # the tied weight is one entry, under its first name
    for folder in ("a", "b", "a_one"):
        keys = (
            FileSystemReader(str(checkpointing.latest(tmp_path / folder))).read_metadata().state_dict_metadata
        )
        assert [k for k in keys if k.startswith("model/") and k.endswith("tok.weight")] == [
            "model/tok.weight"
        ]
        assert not any("head" in k for k in keys), folder


def test_a_ranks_stages_merge_under_their_names_each_tensor_once() -> None:
    """Two local stages with their own containers at one path (``blocks``), a root parameter both
    read (one object), their own root parameters and a non-persistent buffer: one tree, every name."""
    from pipeline.checkpoint.state import _merge

    shared, lin0, lin2 = nn.Parameter(torch.ones(3)), nn.Linear(2, 2), nn.Linear(2, 2)
    stages = [nn.Module(), nn.Module()]
    for s, (stage, lin) in enumerate(zip(stages, (lin0, lin2), strict=True)):
        stage.register_parameter("scale", shared)
        stage.register_parameter(f"own{s}", nn.Parameter(torch.full((2,), float(s))))
        stage.blocks = nn.Module()
        stage.blocks.add_module(str(2 * s), lin)
        stage.blocks.register_buffer(f"mask{s}", torch.ones(1), persistent=False)
    union = _merge(stages)
    params = dict(union.named_parameters())
    assert sorted(params) == sorted(
        ["scale", "own0", "own1", "blocks.0.weight", "blocks.0.bias", "blocks.2.weight", "blocks.2.bias"]
    )
    assert params["scale"] is shared and params["blocks.2.weight"] is lin2.weight  # the live tensors
    assert union.blocks.get_submodule("0") is lin0  # a module only one stage holds is kept whole
    assert sorted(n for n, _ in union.named_buffers()) == ["blocks.mask0", "blocks.mask1"]
    assert not any("mask" in k for k in union.state_dict())  # not persistent: not saved

    stages[1].register_parameter("scale", nn.Parameter(torch.ones(3)))  # another tensor, the same name
    with pytest.raises(RuntimeError, match="different parameters named scale"):
        _merge(stages)
