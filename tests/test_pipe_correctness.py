"""Pipeline end to end: every schedule x recompute mode x model against one process and torchgpipe.

Ranks are slow to spawn, so each world size runs all its configurations as one job of
the shared launch (tests/dist.py) and returns losses, gradients and measurements to the parent. The
configurations come both ways in: a balance list with keywords, and a ``Plan``
with its defaults (m = p, v = 2 for interleaved-1f1b).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.plan import Plan
from pipeline.reference.models import mlp
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.actions import Action
from pipeline.schedules.program import Post, Wait
from pipeline.schedules.schedule import SCHEDULES, default_n_virtual, schedule
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import Timeline
from tests.dist import job
from tests.pipe_common import (
    BATCH,
    CONFIGS,
    MODELS,
    RECOMPUTES,
    M,
    assert_close,
    balance_of,
    build,
    grads_of,
    reference,
)


def _matrix() -> dict[str, Any]:
    """On every rank: all configurations; per config the loss, local grads and peak activations."""
    p, out = dist.get_world_size(), {}
    for name, (sched, v), mode in itertools.product(MODELS, CONFIGS, RECOMPUTES):
        model, x, y, loss_fn = build(name)
        pipe = Pipeline(
            model, balance_of(len(model), p * v), schedule=sched, n_microbatches=M, loss_fn=loss_fn,
            n_virtual=v, recompute=mode, timeout=30.0,
        )  # fmt: skip
        if mode == "never":  # forward-only evaluation first: it must leave no trace for the step
            ev = pipe.evaluate(x, y)
            no_grads = all(t.grad is None for t in pipe.parameters())
            modes_kept = all(mod.training for mod in pipe.module.modules())
            out[f"eval/{name}/{sched}"] = (ev, no_grads, modes_kept)
        loss = pipe.step(x, y)
        out[f"{name}/{sched}/{mode}"] = (loss, grads_of(pipe.named_parameters()), pipe.peak_activations())
    # a Plan with its defaults: the pipeline runs the plan's schedule, m (= p) and v
    for sched in SCHEDULES:
        model, x, y, loss_fn = build("mlp")
        v = default_n_virtual(sched)
        plan = Plan(balance=balance_of(len(model), p * v), schedule=sched)
        pipe = Pipeline(model, plan, loss_fn=loss_fn, timeout=30.0)
        loss = pipe.step(x, y)
        ran = (
            pipe.plan is plan,
            pipe.schedule == plan.build_schedule(),
            pipe.n_microbatches,
            sorted(pipe.stages),
        )
        out[f"plan/{sched}"] = (loss, grads_of(pipe.named_parameters()), pipe.peak_activations(), ran)
    # several optimizer steps; on the MLP: the GPT's key bias has an analytically zero gradient
    # (softmax ignores a constant shift of the keys), whose fp32 round-off Adam would normalise
    # into a full-size step in a random direction, in one process as much as in the pipeline
    for sched in ("1f1b", "zb-h1"):
        model, x, y, loss_fn = build("mlp")
        pipe = Pipeline(model, balance_of(len(model), p), schedule=sched, n_microbatches=M, loss_fn=loss_fn)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            pipe.step(x, y)
            opt.step()
        out[f"adamw/{sched}"] = {k: t.detach().clone() for k, t in pipe.named_parameters()}
    # one recorded 1F1B step (after a warm-up step)
    model, x, y, loss_fn = build("mlp")
    pipe = Pipeline(model, balance_of(len(model), p), schedule="1f1b", n_microbatches=M, loss_fn=loss_fn)
    pipe.step(x, y)
    pipe.step(x, y, record=True)
    out["timeline"] = pipe.gather_timeline()
    out["busy"] = pipe.busy_time
    return out


def _torchgpipe(name: str, n_stages: int) -> dict[str, torch.Tensor]:
    from torchgpipe import GPipe

    model, x, y, loss_fn = build(name)
    gp = GPipe(model, balance_of(len(model), n_stages), devices=["cpu"] * n_stages, chunks=M)
    loss_fn(gp(x), y).backward()
    return grads_of(model.named_parameters())


def _adamw_reference() -> dict[str, torch.Tensor]:
    model, x, y, loss_fn = build("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return {k: t.detach().clone() for k, t in model.named_parameters()}


_JOBS = {p: job(p, _matrix, timeout=120.0, batch="c") for p in (2, 4)}


@pytest.fixture(scope="module", params=[2, 4])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[Any]]:
    p: int = request.param
    return p, _JOBS[p].results(tmp_path_factory)


def _check_equal(results: list[Any], key: str, loss_ref: float, grads_ref: dict[str, torch.Tensor]) -> None:
    losses = [r[key][0] for r in results]
    assert all(abs(v - loss_ref) <= 1e-6 * abs(loss_ref) for v in losses), (key, losses, loss_ref)
    merged = {k: g for r in results for k, g in r[key][1].items()}  # every parameter exactly once
    assert sum(len(r[key][1]) for r in results) == len(grads_ref)
    assert_close(merged, grads_ref, key)


@pytest.mark.parametrize("name", MODELS)
def test_every_schedule_matches_one_process_and_torchgpipe(world: tuple[int, list[Any]], name: str) -> None:
    p, results = world
    loss_ref, grads_ref = reference(name)
    grads_gpipe = _torchgpipe(name, p)
    assert_close(grads_gpipe, grads_ref, "torchgpipe vs one process")  # the two references agree
    for (sched, _), mode in itertools.product(CONFIGS, RECOMPUTES):
        key = f"{name}/{sched}/{mode}"
        _check_equal(results, key, loss_ref, grads_ref)
        assert_close(
            {k: g for r in results for k, g in r[key][1].items()}, grads_gpipe, key + " vs torchgpipe"
        )


def test_a_plan_runs_its_schedule_m_and_v(world: tuple[int, list[Any]]) -> None:
    p, results = world
    loss_ref, grads_ref = reference("mlp")
    for sched in SCHEDULES:
        key = f"plan/{sched}"
        _check_equal(results, key, loss_ref, grads_ref)
        v = default_n_virtual(sched)
        placed = schedule(sched, p, p, n_virtual=v)  # stage s on rank_of(s): s % p, or zb-v's V
        for rank, r in enumerate(results):
            assert r[key][3] == (True, True, p, placed.stages_of(rank)), (key, rank)
        if sched == "gpipe":  # all m = p forwards before any backward: m held at once
            assert [r[key][2] for r in results] == [{j: p} for j in range(p)]


@pytest.mark.parametrize("name", MODELS)
def test_evaluate_is_the_forward_loss_and_leaves_no_trace(world: tuple[int, list[Any]], name: str) -> None:
    p, results = world
    model, x, y, loss_fn = build(name)
    with torch.no_grad():
        losses = [loss_fn(model(a), b) for a, b in zip(x.chunk(M), y.chunk(M), strict=True)]
        ref = float(torch.stack(losses).mean())
    for sched, _ in CONFIGS:
        for rank in range(p):
            ev, no_grads, modes_kept = results[rank][f"eval/{name}/{sched}"]
            assert abs(ev - ref) <= 1e-6 * abs(ref), f"{sched} rank {rank}: {ev} != {ref}"
            assert no_grads and modes_kept, f"{sched} rank {rank}"


def test_memory_bounds(world: tuple[int, list[Any]]) -> None:
    p, results = world
    for name, mode in itertools.product(MODELS, RECOMPUTES):
        for j, r in enumerate(results):
            assert r[f"{name}/gpipe/{mode}"][2] == {j: M}
            assert r[f"{name}/1f1b/{mode}"][2] == {j: min(M, p - j)}  # never more than p - j
            assert r[f"{name}/zb-h1/{mode}"][2][j] <= p


def test_adamw_steps_match_one_process(world: tuple[int, list[Any]]) -> None:
    _, results = world
    for sched in ("1f1b", "zb-h1"):
        merged = {k: t for r in results for k, t in r[f"adamw/{sched}"].items()}
        assert_close(merged, _adamw_reference(), f"adamw {sched}")


def test_measured_trace_has_the_simulated_shape(world: tuple[int, list[Any]], tmp_path: Path) -> None:
    from pipeline.schedules.trace import write_chrome_trace

    p, results = world
    measured: Timeline = results[0]["timeline"]
    assert all(r["timeline"] is None for r in results[1:])  # gathered on rank 0 only
    simulated = simulate(schedule("1f1b", p, M), forward=1.0, backward=2.0)
    for r in range(p):
        order = [e.action for e in measured.of_rank(r) if e.action.kind.is_compute]
        assert order == [e.action for e in simulated.of_rank(r) if e.action.kind.is_compute]
        # the executor ran the program, in its order: its posted sends, its waits, its computes
        program = schedule("1f1b", p, M).program(r)
        expected = [a for x in program for a in (x.sends if isinstance(x, Post) else
                    (x.recv,) if isinstance(x, Wait) else (x,) if isinstance(x, Action) else ())]  # fmt: skip
        assert [e.action for e in measured.of_rank(r)] == expected
        waits = [e for e in measured.of_rank(r) if e.action.kind.is_recv]
        assert len(waits) == (M if r in (0, p - 1) else 2 * M)  # every receive waited for, once
        computes = [e for e in measured.of_rank(r) if e.action.kind.is_compute]
        for w in waits:  # waiting for an input is idle time, never part of a compute action
            assert all(c.start >= w.end or c.end <= w.start for c in computes), w
    assert measured.peak_activations == simulated.peak_activations
    for r, res in enumerate(results):
        busy = sum(e.duration for e in measured.of_rank(r) if e.action.kind.is_compute)
        assert abs(res["busy"] - busy) < 1e-3
    path = tmp_path / "1f1b.trace.json"
    write_chrome_trace(path, simulated, measured, names=["simulated", "measured"])
    events = json.loads(path.read_text())["traceEvents"]
    threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "X"}
    assert threads == {(pid, r) for pid in (0, 1) for r in range(p)}


# ---- one process (world size 1): every schedule of a one-rank plan, interleaved stages on one rank


@pytest.mark.parametrize("sched", SCHEDULES)
def test_a_one_rank_plan_matches_one_process(sched: str) -> None:
    loss_ref, grads_ref = reference("gpt")
    model, x, y, loss_fn = build("gpt")
    v = default_n_virtual(sched)
    plan = Plan(balance=balance_of(len(model), v), schedule=sched, n_microbatches=M, recompute="always")
    pipe = Pipeline(model, plan, loss_fn=loss_fn)
    assert (pipe.schedule, pipe.recompute, sorted(pipe.stages)) == (
        plan.build_schedule(),
        "always",
        list(range(v)),
    )
    assert pipe.step(x, y) == pytest.approx(loss_ref, rel=1e-6)
    assert_close(grads_of(pipe.named_parameters()), grads_ref, sched)


@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_on_one_rank(v: int) -> None:
    _, grads_ref = reference("gpt")
    model, x, y, loss_fn = build("gpt")
    pipe = Pipeline(model, balance_of(len(model), v), schedule="interleaved-1f1b", n_virtual=v,
                    n_microbatches=M, loss_fn=loss_fn)  # fmt: skip
    assert isinstance(pipe.module, nn.ModuleList) and len(pipe.module) == v
    pipe.step(x, y)
    assert_close(grads_of(pipe.named_parameters()), grads_ref, f"v={v}")


def test_meta_model_materialises_local_stages() -> None:
    with torch.device("meta"):
        model, _ = mlp(width=8, depth=4, batch_size=BATCH)
    seen: list[nn.Module] = []
    pipe = Pipeline(model, [4], schedule="gpipe", n_microbatches=2, loss_fn=nn.functional.mse_loss,
                    init_fn=seen.append)  # fmt: skip
    assert len(seen) == 1
    assert all(not t.is_meta and t.abs().sum() > 0 for name, t in pipe.named_parameters() if "weight" in name)
    assert [k for k, _ in pipe.named_parameters()][:2] == ["0.0.weight", "0.0.bias"]
    assert pipe.step(torch.randn(4, 8), torch.randn(4, 8)) > 0


def test_evaluate_runs_layers_in_eval_mode_and_restores_modes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with torch.no_grad():
        ref = float(nn.functional.mse_loss(model.eval()(x), y))  # one chunk: the mean is the batch's
    model.train()
    pipe = Pipeline(model, [3], schedule="gpipe", n_microbatches=1, loss_fn=nn.functional.mse_loss)
    assert pipe.evaluate(x, y) == pytest.approx(ref, rel=1e-6)
    assert all(mod.training for mod in pipe.module.modules())
    assert all(t.grad is None for t in pipe.parameters())
