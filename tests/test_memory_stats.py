"""Measured memory (``pipe.memory_stats``) against the predicted per-rank peak, and the accounting itself.

    # p: ranks, v: stages per rank, m: micro-batches, s: stage, r: rank

One launch of 2 ranks runs the reference GPT, MLP and ResNet under every schedule (gpipe, 1f1b,
interleaved-1f1b with v = 2, zb-h1) and recomputation mode (never, except_last, always); each
rank reports its measured activation bytes and peak, and each must be within 10 % of what
``partitioner.memory.rank_peaks`` predicts from the profile (the same model the plan's
per-rank peak comes from). One more case steps an Adam optimizer and counts its state. The
ResNet's last stage starts at its ``Flatten``, a view of the received buffer that the
classifier saves: one storage, counted once (``output_aliases_input``, ``input_grad_aliases``).

The unit tests pin the accounting: each storage once (a tensor saved twice, views of one
storage), released when autograd frees the graph, parameters not counted.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import Profile, profile
from partitioner.memory import rank_peaks, saved_io, stage_bytes
from pipeline.plan import Plan
from pipeline.reference.models import gpt, gpt_loss, mlp, resnet
from pipeline.runtime.memory import ActivationMeter, storage_bytes
from pipeline.runtime.pipe import Pipeline
from tests.dist import run_ranks

P, M = 2, 4
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]
MODES = ["never", "except_last", "always"]
CASES = [(sched, v, mode) for sched, v in SCHEDULES for mode in MODES]
ADAM = ("1f1b", 1, "never")
MODELS = ("mlp", "gpt", "resnet")
# the ResNet's stages (stem, block, block, pool, flatten, linear): the last starts at the Flatten
RESNET_BALANCE = {1: [4, 2], 2: [1, 2, 1, 2]}


def _model(name: str) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, Any]:
    """The model, one step's inputs and targets (M micro-batches), and its loss."""
    torch.manual_seed(0)
    if name == "mlp":
        model, x = mlp(width=32, depth=8, batch_size=8 * M)
        return model, x, torch.randn(8 * M, 32), nn.functional.mse_loss
    if name == "resnet":
        model, x = resnet(widths=(4, 8), blocks_per_width=1, image_size=8, batch_size=2 * M)
        return model, x, torch.randint(0, 10, (2 * M,)), nn.functional.cross_entropy
    model, x = gpt(vocab_size=32, width=32, n_layers=5, n_heads=2, max_seq_len=16, batch_size=2 * M)
    return model, x, torch.randint(0, 32, x.shape), gpt_loss


def _plan(name: str, model: nn.Sequential, sched: str, v: int, mode: str) -> Plan:
    n, k = len(model), P * v
    balance = [n // k + (1 if s < n % k else 0) for s in range(k)]
    if name == "resnet":
        balance = RESNET_BALANCE[v]
    return Plan(balance=balance, schedule=sched, n_microbatches=M, n_virtual=v, recompute=mode)


def _measure(name: str) -> dict[tuple[str, str], tuple[int, int]]:
    """On each rank: (activations, peak) of one step per case; the Adam case with its state."""
    model, x, y, loss_fn = _model(name)
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for sched, v, mode in CASES:
        pipe = Pipeline(model, _plan(name, model, sched, v, mode), loss_fn=loss_fn)
        pipe.step(x, y)
        stats = pipe.memory_stats()
        assert stats["optimizer"] is None and stats["gradients"] == stats["parameters"]
        out[(sched, mode)] = (stats["activations"], stats["peak"])
        if (sched, v, mode) == ADAM:
            opt = torch.optim.Adam(pipe.parameters())
            opt.step()
            opt.zero_grad()
            pipe.step(x, y)
            stats = pipe.memory_stats(optimizer=opt)
            out[("adam", mode)] = (stats["activations"], stats["peak"])
        pipe.close()
    return out


def _measure_all() -> dict[str, dict[tuple[str, str], tuple[int, int]]]:
    return {name: _measure(name) for name in MODELS}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("mem"), _measure_all, P, timeout=240.0)


@functools.cache
def _profile(name: str) -> tuple[Profile, list[tuple[int, int]]]:
    """The profile of one micro-batch (bytes only matter: one untimed repeat) and what layers save."""
    model, x, y, loss_fn = _model(name)
    xm, ym = x[: len(x) // M], y[: len(y) // M]
    prof = profile(model, xm, loss_fn=loss_fn, target=ym, warmup=0, repeat=1)
    return prof, saved_io(model, xm, loss_fn, ym)


def _predicted(name: str, sched: str, v: int, mode: str, factor: float) -> tuple[list[float], list[float]]:
    """Per rank: (activation bytes, peak bytes) the model predicts."""
    model = _model(name)[0]
    prof, io = _profile(name)
    plan = _plan(name, model, sched, v, mode)
    figures = stage_bytes(prof, plan.balance, factor, io)
    peaks = rank_peaks(plan.build_schedule(), figures, plan.recompute)
    static = [sum(f.static for f in figures[r::P]) for r in range(P)]
    return [peak - s for peak, s in zip(peaks, static, strict=True)], peaks


def _close(measured: float, predicted: float) -> bool:
    return abs(measured - predicted) <= 0.10 * measured


@pytest.mark.parametrize("name", MODELS)
def test_measured_peak_matches_the_prediction(measured: list[dict[str, Any]], name: str) -> None:
    wrong = []
    for sched, v, mode in [*CASES, ("adam", 1, ADAM[2])]:
        factor = 2.0 if sched == "adam" else 0.0  # Adam: two state tensors per parameter
        acts, peaks = _predicted(name, ADAM[0] if sched == "adam" else sched, v, mode, factor)
        for r in range(P):
            got_acts, got_peak = measured[r][name][(sched, mode)]
            assert got_acts > 0
            if not (_close(got_acts, acts[r]) and _close(got_peak, peaks[r])):
                wrong.append(f"{sched}/{mode} rank {r}: activations {got_acts} vs {acts[r]:.0f}, "
                             f"peak {got_peak} vs {peaks[r]:.0f}")  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_activations_are_a_large_share_of_the_peak(measured: list[dict[str, Any]]) -> None:
    # the peak comparison would prove little if parameters dominated it
    for r in range(P):
        for name in MODELS:
            acts, peak = measured[r][name][("gpipe", "never")]
            assert acts > 0.2 * peak


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
