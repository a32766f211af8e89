"""Measured memory (``pipe.memory_stats``) against the predicted per-rank peak, and the accounting itself.

    # p: ranks, v: stages per rank, m: micro-batches, s: stage, r: rank

Launches of 2 and 4 ranks run the reference GPT, MLP and ResNet, and an MLP whose one wide layer's
activations dominate, under every schedule (gpipe, 1f1b, interleaved-1f1b with v = 2, zb-h1) and
recomputation mode (never, except_last, always). Each rank measures its step's true peak
(``step(..., measure_memory=True)``: every tensor storage from allocation to free, transients
included, plus the parameters, buffers and gradients) and ``partitioner.memory.rank_peaks``'s
prediction from the profile (the plan's per-rank peak) must be at least it and at most 10 % above. One more
case steps an Adam optimizer and counts its state. The ResNet's last stage starts at its
``Flatten``, a view of the received buffer that the classifier saves: one storage, counted once.

The unit tests pin the accounting of the saved-tensor count (``counted_peak``, a subset of the
true peak): each storage once (a tensor saved twice, views of one storage), released when
autograd frees the graph, parameters not counted.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import Profile, profile
from partitioner.memory import rank_peaks, saved_io, stage_bytes
from pipeline.plan import Plan
from pipeline.reference.models import mlp
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.step.memory import ActivationMeter, storage_bytes
from pipeline.schedules.registry import REGISTRY
from tests.dist import job, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_memory  # the matrix: models, their plans, the cases
from bench_memory import CASES, MODELS, M

ADAM = ("1f1b", 1, "never")


def _model(name: str, p: int = 2) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, Any]:
    """The model, one step's inputs and targets (M micro-batches), and its loss: the benchmark's."""
    return bench_memory.build(name, p)


def _plan(name: str, model: nn.Sequential, p: int, sched: str, v: int, mode: str) -> Plan:
    return bench_memory.plan_of(name, len(model), p, sched, v, mode)


def _measure(name: str, p: int) -> dict[tuple[str, str], tuple[int, int, int]]:
    """On each rank, per case: (true peak, saved-tensor count, activations) of a measured step (the
    second: a training run's steady state); at p = 2 the Adam case too, with its state."""
    model, x, y, loss_fn = _model(name, p)
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for sched, v, mode in CASES:
        pipe = Pipeline(model, _plan(name, model, p, sched, v, mode), loss_fn=loss_fn)
        pipe.step(x, y)  # the first step makes the gradients: its peak comes before they exist
        pipe.step(x, y, measure_memory=True)
        stats = pipe.memory_stats()
        assert stats["optimizer"] is None and stats["gradients"] == stats["parameters"]
        out[(sched, mode)] = (stats["peak"], stats["counted_peak"], stats["activations"])
        if (sched, v, mode) == ADAM and p == 2:
            opt = torch.optim.Adam(pipe.parameters())
            opt.step()
            opt.zero_grad()
            pipe.step(x, y, measure_memory=True)
            stats = pipe.memory_stats(optimizer=opt)
            out[("adam", mode)] = (stats["peak"], stats["counted_peak"], stats["activations"])
        pipe.close()
    return out


def _measure_all(p: int) -> dict[str, dict[tuple[str, str], tuple[int, int, int]]]:
    return {name: _measure(name, p) for name in MODELS}


@pytest.fixture(scope="module", params=[2, 4], ids=["p2", "p4"])
def measured(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[Any]]:
    p = request.param
    return p, run_ranks(tmp_path_factory.mktemp("mem"), _measure_all, p, p, timeout=240.0)


@functools.cache
def _profile(name: str, p: int) -> tuple[Profile, list[tuple[int, int]]]:
    """The profile of one micro-batch (bytes only matter: one untimed repeat) and what layers save."""
    model, x, y, loss_fn = _model(name, p)
    xm, ym = x[: len(x) // M], y[: len(y) // M]
    prof = profile(model, xm, loss_fn=loss_fn, target=ym, warmup=0, repeat=1)
    return prof, saved_io(model, xm, loss_fn, ym)


def _predicted(name: str, p: int, sched: str, v: int, mode: str, factor: float) -> list[float]:
    """Per rank: the peak bytes the model predicts."""
    model = _model(name, p)[0]
    prof, io = _profile(name, p)
    plan = _plan(name, model, p, sched, v, mode)
    figures = stage_bytes(prof, plan.balance, factor, io)
    return rank_peaks(plan.build_schedule(), figures, plan.recompute)


def _close(measured: float, predicted: float) -> bool:
    """An upper bound (to the byte: a plan at its limit must fit) at most 10 % above."""
    return measured <= predicted <= (1.0 + bench_memory.ERROR) * measured


@pytest.mark.parametrize("name", MODELS)
def test_the_true_peak_matches_the_prediction(measured: tuple[int, list[Any]], name: str) -> None:
    p, results = measured
    wrong = []
    extra = [("adam", 1, ADAM[2])] if p == 2 else []
    for sched, v, mode in [*CASES, *extra]:
        factor = 2.0 if sched == "adam" else 0.0  # Adam: two state tensors per parameter
        peaks = _predicted(name, p, ADAM[0] if sched == "adam" else sched, v, mode, factor)
        for r in range(p):
            got, counted, _ = results[r][name][(sched, mode)]
            assert 0 < counted <= got  # the saved-tensor count is a part of the true peak
            if not _close(got, peaks[r]):
                wrong.append(f"{sched}/{mode} rank {r}: measured {got}, predicted {peaks[r]:.0f} "
                             f"({peaks[r] / got - 1:+.1%})")  # fmt: skip
    assert not wrong, "\n".join(wrong)


# ---- the walk's terms against the measured peak, where they differ between stages


class _Double(nn.Module):
    """Saves nothing: the output of the layer before it is saved by no layer (a split chain keeps it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


def _funnel() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """Every stage's input and output differ in size (widths 64, 8, 48, 96, 32 at the cuts of 4
    stages; 48 at the cut of 2), and two layers' outputs are saved by none: each walk term (the
    chain, the kept input gradient, the V turn's hand-overs, each stage's buffers) weighs its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), _Double(), nn.Linear(64, 8), nn.Linear(8, 48),
                          _Double(), nn.Linear(48, 96), nn.Linear(96, 32), nn.Linear(32, 16))  # fmt: skip
    return model, torch.randn(64 * M, 16), torch.randn(64 * M, 16)


FUNNEL_CASES = [(s, REGISTRY[s].min_virtual, mode) for s in ("zb-h1", "zb-v", "dualpipe-v", "v-half", "v-min")
                for mode in ("never", "always")]  # fmt: skip


def _funnel_plan(sched: str, v: int, mode: str) -> Plan:
    return Plan(
        balance=[8 // (2 * v)] * (2 * v), schedule=sched, n_microbatches=M, n_virtual=v, recompute=mode
    )


def _funnel_peaks() -> dict[tuple[str, str], int]:
    model, x, y = _funnel()
    out = {}
    for sched, v, mode in FUNNEL_CASES:
        pipe = Pipeline(model, _funnel_plan(sched, v, mode), loss_fn=nn.functional.mse_loss)
        pipe.step(x, y)
        pipe.step(x, y, measure_memory=True)
        out[(sched, mode)] = int(pipe.memory_stats()["peak"])
        pipe.close()
    return out


_FUNNEL = job(2, _funnel_peaks)


def test_the_walk_is_exact_where_every_stage_weighs_its_own(tmp_path_factory: pytest.TempPathFactory) -> None:
    # exact, not within 10 %: a term freed late (a split chain kept past W) or booked to the wrong
    # stage (the V turn's gradient) moves the prediction by a stage's own figure, up or down
    measured = _FUNNEL.results(tmp_path_factory)
    model, x, y = _funnel()
    xm, ym = x[: len(x) // M], y[: len(y) // M]
    loss = nn.functional.mse_loss
    prof = profile(model, xm, loss_fn=loss, target=ym, warmup=0, repeat=1)
    io = saved_io(model, xm, loss, ym)
    wrong = []
    for sched, v, mode in FUNNEL_CASES:
        plan = _funnel_plan(sched, v, mode)
        peaks = rank_peaks(plan.build_schedule(), stage_bytes(prof, plan.balance, 0.0, io), plan.recompute)
        for r, got in enumerate(res[(sched, mode)] for res in measured):
            if abs(peaks[r] - got) > 0.005 * got:
                wrong.append(f"{sched}/{mode} rank {r}: measured {got}, predicted {peaks[r]:.0f} "
                             f"({peaks[r] / got - 1:+.1%})")  # fmt: skip
    assert not wrong, "\n".join(wrong)


def _replicated_peak() -> dict[str, Any]:
    """Two replicas of one stage, AdamW, gradients set to None between steps (``zero_grad``)."""
    model, x, y, loss_fn = _model("wide")
    pipe = Pipeline(model, Plan(balance=[8], schedule="1f1b", n_microbatches=M, dp=2), loss_fn=loss_fn)
    opt = torch.optim.AdamW(pipe.parameters())
    rows = slice(pipe.replica * len(x) // 2, (pipe.replica + 1) * len(x) // 2)
    pipe.step(x[rows], y[rows])
    opt.step()
    opt.zero_grad()
    pipe.step(x[rows], y[rows], measure_memory=True)
    stats = pipe.memory_stats(opt)
    pipe.close()
    return stats


_REPLICATED = job(2, _replicated_peak)


def test_the_replicas_gradient_buckets_count_from_the_step_s_start(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # the gradients live in the reducer's flat buckets, kept from step to step: alive at the step's
    # start though zero_grad set every .grad to None (the peak read 0.78x its static bytes without them)
    for stats in _REPLICATED.results(tmp_path_factory):
        static = stats["parameters"] + stats["gradients"] + stats["optimizer"]
        assert stats["peak"] >= static + stats["activations"] > static, stats


def test_the_measured_peak_is_every_live_byte() -> None:
    """On one rank: the measured peak is the parameters, gradients and the most the step allocated
    at once; an unmeasured step reports the saved-tensor count and says so."""
    model, x, y, loss_fn = _model("wide")
    pipe = Pipeline(model, [8], schedule="gpipe", n_microbatches=M, loss_fn=loss_fn)
    pipe.step(x, y)
    counted = pipe.memory_stats()
    assert counted["peak"] == counted["counted_peak"] and "measure_memory=True" in counted["source"]
    pipe.step(x, y, measure_memory=True)
    stats = pipe.memory_stats()
    assert stats["source"].startswith("every storage allocated")
    # GPipe on one rank holds every micro-batch's graph: the wide layer's output, 4 x 8 rows x 256
    wide = M * 8 * 256 * 4
    assert stats["peak"] > stats["parameters"] + stats["gradients"] + wide
    assert stats["peak"] > stats["counted_peak"]  # the transients the count leaves out
    pipe.step(x, y)
    assert pipe.memory_stats()["source"] == counted["source"]  # measured only when asked
    with pytest.raises(TypeError, match="measure_memory must be True or False, got 1"):
        pipe.step(x, y, measure_memory=1)  # type: ignore[arg-type]


def test_activations_are_a_large_share_of_the_peak(measured: tuple[int, list[Any]]) -> None:
    # the peak comparison would prove little if parameters dominated it
    p, results = measured
    for r in range(p):
        for name in MODELS:
            peak, _, activations = results[r][name][("gpipe", "never")]
            assert activations > 0.2 * peak, (name, r)


# ---- the accounting


def test_a_tensor_saved_twice_counts_once() -> None:
    meter = ActivationMeter()
    x = torch.randn(100, requires_grad=True)
    with meter.saving():
        y = (x * x).sum()  # mul saves both operands: the same tensor twice
        y = y + (x.view(10, 10) * x.view(10, 10)).sum()  # and twice more, as two other tensors
    assert meter.now == meter.peak == x.nbytes
    y.backward()
    assert meter.now == 0 and meter.peak == x.nbytes


def test_views_of_one_storage_count_once() -> None:
    meter = ActivationMeter()
    base = torch.randn(2, 50, requires_grad=True)
    with meter.saving():
        a, b = base * 1.0, base * 2.0  # two storages ...
        y = (a * a[0]).sum() + (b[0] * b[1]).sum()  # ... each saved whole and as a row, or as rows
    assert meter.now == a.nbytes + b.nbytes == 2 * base.nbytes
    del a, b
    assert meter.now == 2 * base.nbytes  # autograd still holds them
    y.backward()
    assert meter.now == 0


def test_freed_after_backward_and_parameters_skipped() -> None:
    meter = ActivationMeter()
    layer = nn.Linear(8, 8)
    meter.begin_step(layer.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    with meter.saving():
        y = torch.relu(layer(x)).sum()  # saves x (the weight is skipped) and relu's output
    assert meter.now == 2 * x.nbytes
    y.backward()
    assert meter.now == 0 and meter.peak == 2 * x.nbytes


def test_held_tokens_and_disabled_meter() -> None:
    meter = ActivationMeter()
    t = torch.randn(10)
    tokens = meter.hold([t, t[2:], None, 3])
    assert meter.now == t.nbytes and len(tokens) == 2
    del tokens
    assert meter.now == 0
    meter.enabled = False
    x = torch.randn(5, requires_grad=True)
    with meter.saving():
        (x * x).sum()
    assert meter.hold([t]) == [] and meter.now == 0


def test_storage_bytes_counts_each_storage_once() -> None:
    t = torch.zeros(10)
    assert storage_bytes([t, t[:3], t.view(2, 5), None]) == 40
    assert storage_bytes([t, torch.zeros(2)]) == 48


def test_memory_stats_before_a_step_and_bad_optimizer(tmp_path: Path) -> None:
    model, x = mlp(width=8, depth=2, batch_size=4)
    pipe = Pipeline(model, [2], schedule="gpipe", n_microbatches=2, loss_fn=nn.functional.mse_loss)
    stats = pipe.memory_stats()
    assert stats["peak"] is None and stats["activations"] is None  # no step yet
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        pipe.memory_stats(optimizer=[1])  # type: ignore[arg-type]
    pipe.executor.meter.enabled = False
    pipe.step(x, torch.randn(4, 8))
    assert pipe.memory_stats()["activations"] is None  # off: nothing measured, nothing claimed
