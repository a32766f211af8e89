"""The library's step companions against one process: clip_grad_norm_, grads_finite, gather_state_dict.

One job of 4 ranks (in the shared launch, tests/dist.py) runs every configuration: the 2-rank
ones on a group of ranks 0 and 1 (ranks 2 and 3 skip them), the 4-rank ones on the world. Each
configuration runs the same sequence as a single process does on the whole
model, micro-batch by micro-batch (so BatchNorm's statistics match):

    step, clip (2-norm, clipping)  |  step, clip (inf-norm, clipping)  |  step, clip (no clipping), SGD
    -> the state dict, gathered    |  then the all-finite checks, NaN or inf planted on one rank at a time
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.plan import Plan
from pipeline.runtime.pipe import Pipeline
from tests.dist import job
from tests.pipe_common import BATCH, M, assert_close, grads_of, microbatched_reference

CLIPS = [(1e-2, 2.0), (1e-3, math.inf), (1e6, 2.0)]  # (max_norm, norm_type): clip, clip, leave
CASES = [
    (2, "1f1b"),
    (2, "interleaved-1f1b"),
    (4, "1f1b"),
    (4, "interleaved-1f1b"),
    (4, "zb-h1"),
]  # (p, schedule)


def _build() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """8 named layers with BatchNorm buffers: every stage of up to 8 keeps the model's names."""
    torch.manual_seed(0)
    names = ("embed", "bn0", "act0", "mix", "bn1", "act1", "head0", "head1")
    # no bias before a BatchNorm: its gradient would be analytically zero, in fp32 round-off
    layers = (nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8, bias=False))
    layers += (nn.BatchNorm1d(8), nn.Tanh())
    layers += (nn.Linear(8, 8), nn.Linear(8, 4))
    model = nn.Sequential(OrderedDict(zip(names, layers, strict=True)))
    # 8 rows per micro-batch: BatchNorm over 2 rows would output +-1 whatever its input, and the
    # gradients before it would be round-off
    return model, torch.randn(4 * BATCH, 6), torch.randn(4 * BATCH, 4)


def _balance(p: int, sched: str) -> list[int]:
    n_stages = p * (2 if sched == "interleaved-1f1b" else 1)
    return [8 // n_stages] * n_stages


def _plant(pipe: Pipeline, value: float) -> tuple[torch.Tensor, float]:
    grad = next(t for t in pipe.parameters()).grad
    assert grad is not None
    old = float(grad.view(-1)[0])
    grad.view(-1)[0] = value
    return grad, old


def _run(p: int, sched: str, group: Any) -> dict[str, Any]:
    model, x, y = _build()
    plan = Plan(balance=_balance(p, sched), schedule=sched, n_microbatches=M)
    pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, group=group, timeout=30.0)
    rank, out = pipe.rank, {"norms": [], "grads": []}
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for max_norm, norm_type in CLIPS:
        opt.zero_grad()
        pipe.step(x, y)
        out["norms"].append(pipe.clip_grad_norm_(max_norm, norm_type))
        out["grads"].append(grads_of(pipe.named_parameters()))
    opt.step()
    dst = p - 1 if sched == "interleaved-1f1b" else 0
    out["state"] = pipe.gather_state_dict(dst)
    out["names"] = ([k for k, _ in pipe.named_parameters()], [k for k, _ in pipe.named_buffers()])
    out["buffers"] = len(list(pipe.buffers()))
    # all finite, then a NaN and an inf on one rank at a time: every rank answers the same
    flags = [pipe.grads_finite()]
    for bad in range(p):
        for value in (math.nan, math.inf):
            planted = _plant(pipe, value) if rank == bad else None
            flags.append(pipe.grads_finite())
            if planted is not None:
                planted[0].view(-1)[0] = planted[1]
    flags.append(pipe.grads_finite())  # restored
    out["finite"] = flags
    planted = _plant(pipe, math.nan) if rank == p - 1 else None
    try:
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    except RuntimeError as exc:
        out["nonfinite"] = str(exc)
    pipe.close()
    return out


def _everything() -> dict[str, Any]:
    pair = dist.new_group([0, 1], backend="gloo")  # every rank makes every group
    out = {}
    for p, sched in CASES:
        if p == 2 and dist.get_rank() >= 2:
            continue  # Pipelines on the pair do not shift the world's Pipelines' store keys
        out[f"{p}/{sched}"] = _run(p, sched, pair if p == 2 else None)
    return out


_EVERYTHING = job(4, _everything, timeout=120.0, batch="b")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _EVERYTHING.results(tmp_path_factory)


def _reference() -> dict[str, Any]:
    """The same sequence in one process on the whole model, with torch's clip_grad_norm_."""
    model, x, y = _build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"norms": [], "grads": []}
    for max_norm, norm_type in CLIPS:
        opt.zero_grad()
        microbatched_reference(model, x, y, nn.functional.mse_loss)
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
        out["grads"].append(grads_of(model.named_parameters()))
    opt.step()
    out["state"] = {k: t.detach().clone() for k, t in model.state_dict().items()}
    return out


@pytest.mark.parametrize(("p", "sched"), CASES)
def test_clip_grad_norm_equals_one_process(results: list[dict[str, Any]], p: int, sched: str) -> None:
    ref, ranks = _reference(), [r[f"{p}/{sched}"] for r in results[:p]]
    assert ref["norms"][0] > CLIPS[0][0] and ref["norms"][1] > CLIPS[1][0]  # the first two do clip
    for k, (max_norm, norm_type) in enumerate(CLIPS):
        label = f"p={p} {sched} clip({max_norm}, {norm_type})"
        for r in ranks:  # the total on every rank
            assert abs(r["norms"][k] - ref["norms"][k]) <= 1e-6 * ref["norms"][k], (label, r["norms"][k])
        merged = {name: g for r in ranks for name, g in r["grads"][k].items()}
        assert sum(len(r["grads"][k]) for r in ranks) == len(ref["grads"][k])  # each parameter once
        assert_close(merged, ref["grads"][k], label, rel=1e-6)


@pytest.mark.parametrize(("p", "sched"), CASES)
def test_gather_state_dict_is_the_whole_models(results: list[dict[str, Any]], p: int, sched: str) -> None:
    ref, ranks = _reference()["state"], [r[f"{p}/{sched}"] for r in results[:p]]
    dst = p - 1 if sched == "interleaved-1f1b" else 0
    assert [r["state"] is None for r in ranks] == [q != dst for q in range(p)]
    state = ranks[dst]["state"]
    assert list(state) == list(ref)  # the model's names, in its order: parameters and buffers
    assert all(t.device.type == "cpu" and t.dtype == ref[k].dtype for k, t in state.items())
    assert int(state["bn0.num_batches_tracked"]) == len(CLIPS) * M  # one update per micro-batch
    assert_close(state, ref, f"p={p} {sched} state")
    model = _build()[0]
    params = sorted(n for r in ranks for n in r["names"][0])
    buffers = sorted(n for r in ranks for n in r["names"][1])
    assert params == sorted(n for n, _ in model.named_parameters())
    assert buffers == sorted(n for n, _ in model.named_buffers())
    assert sum(r["buffers"] for r in ranks) == len(buffers)


@pytest.mark.parametrize(("p", "sched"), CASES)
def test_grads_finite_is_agreed_on_every_rank(results: list[dict[str, Any]], p: int, sched: str) -> None:
    ranks = [r[f"{p}/{sched}"] for r in results[:p]]
    expected = [True] + [False] * (2 * p) + [True]  # a NaN, then an inf, on each rank in turn
    assert [r["finite"] for r in ranks] == [expected] * p
    for r in ranks:  # a NaN anywhere: every rank refuses to clip, with the same message
        assert r["nonfinite"] == (
            "the total norm of order 2.0 of the pipeline's gradients is nan, so they cannot be clipped; "
            "pass error_if_nonfinite=False to clip anyway, or skip the optimizer step when grads_finite() "
            "is False"
        )


def test_a_module_used_twice_on_one_rank_counts_once() -> None:
    # the same Linear at layers 0 and 2, stages 0 and 1, both on this one rank (interleaved, v = 2)
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(4, 3))
    x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 3)
    pipe = Pipeline(
        model, [2, 2], schedule="interleaved-1f1b", n_microbatches=M, loss_fn=nn.functional.mse_loss
    )
    pipe.step(x, y)
    got = pipe.clip_grad_norm_(0.01)
    got_grads = grads_of(pipe.named_parameters())
    state = pipe.gather_state_dict()
    assert state is not None and list(state) == list(model.state_dict())  # "0.weight" and "2.weight"
    model.zero_grad()
    microbatched_reference(model, x, y, nn.functional.mse_loss)
    ref = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))
    assert abs(got - ref) <= 1e-6 * ref
    assert_close(got_grads, grads_of(model.named_parameters()), "shared", rel=1e-6)
    assert len(list(pipe.parameters())) == 4 == len(list(model.parameters()))  # for the optimizer too


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda pipe: pipe.clip_grad_norm_(1.0, norm_type=0), r"norm_type \(0\) must be > 0 or inf"),
        (lambda pipe: pipe.clip_grad_norm_(-1.0), r"max_norm \(-1.0\) must be a number >= 0"),
        (
            lambda pipe: pipe.gather_state_dict(dst=1),
            r"dst \(1\) must be a rank of the pipeline's group, 0 to 0",
        ),
    ],
)
def test_bad_arguments(call: Any, error: str) -> None:
    model, x, y = _build()
    pipe = Pipeline(model, [8], loss_fn=nn.functional.mse_loss, n_microbatches=M)
    pipe.step(x, y)
    before = grads_of(pipe.named_parameters())
    with pytest.raises(ValueError, match=error):
        call(pipe)
    assert_close(grads_of(pipe.named_parameters()), before, "untouched", rel=1e-12)


def test_the_norm_of_bf16_gradients_accumulates_in_fp32() -> None:
    """One process, no group: each tensor's norm in fp32 (a bf16 norm rounds to 8 bits of mantissa)."""
    from pipeline.runtime.step import grads

    torch.manual_seed(0)
    gs = [torch.randn(n).to(torch.bfloat16) for n in (1000, 3001, 517, 64)]
    exact = torch.cat([g.double() for g in gs])
    for q in (2.0, 1.0, 3.0):
        want = float(torch.linalg.vector_norm(exact, q))
        got = grads.total_norm(gs, q, None, torch.device("cpu"))
        assert got.dtype == torch.float32 and abs(float(got) - want) <= 1e-5 * want, (q, float(got), want)
