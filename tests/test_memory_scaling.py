"""The plan's memory at other micro-batch sizes (``partitioner.scaling``) against the measured true peak.

    # m: micro-batches, r: rank

An activation-heavy MLP (its batch of 256 rows, three Linear + GELU of width 128) is profiled as
``partition(schedule="auto")`` profiles it: at its whole batch and again at the smallest micro-batch
the search tries (``second_rows``: 1 row). Scaled to m = 2..64 (1F1B, recompute never and always),
each rank's predicted peak (``plan_for(...).rank_peaks``) must be an upper bound of the measured true
peak of a step (``step(..., measure_memory=True)``, AdamW's state alive: ``memory_stats(optimizer=)``)
and at most 10 % above it. So must the smallest memory limit the auto search names when nothing fits:
the plan it returns at that limit is run and measured too. Before the fix each figure of a layer's
transient bytes was carried to every size unscaled (+68 % at m = 16, the smallest fit 2x the truth).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import profile
from partitioner.auto import search
from partitioner.figures import Profile
from partitioner.partition import plan_for
from partitioner.scaling import scale_profile, second_rows
from pipeline.plan import Plan
from pipeline.runtime.pipe import Pipeline
from tests.dist import job

ROWS, WIDTH = 256, 128
MS = (2, 4, 8, 16, 32, 64)
MODES = ("never", "always")
BALANCE = [4, 3]
TOO_SMALL = 3.4e5  # above the weights, gradients and AdamW state per rank, below any activation


def _model() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                          nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 32))  # fmt: skip
    return model, torch.randn(ROWS, 32), torch.randn(ROWS, 32)


@functools.cache
def _profiles() -> tuple[Profile, tuple[Profile, int]]:
    """The profile at the whole batch and the second one the auto search takes (bytes only matter)."""
    model, x, y = _model()
    loss = nn.functional.mse_loss
    prof = profile(model, x, loss_fn=loss, target=y, warmup=0, repeat=1)
    other = second_rows(ROWS, ROWS, [m for m in range(1, ROWS + 1) if ROWS % m == 0])
    return prof, (profile(model, x[:other], loss_fn=loss, target=y[:other], warmup=0, repeat=1), other)


def _search(limit: float) -> Plan:
    prof, second = _profiles()
    return search(prof, 2, batch_size=ROWS, sample_rows=ROWS, memory_limit=limit, second=second,
                  schedules=["1f1b"], optimizer_state_factor=2.0)  # fmt: skip


@functools.cache
def _smallest() -> tuple[float, Plan]:
    """The smallest limit the search names when nothing fits, and its plan at that limit."""
    with pytest.raises(ValueError, match="smallest memory_limit that fits is") as err:
        _search(TOO_SMALL)
    found = re.search(r"smallest memory_limit that fits is ([0-9.e+]+) bytes", str(err.value))
    assert found is not None
    limit = float(found.group(1))
    return limit, _search(limit)


def _peak(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, plan: Plan) -> int:
    """This rank's true peak of a training step with AdamW's state alive (the steady state's step)."""
    pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.AdamW(pipe.parameters())
    pipe.step(x, y)
    opt.step()
    opt.zero_grad()
    pipe.step(x, y, measure_memory=True)
    peak = int(pipe.memory_stats(optimizer=opt)["peak"])
    pipe.close()
    return peak


def _measure(smallest: Plan) -> dict[Any, int]:
    model, x, y = _model()
    out: dict[Any, int] = {}
    for m in MS:
        for mode in MODES:
            plan = Plan(balance=BALANCE, schedule="1f1b", n_microbatches=m, recompute=mode)
            out[(m, mode)] = _peak(model, x, y, plan)
    out["smallest"] = _peak(model, x, y, smallest)
    return out


_MEASURED = job(2, _measure, make_args=lambda _: (_smallest()[1],), timeout=240.0)


def test_scaled_predictions_bound_the_measured_peak_within_ten_percent(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    measured = _MEASURED.results(tmp_path_factory)
    prof, second = _profiles()
    wrong = []
    for m in MS:
        scaled = scale_profile(prof, ROWS, ROWS // m, second)
        for mode in MODES:
            plan = plan_for(scaled, BALANCE, schedule="1f1b", n_microbatches=m, recompute=mode,
                            optimizer_state_factor=2.0)  # fmt: skip
            for r, got in enumerate(res[(m, mode)] for res in measured):
                if not got <= plan.rank_peaks[r] <= 1.10 * got:
                    wrong.append(f"m={m} {mode} rank {r}: measured {got}, predicted {plan.rank_peaks[r]:.0f}")
    assert not wrong, "\n".join(wrong)


def test_the_smallest_fit_auto_names_is_the_measured_peak_within_ten_percent(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    measured = _MEASURED.results(tmp_path_factory)
    limit, plan = _smallest()
    peaks = [res["smallest"] for res in measured]
    assert all(got <= predicted <= limit for got, predicted in zip(peaks, plan.rank_peaks, strict=True))
    assert limit <= 1.10 * max(peaks), (limit, peaks, plan.summary())
