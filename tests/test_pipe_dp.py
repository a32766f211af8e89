"""Pipeline replicas (dp = 2 x 2 pipeline ranks, 4 gloo processes) against one process on the global batch.

Each job (of the shared launch, tests/dist.py) runs every configuration in turn and returns losses and
gradients: every schedule, with and without recomputation, uneven local batches, several AdamW and
ZeRO-1 steps, clipping, evaluation, the overlap seen in recorded timelines, and the NCCL emulation.

    global rank g = d * 2 + r: replica d = g // 2 holds rows [d * B, (d + 1) * B) of the global batch
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from pipeline.plan import Plan
from pipeline.reference.models import gpt, gpt_loss, mlp
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.actions import Kind
from pipeline.schedules.registry import REGISTRY
from tests.dist import job
from tests.pipe_common import assert_close, balance_of

M, LOCAL, P, DP = 4, 8, 2, 2  # micro-batches, rows per replica, ranks per pipeline, replicas
GLOBAL = LOCAL * DP
# (schedule, v)
CONFIGS = [(name, e.default_virtual) for name, e in REGISTRY.items()]  # every registered schedule
UNEVEN = (11, 5)  # replica 0's and 1's rows when the local batches differ


def _build(name: str) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, Any]:
    """(model, global inputs, global targets, loss_fn), the same on every call."""
    torch.manual_seed(0)
    if name == "mlp":
        model, x = mlp(width=8, depth=8, batch_size=GLOBAL)
        return model, x, torch.randn(GLOBAL, 8), nn.functional.mse_loss
    model, x = gpt(vocab_size=16, width=16, n_layers=6, n_heads=2, max_seq_len=8, batch_size=GLOBAL)
    return model, x, torch.randint(0, 16, (GLOBAL, 8)), gpt_loss


class _Sometimes(nn.Module):
    """Its weight takes part only in a micro-batch whose first row starts positive: on replica 1's
    rows never, so that replica has no gradient for it (the reduction must count zeros there)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x) if bool(x[0, 0] > 0) else x * 1.0


class _Transposed(nn.Module):
    """A weight stored transposed: autograd gives it a gradient of the same (non-contiguous) strides."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)


def _uneven_use() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """A model with a data-dependent layer and a transposed weight; replica 0's micro-batches 0 and 2
    use the layer, no micro-batch of replica 1 does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Transposed(), _Sometimes(), nn.Linear(8, 8))
    x, y = torch.randn(GLOBAL, 8), torch.randn(GLOBAL, 8)
    model[0].weight.data.zero_()
    model[0].bias.data.fill_(0.0)
    model[0].weight.data.copy_(torch.eye(8))  # layer 0 passes x on, so the sign reaching _Sometimes is x's
    model[1].weight.data = torch.eye(8).t() * 3.0
    x[:, 0] = -2.0
    x[[0, 4], 0] = 2.0  # the first rows of replica 0's micro-batches 0 and 2 (2 rows each)
    return model, x, y


def _rows(rows: tuple[int, int] = (LOCAL, LOCAL)) -> slice:
    d = dist.get_rank() // P
    start = sum(rows[:d])
    return slice(start, start + rows[d])


def _grads(pipe: Pipeline) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in pipe.named_parameters() if p.grad is not None}


def _plan(model: nn.Sequential, sched: str, v: int, mode: str = "never") -> Plan:
    balance = balance_of(len(model), P * v)
    return Plan(balance=balance, schedule=sched, n_microbatches=M, n_virtual=v, recompute=mode, dp=DP)


def _matrix() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (sched, v), mode in itertools.product(("mlp", "gpt"), CONFIGS, ("never", "always")):
        if name == "gpt" and mode == "always":
            continue
        model, x, y, loss_fn = _build(name)
        pipe = Pipeline(model, _plan(model, sched, v, mode), loss_fn=loss_fn, timeout=30.0)
        loss = pipe.step(x[_rows()], y[_rows()])
        out[f"{name}/{sched}/{mode}"] = (loss, _grads(pipe))
    # uneven local batches: each replica weighs by its rows, as one process on all 16 does
    model, x, y, loss_fn = _build("mlp")
    pipe = Pipeline(model, _plan(model, "1f1b", 1), loss_fn=loss_fn, timeout=30.0)
    out["uneven"] = (pipe.step(x[_rows(UNEVEN)], y[_rows(UNEVEN)]), _grads(pipe))
    out["layout"] = (
        pipe.replica,
        pipe.rank,
        dist.get_process_group_ranks(pipe.dp_group),
        dist.get_process_group_ranks(pipe.pp_group),
        pipe.mesh.mesh.tolist() if pipe.mesh is not None else None,
    )
    out["eval"] = pipe.evaluate(x[_rows(UNEVEN)], y[_rows(UNEVEN)])
    cpu = torch.device("cpu")
    groups = (pipe.dp_group, pipe.pp_group)
    out["group_timeouts"] = [g._get_backend(cpu).options._timeout.total_seconds() for g in groups]
    # replicas seeded differently: replica 0's initial values reach replica 1 at construction
    torch.manual_seed(dist.get_rank() // P)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    before = {k: t.detach().clone() for k, t in model.named_parameters()}
    pipe = Pipeline(model, _plan(model, "1f1b", 1), loss_fn=nn.functional.mse_loss, timeout=30.0)
    out["seeded"] = (before, {k: t.detach().clone() for k, t in pipe.named_parameters()})
    # clip_grad_norm_ and grads_finite over the whole pp x dp world, each parameter once
    model, x, y, loss_fn = _build("mlp")
    pipe = Pipeline(model, _plan(model, "interleaved-1f1b", 2), loss_fn=loss_fn, timeout=30.0)
    pipe.step(x[_rows()], y[_rows()])
    norm = pipe.clip_grad_norm_(0.05)
    out["clip"] = (norm, pipe.grads_finite(), _grads(pipe))
    pipe.step(x[_rows()], y[_rows()])  # no zero_grad: the clipped gradients accumulate, counted once
    out["accumulated"] = _grads(pipe)
    # several optimizer steps: AdamW, and ZeRO-1 over the replicas
    for zero in (False, True):
        model, x, y, loss_fn = _build("mlp")
        pipe = Pipeline(model, _plan(model, "1f1b", 1), loss_fn=loss_fn, timeout=30.0)
        kw: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
        opt = (
            ZeroRedundancyOptimizer(pipe.parameters(), torch.optim.AdamW, process_group=pipe.dp_group, **kw)
            if zero
            else torch.optim.AdamW(pipe.parameters(), **kw)
        )
        for _ in range(3):
            opt.zero_grad()
            pipe.step(x[_rows()], y[_rows()])
            opt.step()
        out[f"adamw/{zero}"] = {k: t.detach().clone() for k, t in pipe.named_parameters()}
    # a parameter with a gradient on one replica only; a strided gradient in a bucket of its own
    for bucket_mb in (25.0, 1e-4):
        model, x, y = _uneven_use()
        plan = Plan(balance=[2, 2], schedule="1f1b", n_microbatches=M, dp=DP)
        pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, timeout=30.0, bucket_mb=bucket_mb)
        out[f"uneven_use/{bucket_mb}"] = (pipe.step(x[_rows()], y[_rows()]), _grads(pipe))
    # recorded: when each bucket was launched against the rank's compute
    for sched, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        model, x, y, loss_fn = _build("mlp")
        pipe = Pipeline(model, _plan(model, sched, v), loss_fn=loss_fn, timeout=30.0, bucket_mb=1e-4)
        pipe.step(x[_rows()], y[_rows()])
        pipe.step(x[_rows()], y[_rows()], record=True)
        compute = [(e.action, e.start, e.end) for e in pipe.timeline().events if e.action.kind.is_compute]
        out[f"overlap/{sched}"] = (compute, pipe.reductions())
        gathered = pipe.gather_timeline()  # on each replica's pipeline rank 0
        out[f"gathered/{sched}"] = None if gathered is None else sorted({e.rank for e in gathered.events})
    return out


def _reference(name: str, rows: slice = slice(None)) -> tuple[float, dict[str, torch.Tensor]]:
    model, x, y, loss_fn = _build(name)
    loss = loss_fn(model(x[rows]), y[rows])
    loss.backward()
    return float(loss.detach()), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _check(results: list[dict[str, Any]], key: str, name: str) -> None:
    loss_ref, grads_ref = _reference(name)
    for g, res in enumerate(results):
        loss, _ = res[key]
        assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref), (key, g, loss, loss_ref)  # the global mean
    for d in range(DP):  # each replica holds every gradient, each parameter on one of its ranks
        merged: dict[str, torch.Tensor] = {}
        for res in results[d * P : (d + 1) * P]:
            assert not set(merged) & set(res[key][1])
            merged.update(res[key][1])
        assert_close(merged, grads_ref, f"{key} replica {d}")


_MATRIX = job(P * DP, _matrix, timeout=240.0, batch="dp")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _MATRIX.results(tmp_path_factory)


@pytest.mark.parametrize(("sched", "v"), CONFIGS)
@pytest.mark.parametrize("mode", ["never", "always"])
def test_every_schedule_equals_one_process_on_the_global_batch(
    results: list[dict[str, Any]], sched: str, v: int, mode: str
) -> None:
    _check(results, f"mlp/{sched}/{mode}", "mlp")
    if mode == "never":
        _check(results, f"gpt/{sched}/{mode}", "gpt")


def test_uneven_local_batches_are_weighted_by_rows(results: list[dict[str, Any]]) -> None:
    _check(results, "uneven", "mlp")  # replicas of 11 and 5 rows: the mean over all 16
    model, x, y, loss_fn = _build("mlp")
    with torch.no_grad():
        want = float(loss_fn(model.eval()(x), y))
    assert all(abs(r["eval"] - want) <= 1e-5 * want for r in results)


def test_the_mesh_s_groups_are_bounded_by_the_pipeline_s_timeout(results: list[dict[str, Any]]) -> None:
    """Not torch's 30 minutes: a collective stuck on a stopped peer must end, or a rank that failed
    hangs at exit joining the group's threads (seen under torchrun with a SIGSTOPped replica)."""
    assert all(res["group_timeouts"] == [30.0, 30.0] for res in results)


def _uneven_reference() -> tuple[float, dict[str, torch.Tensor]]:
    """One process over the same micro-batches (the layer's use is decided per micro-batch)."""
    model, x, y = _uneven_use()
    assert model[1].weight.grad is None and not model[1].weight.is_contiguous()
    rows = [slice(d * LOCAL, (d + 1) * LOCAL) for d in range(DP)]
    chunks = [c for r in rows for c in zip(x[r].chunk(M), y[r].chunk(M), strict=True)]
    total = 0.0
    for a, b in chunks:
        loss = nn.functional.mse_loss(model(a), b) / len(chunks)
        loss.backward()  # type: ignore[no-untyped-call]
        total += float(loss)
    want = {k: t.grad for k, t in model.named_parameters() if t.grad is not None}
    assert "2.lin.weight" in want and not model[1].weight.grad.is_contiguous()  # type: ignore[union-attr]
    return total, want


def _check_uneven(results: list[dict[str, Any]], key: str) -> None:
    total, want = _uneven_reference()
    for g, res in enumerate(results):
        loss, _ = res[key]
        assert abs(loss - total) <= 1e-5 * abs(total), (g, loss, total)
    for d in range(DP):
        merged = {k: t for res in results[d * P : (d + 1) * P] for k, t in res[key][1].items()}
        assert_close(merged, want, f"{key}, replica {d}")


@pytest.mark.parametrize("bucket_mb", [25.0, 1e-4], ids=["shared-bucket", "bucket-per-parameter"])
def test_a_gradient_on_one_replica_only_and_a_strided_one_equal_one_process(
    results: list[dict[str, Any]], bucket_mb: float
) -> None:
    _check_uneven(results, f"uneven_use/{bucket_mb}")


def test_replicas_start_from_replica_0_s_parameters(results: list[dict[str, Any]]) -> None:
    for g, res in enumerate(results):
        before, after = res["seeded"]
        mine = results[g % P]["seeded"][0]  # replica 0's rank of the same pipeline rank
        assert set(after) and all(torch.equal(after[k], mine[k]) for k in after)
        if g >= P:  # replica 1 was seeded otherwise: its values were replaced
            assert all(not torch.equal(before[k], after[k]) for k in after)


def test_the_mesh_puts_a_pipeline_s_ranks_next_to_each_other(results: list[dict[str, Any]]) -> None:
    for g, res in enumerate(results):
        d, r = divmod(g, P)
        assert res["layout"] == (d, r, [r, P + r], [d * P, d * P + 1], [[0, 1], [2, 3]])


def test_clipping_and_finiteness_cover_the_whole_world_once(results: list[dict[str, Any]]) -> None:
    model, x, y, loss_fn = _build("mlp")
    loss_fn(model(x), y).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    grads_ref = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    for res in results:
        norm, finite, _ = res["clip"]
        assert abs(norm - want) <= 1e-5 * want and finite is True
    for d in range(DP):
        merged = {k: t for res in results[d * P : (d + 1) * P] for k, t in res["clip"][2].items()}
        assert_close(merged, grads_ref, f"clipped, replica {d}")


def test_gradients_accumulate_across_steps_without_zero_grad(results: list[dict[str, Any]]) -> None:
    model, x, y, loss_fn = _build("mlp")
    loss_fn(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    loss_fn(model(x), y).backward()
    grads_ref = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    for d in range(DP):
        merged = {k: t for res in results[d * P : (d + 1) * P] for k, t in res["accumulated"].items()}
        assert_close(merged, grads_ref, f"accumulated, replica {d}")


@pytest.mark.parametrize("zero", [False, True], ids=["adamw", "zero-1"])
def test_optimizer_steps_equal_one_process(results: list[dict[str, Any]], zero: bool) -> None:
    model, x, y, loss_fn = _build("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    want = {k: t.detach() for k, t in model.named_parameters()}
    for d in range(DP):
        merged = {k: t for res in results[d * P : (d + 1) * P] for k, t in res[f"adamw/{zero}"].items()}
        assert_close(merged, want, f"3 steps, zero={zero}, replica {d}")


@pytest.mark.parametrize("sched", ["1f1b", "interleaved-1f1b"])
def test_a_stage_s_all_reduce_starts_before_the_rank_s_compute_ends(
    results: list[dict[str, Any]], sched: str
) -> None:
    for g, res in enumerate(results):
        compute, reductions = res[f"overlap/{sched}"]
        last_end = max(end for _, _, end in compute)
        assert reductions and all(e.rank == g for e in reductions)
        first = min(reductions, key=lambda e: e.launched)
        # launched during the rank's own compute: before its last compute action ends
        assert first.launched < last_end, (g, sched, first, last_end)
        if sched == "interleaved-1f1b":  # stage r + 2 is done first: all of it overlaps stage r's drain
            later = [e for e in reductions if e.stage == g % P + P]
            last_b = max(end for a, _, end in compute if a.stage == g % P and a.kind is Kind.B)
            assert later and all(e.launched < last_b for e in later), (g, later, last_b)


@pytest.mark.parametrize("sched", ["1f1b", "interleaved-1f1b"])
def test_each_replica_gathers_its_pipelines_timeline_on_its_first_rank(
    results: list[dict[str, Any]], sched: str
) -> None:
    for g, res in enumerate(results):
        assert res[f"gathered/{sched}"] == (list(range(P)) if g % P == 0 else None), (g, sched)


def _emulated() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sched, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)):
        model, x, y, loss_fn = _build("mlp")
        pipe = Pipeline(model, _plan(model, sched, v), loss_fn=loss_fn, timeout=30.0, bucket_mb=1e-4)
        out[f"mlp/{sched}/never"] = (pipe.step(x[_rows()], y[_rows()]), _grads(pipe))
        norm = pipe.clip_grad_norm_(0.05)
        out[f"clip/{sched}"] = (norm, pipe.grads_finite(), _grads(pipe))
    # a strided gradient alone in its bucket: NCCL takes only contiguous tensors
    model, x, y = _uneven_use()
    plan = Plan(balance=[2, 2], schedule="1f1b", n_microbatches=M, dp=DP)
    pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, timeout=30.0, bucket_mb=1e-4)
    out["uneven_use"] = (pipe.step(x[_rows()], y[_rows()]), _grads(pipe))
    return out


_EMULATED = job(P * DP, _emulated, timeout=240.0, backend="nccl-emulated", batch="dp")


def test_the_nccl_code_path_under_the_emulation_equals_one_process(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # per-pair channels for both replicas' pipelines, polled collectives on the "dp" group
    results = _EMULATED.results(tmp_path_factory)
    for sched in ("1f1b", "interleaved-1f1b", "zb-h1"):
        _check(results, f"mlp/{sched}/never", "mlp")
    _check_uneven(results, "uneven_use")
    model, x, y, loss_fn = _build("mlp")
    loss_fn(model(x), y).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    assert all(abs(r[f"clip/{s}"][0] - want) <= 1e-5 * want for r in results for s in ("1f1b", "zb-h1"))
