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
import sys
from pathlib import Path
from typing import Any

import pytest

from partitioner.figures import Profile
from partitioner.partition import plan_for
from partitioner.scaling import scale_profile
from pipeline.plan import Plan
from tests.dist import job

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_memory_scaling as bench  # the model, its profiles, the search and the measured peak
from bench_memory_scaling import BALANCE, MODES, MS

ROWS, WIDTH = 256, 128
TOO_SMALL = 3.4e5  # above the weights, gradients and AdamW state per rank, below any activation


@functools.cache
def _profiles() -> tuple[Profile, tuple[Profile, int]]:
    """The profile at the whole batch and the second one the auto search takes (bytes only matter)."""
    return bench.profiles(*bench.build(ROWS, WIDTH))


@functools.cache
def _smallest() -> tuple[float, Plan]:
    """The smallest limit the search names when nothing fits, and its plan at that limit."""
    prof, second = _profiles()
    with pytest.raises(ValueError, match="smallest memory_limit that fits is") as err:
        bench.auto(prof, second, ROWS, TOO_SMALL)
    limit = bench.named_limit(err.value)
    assert limit is not None
    return limit, bench.auto(prof, second, ROWS, limit)


def _measure(smallest: Plan) -> dict[Any, int]:
    plans: dict[Any, Plan] = {
        (m, mode): Plan(balance=BALANCE, schedule="1f1b", n_microbatches=m, recompute=mode)
        for m in MS
        for mode in MODES
    }
    return bench.measure(ROWS, WIDTH, {**plans, "smallest": smallest})


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
