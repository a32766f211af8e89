"""Outputs, uneven batches and prefetched inputs, against one process, on gloo and the NCCL emulation.

One job per (ranks, backend) of the shared launch (tests/dist.py) runs every configuration and
returns, per rank:

    evaluate(x, y, return_outputs=True)   -> (loss, outputs)    == one process, eval mode
    predict(x), predict(x, dst=d)         -> outputs / None     == model(x) in eval mode
    step(x, y) with B rows, m micro-batches, B % m != 0
                                          -> loss, every gradient  == one process on the whole batch

on every schedule: 30 rows with m = 4, and 7 rows with m = 3 (interleaved-1f1b
needs m a multiple of p: 7 rows with m = p there). Data goes only where it is
used: stage 0's rank gets the inputs, the last stage's the targets, a middle
rank calls ``step()`` with nothing. One pipeline also runs batches of changing
sizes, and one runs a few SGD steps with the next batch prefetched.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.plan import Plan
from pipeline.reference.models import mlp
from pipeline.runtime.pipe import Pipeline
from tests.dist import job
from tests.pipe_common import CarriesIds, assert_close, balance_of, grads_of

WIDTH, DEPTH = 8, 8
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2))
BACKENDS = ("gloo", "nccl-emulated")
CHANGING_ROWS = (32, 30, 7, 32)  # one pipeline, m = 4: a new signature each time, then the first again
PREFETCH_ROWS = (30, 32, 30)  # SGD steps, each prefetching the next batch


def _configs(p: int) -> list[tuple[str, str, int, int, int]]:
    """(model, schedule, v, m, rows): every schedule with B % m != 0, and the tuple model."""
    out = []
    for sched, v in SCHEDULES:
        out.append(("mlp", sched, v, 4, 30))
        out.append(("mlp", sched, v, p if v > 1 else 3, 7))
    out += [("pair", "1f1b", 1, 4, 30), ("pair", "interleaved-1f1b", 2, 4, 30)]
    return out


def _pair_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out[0], y)


def _build(name: str, rows: int, seed: int = 1) -> tuple[nn.Sequential, Any, torch.Tensor, Any]:
    """(model, inputs, targets, loss_fn): the model from seed 0, the batch from ``seed``."""
    torch.manual_seed(0)
    if name == "mlp":
        model, _ = mlp(width=WIDTH, depth=DEPTH, batch_size=1)
    else:
        model = nn.Sequential(
            *[CarriesIds(k == 0, k == DEPTH - 1, WIDTH, tuple_output=True) for k in range(DEPTH)]
        )
    gen = torch.Generator().manual_seed(seed)
    x: Any = torch.randn(rows, WIDTH, generator=gen)
    if name == "pair":
        x = torch.randint(0, 16, (rows, 3), generator=gen)
    y = torch.randn(rows, WIDTH, generator=gen)
    return model, x, y, nn.functional.mse_loss if name == "mlp" else _pair_loss


def _pipeline(model: nn.Sequential, sched: str, v: int, m: int, loss_fn: Any) -> Pipeline:
    p = dist.get_world_size()
    plan = Plan(balance=balance_of(len(model), p * v), schedule=sched, n_microbatches=m, n_virtual=v)
    return Pipeline(model, plan, loss_fn=loss_fn, timeout=30.0)


def _data(pipe: Pipeline, x: Any, y: Any) -> tuple[Any, Any]:
    """Only what this rank uses: inputs on stage 0's rank, targets on the last stage's."""
    return (x if pipe.needs_inputs else None, y if pipe.needs_targets else None)


def _step(pipe: Pipeline, x: Any, y: Any) -> float:
    if pipe.needs_inputs or pipe.needs_targets:
        return pipe.step(*_data(pipe, x, y))
    return pipe.step()  # a middle rank: nothing to pass


def _matrix() -> dict[str, Any]:
    p = dist.get_world_size()
    dst = 1 if p > 2 else 0  # p = 4: rank 1 is no neighbour of the last rank (3); p = 2: rank 0 is
    out: dict[str, Any] = {}
    for name, sched, v, m, rows in _configs(p):
        model, x, y, loss_fn = _build(name, rows)
        pipe = _pipeline(model, sched, v, m, loss_fn)
        xs, ys = _data(pipe, x, y)
        ev = pipe.evaluate(xs, ys, return_outputs=True)
        pred = pipe.predict(xs)
        to_dst = pipe.predict(xs, dst=dst)
        ev_dst = pipe.evaluate(xs, ys, return_outputs=True, dst=p - 1)  # the last rank itself
        loss = _step(pipe, x, y)
        out[f"{name}/{sched}/m={m}/B={rows}"] = {
            "eval": ev, "predict": pred, "dst": (dst, to_dst, ev_dst), "loss": loss,
            "grads": grads_of(pipe.named_parameters()), "flags": (pipe.needs_inputs, pipe.needs_targets),
        }  # fmt: skip
    # batches of changing sizes on one pipeline
    model, _, _, loss_fn = _build("mlp", 1)
    pipe = _pipeline(model, "1f1b", 1, 4, loss_fn)
    for k, rows in enumerate(CHANGING_ROWS):
        _, x, y, _ = _build("mlp", rows, seed=10 + k)
        for t in pipe.parameters():
            t.grad = None
        loss = _step(pipe, x, y)
        out[f"changing/{k}"] = (loss, grads_of(pipe.named_parameters()), pipe.predict(_data(pipe, x, y)[0]))
    # SGD steps, each prefetching the next batch where it is used
    model, _, _, loss_fn = _build("mlp", 1)
    pipe = _pipeline(model, "1f1b", 1, 4, loss_fn)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    batches = [_data(pipe, *_build("mlp", rows, seed=20 + k)[1:3]) for k, rows in enumerate(PREFETCH_ROWS)]
    losses = []
    for k, batch in enumerate(batches):
        following = batches[k + 1] if k + 1 < len(batches) else None
        losses.append(pipe.step(*batch, prefetch=following))
        opt.step()
        opt.zero_grad()
    params = {n: t.detach().clone() for n, t in pipe.named_parameters()}
    used = pipe.runner.placer.prefetch_used
    out["prefetch"] = (losses, params, used, pipe.needs_inputs, pipe.needs_targets)
    return out


_JOBS = {
    (p, b): job(p, _matrix, timeout=180.0, backend=b, batch="c" if p == 2 else "b")
    for p, b in itertools.product((2, 4), BACKENDS)
}


@pytest.fixture(
    scope="module", params=list(itertools.product((2, 4), BACKENDS)), ids=lambda c: f"{c[0]}-{c[1]}"
)
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[Any]]:
    p, backend = request.param
    return p, _JOBS[p, backend].results(tmp_path_factory)


def _reference(name: str, rows: int, seed: int = 1) -> tuple[float, dict[str, torch.Tensor], Any, float]:
    """One process, the whole batch: (loss, grads, eval-mode outputs, eval-mode loss)."""
    model, x, y, loss_fn = _build(name, rows, seed)
    loss = loss_fn(model(x), y)
    loss.backward()
    model.eval()
    with torch.no_grad():
        outputs = model(x)
        ev = float(loss_fn(outputs, y))
    return float(loss.detach()), grads_of(model.named_parameters()), outputs, ev


def _same_outputs(got: Any, ref: Any, label: str) -> None:
    got_t = got if isinstance(got, tuple) else (got,)
    ref_t = ref if isinstance(ref, tuple) else (ref,)
    assert isinstance(got, tuple) == isinstance(ref, tuple), label
    assert len(got_t) == len(ref_t), label
    for k, (g, r) in enumerate(zip(got_t, ref_t, strict=True)):
        assert g.shape == r.shape and g.dtype == r.dtype, (label, k, g.shape, r.shape)
        assert_close({"out": g}, {"out": r}, f"{label} output {k}")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_uneven_batches_equal_one_process_on_every_schedule(world: tuple[int, list[Any]]) -> None:
    p, results = world
    for name, sched, _, m, rows in _configs(p):
        key = f"{name}/{sched}/m={m}/B={rows}"
        assert rows % m != 0, key  # uneven indeed
        loss_ref, grads_ref, _, _ = _reference(name, rows)
        for r, res in enumerate(results):
            assert _rel(res[key]["loss"], loss_ref) < 1e-5, (key, r, res[key]["loss"], loss_ref)
        merged = {k: g for res in results for k, g in res[key]["grads"].items()}
        assert sum(len(res[key]["grads"]) for res in results) == len(grads_ref), key  # each once
        assert_close(merged, grads_ref, key)


def test_evaluate_and_predict_return_the_models_outputs_on_every_rank(world: tuple[int, list[Any]]) -> None:
    p, results = world
    for name, sched, _, m, rows in _configs(p):
        key = f"{name}/{sched}/m={m}/B={rows}"
        _, _, outputs, ev_ref = _reference(name, rows)
        for r, res in enumerate(results):
            label = f"{key} rank {r}"
            loss, ev_out = res[key]["eval"]
            assert _rel(loss, ev_ref) < 1e-5, (label, loss, ev_ref)
            _same_outputs(ev_out, outputs, label + " evaluate")
            _same_outputs(res[key]["predict"], outputs, label + " predict")


def test_outputs_reach_only_the_rank_asked_for(world: tuple[int, list[Any]]) -> None:
    p, results = world
    for name, sched, _, m, rows in _configs(p):
        key = f"{name}/{sched}/m={m}/B={rows}"
        _, _, outputs, ev_ref = _reference(name, rows)
        for r, res in enumerate(results):
            dst, to_dst, (loss, ev_out) = res[key]["dst"]
            assert _rel(loss, ev_ref) < 1e-5  # the loss still reaches every rank
            if r == dst:
                _same_outputs(to_dst, outputs, f"{key} predict(dst={dst})")
            else:
                assert to_dst is None, (key, r)
            if r == p - 1:
                _same_outputs(ev_out, outputs, f"{key} evaluate(dst={p - 1})")
            else:
                assert ev_out is None, (key, r)


def test_data_is_needed_only_on_the_first_and_last_stages_ranks(world: tuple[int, list[Any]]) -> None:
    p, results = world
    for name, sched, v, m, rows in _configs(p):
        flags = [res[f"{name}/{sched}/m={m}/B={rows}"]["flags"] for res in results]
        # stage 0 on rank 0; the last stage (k - 1 = p * v - 1) on rank p - 1
        assert flags == [(r == 0, r == p - 1) for r in range(p)], (sched, v, flags)


def test_batches_of_changing_sizes_on_one_pipeline(world: tuple[int, list[Any]]) -> None:
    _, results = world
    for k, rows in enumerate(CHANGING_ROWS):
        loss_ref, grads_ref, outputs, _ = _reference("mlp", rows, seed=10 + k)
        for r, res in enumerate(results):
            assert _rel(res[f"changing/{k}"][0], loss_ref) < 1e-5, (k, r)
            _same_outputs(res[f"changing/{k}"][2], outputs, f"changing {k} rank {r}")
        merged = {n: g for res in results for n, g in res[f"changing/{k}"][1].items()}
        assert_close(merged, grads_ref, f"changing {k} ({rows} rows)")


def test_prefetched_batches_give_the_same_steps(world: tuple[int, list[Any]]) -> None:
    _, results = world
    model, _, _, loss_fn = _build("mlp", 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for k, rows in enumerate(PREFETCH_ROWS):
        _, x, y, _ = _build("mlp", rows, seed=20 + k)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    ref = {n: t.detach() for n, t in model.named_parameters()}
    merged = {n: t for res in results for n, t in res["prefetch"][1].items()}
    assert_close(merged, ref, "parameters after prefetched steps")
    for r, res in enumerate(results):
        got, _, used, needs_inputs, needs_targets = res["prefetch"]
        assert all(_rel(a, b) < 1e-5 for a, b in zip(got, losses, strict=True)), (r, got, losses)
        # every batch after the first came from its prefetched copy, where it is used
        assert used == (len(PREFETCH_ROWS) - 1) * (int(needs_inputs) + int(needs_targets)), (r, used)


def _first_call_to_one_rank() -> dict[str, Any]:
    """On NCCL a group's communicator is made at its first operation, with all its ranks: a first
    message between two non-neighbours alone would hang (the emulation raises). Each call here is
    the first on a fresh group: ``predict(dst=d)`` of the tuple model, and ``gather_state_dict(d)``."""
    p = dist.get_world_size()
    model, x, _, loss_fn = _build("pair", 8)
    out: dict[str, Any] = {}
    for dst in range(p):
        for call in ("predict", "gather"):
            group = dist.new_group(list(range(p)))  # a fresh communicator: the call below is its first use
            plan = Plan(balance=balance_of(len(model), p), schedule="1f1b", n_microbatches=2)
            pipe = Pipeline(model, plan, loss_fn=loss_fn, group=group, timeout=30.0)
            got = pipe.predict(x if pipe.needs_inputs else None, dst=dst) if call == "predict" else None
            state = pipe.gather_state_dict(dst) if call == "gather" else None
            out[f"{call}/{dst}"] = got if call == "predict" else None if state is None else sorted(state)
            pipe.close()
    return out


_FIRST = {
    p: job(p, _first_call_to_one_rank, backend="nccl-emulated", timeout=120.0, batch="b") for p in (4, 8)
}


@pytest.mark.parametrize("p", [4, 8])
def test_output_to_one_rank_works_as_the_groups_first_call(
    p: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = _FIRST[p].results(tmp_path_factory)
    model, x, _, _ = _build("pair", 8)
    model.eval()
    with torch.no_grad():
        ref = model(x)
    names = sorted(model.state_dict())
    for dst in range(p):
        for r, res in enumerate(results):
            if r == dst:
                _same_outputs(res[f"predict/{dst}"], ref, f"p={p} predict(dst={dst}) first")
                assert res[f"gather/{dst}"] == names, (p, dst)
            else:
                assert res[f"predict/{dst}"] is None and res[f"gather/{dst}"] is None, (p, dst, r)
