"""Hugging Face transformers models, built from small configs, through ``partition`` and ``Pipeline``.

    # p: ranks, m: micro-batches

Each architecture of ``tests/hf_models.py`` (Llama, Qwen2 tied, Mistral, Gemma, Phi-3, GPT-NeoX,
OPT, GPT-2, BERT, ViT, a BatchNorm ResNet) is partitioned by tracing, then trained one step:

    p = 2:  1f1b, recompute never         p = 4:  1f1b, recompute never
            zb-h1, recompute always               gpipe, recompute except_last
            every architecture                    Llama, GPT-2, BERT, the ResNet

The loss, every gradient and every floating-point buffer (BatchNorm's running statistics) must equal
one process running the same m micro-batches (fp32, relative error < 1e-5), the reference at the
ranks' thread count (one). Models that take an attention mask get one with padded rows. One launch
per rank count runs the whole matrix; its ranks fork from a server that imported transformers and
these architectures (tests/hf_models.py). At 4 ranks, one model of each kind (rotary decoder with
grouped-query attention, tied weights, an encoder with a mask, BatchNorm buffers): every rank traces
every model it runs, the suite's largest single cost.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch

from partitioner import partition, profile
from pipeline.plan import Plan
from pipeline.runtime.pipe import Pipeline
from tests.dist import job
from tests.hf_models import CASES, build, loss_of
from tests.pipe_common import assert_close

pytest.importorskip("transformers")

B, M = 8, 4
RUNS = {2: [("1f1b", "never"), ("zb-h1", "always")], 4: [("1f1b", "never"), ("gpipe", "except_last")]}
NAMES = tuple(CASES)
AT = {2: NAMES, 4: ("llama", "gpt2", "bert", "resnet")}  # the architectures run at each rank count


def _inputs(x: tuple[torch.Tensor, ...]) -> Any:
    return x[0] if len(x) == 1 else x


@functools.cache
def _profile(name: str) -> Any:
    model, x, _ = build(name, B)
    return profile(model, _inputs(tuple(t[: B // M] for t in x)), warmup=0, repeat=1)


@functools.cache
def _plan(name: str, p: int) -> Plan:
    model, x, _ = build(name, B)
    return partition(
        model, p, _inputs(tuple(t[: B // M] for t in x)), n_microbatches=M, profile=_profile(name)
    )


def _state(named: Any) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in named if t.is_floating_point()}


def _reference(name: str) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, micro-batch by micro-batch, on one thread: (loss, gradients, float buffers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, x, y = build(name, B)
        losses = []
        for rows in torch.arange(B).chunk(M):
            loss = loss_of(name)(model(*(t[rows] for t in x)), y[rows])
            (loss / M).backward()
            losses.append(float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return sum(losses) / M, grads, _state(model.named_buffers())


def _rank(plans: dict[str, str], p: int) -> dict[str, list[Any]]:
    """Every model under each (schedule, recompute) of ``RUNS[p]``: loss, gradients, float buffers."""
    out: dict[str, list[Any]] = {}
    for name, plan_json in plans.items():
        runs = []
        model, x, y = build(name, B)  # one model object: traced once, for every run (graph_stages.py)
        start = copy.deepcopy(model.state_dict())
        for schedule, recompute in RUNS[p]:
            model.load_state_dict(start)  # BatchNorm's statistics as built
            model.zero_grad(set_to_none=True)
            plan = Plan.from_json(plan_json).replace(schedule=schedule, recompute=recompute)
            pipe = Pipeline(model, plan, loss_fn=loss_of(name), timeout=60.0)
            loss = pipe.step(_inputs(x), y)
            grads = {k: q.grad.clone() for k, q in pipe.named_parameters() if q.grad is not None}
            runs.append((loss, grads, _state(pipe.named_buffers())))
            pipe.close()
        out[name] = runs
    return out


_RAN = {
    p: job(
        p,
        _rank,
        make_args=lambda _, p=p: ({n: _plan(n, p).to_json() for n in AT[p]}, p),
        timeout=400.0,
        batch="hf",
    )
    for p in (2, 4)
}


@pytest.mark.parametrize(("p", "name"), [(p, n) for p in (2, 4) for n in AT[p]])
def test_trains_equal_to_one_process(p: int, name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    results = _RAN[p].results(tmp_path_factory)
    ref_loss, ref_grads, ref_buffers = _reference(name)
    for c, (schedule, recompute) in enumerate(RUNS[p]):
        label = f"{name} p={p} {schedule} recompute={recompute}"
        grads: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        for r in range(p):
            loss, g, b = results[r][name][c]
            assert loss == pytest.approx(ref_loss, rel=1e-5), f"{label} rank {r}"
            assert_close(g, {k: ref_grads[k] for k in g}, f"{label} rank {r}")
            assert_close(b, {k: ref_buffers[k] for k in b}, f"{label} rank {r} buffers")
            grads.update(g)
            buffers.update(b)
        assert set(grads) == set(ref_grads), label  # every parameter, under the model's own name
        assert set(buffers) == set(ref_buffers), label  # every float buffer, and no trace constant


def test_size_derived_tensors_are_no_layer_and_recomputed_per_stage() -> None:
    """Llama's position ids, causal mask and rotary tables come from the input's sizes and a buffer:
    no layer of their own, and every decoder layer reads the rotary buffer it recomputes them from."""
    plan = _plan("llama", 2)
    assert plan.graph is not None
    names = plan.graph.layers
    assert not any(n.startswith(("arange", "ones", "full")) or "rotary" in n for n in names), names
    assert names[0] == "model.model.embed_tokens" and names[-1] == "model.lm_head"
    assert sum(n.startswith("model.model.layers.") for n in names) == 4


EMULATED = ("llama", "opt")  # rotary tables and a mask; positions made from the mask


def _emulated(plans: dict[str, str]) -> dict[str, Any]:
    """The NCCL code path (emulated on gloo: a meta default device, strict streams): zb-h1 with
    recomputation, so that every derived tensor is made again under the emulation's rules too."""
    out = {}
    for name, plan_json in plans.items():
        model, x, y = build(name, B)
        plan = Plan.from_json(plan_json).replace(schedule="zb-h1", recompute="always")
        pipe = Pipeline(model, plan, loss_fn=loss_of(name), timeout=60.0)
        loss = pipe.step(_inputs(x), y)
        out[name] = (loss, {k: q.grad.clone() for k, q in pipe.named_parameters() if q.grad is not None})
        pipe.close()
    return out


_EMULATED = job(2, _emulated, make_args=lambda _: ({n: _plan(n, 2).to_json() for n in EMULATED},),
                backend="nccl-emulated", timeout=400.0, batch="hf")  # fmt: skip


@pytest.mark.parametrize("name", EMULATED)
def test_trains_equal_to_one_process_on_the_nccl_path(
    tmp_path_factory: pytest.TempPathFactory, name: str
) -> None:
    results = _EMULATED.results(tmp_path_factory)
    ref_loss, ref_grads, _ = _reference(name)
    grads: dict[str, torch.Tensor] = {}
    for r, by_name in enumerate(results):
        loss, g = by_name[name]
        assert loss == pytest.approx(ref_loss, rel=1e-5), r
        assert_close(g, {k: ref_grads[k] for k in g}, f"{name} nccl-emulated rank {r}")
        grads.update(g)
    assert set(grads) == set(ref_grads)
