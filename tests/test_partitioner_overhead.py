"""The runtime's own cost per action and per message (``partitioner.overhead``) in the search's prices.

Without it, many tiny micro-batches look as fast as their compute: the auto plan picked
interleaved-1F1B with m = 8 (one row each) on the GPT, predicted faster than 1F1B with m = 2 and
measured 4.1x slower. Here: each action and message is charged exactly once in the plan, a
profile whose compute barely shrinks with the rows no longer wins with the most micro-batches,
the fit recovers the costs a simulated micro-benchmark was made with, and the second profile is
taken at the smallest micro-batch the search tries.
"""

from __future__ import annotations

import dataclasses

import pytest

from partitioner import plan_for
from partitioner.auto import search
from partitioner.figures import Profile
from partitioner.overhead import (
    DEFAULT_RUNTIME,
    NO_RUNTIME,
    RuntimeCosts,
    _basis,
    _configs,
    fit_runtime,
    measure_runtime,
    stage_extras,
)
from partitioner.scaling import scale_profile, second_rows
from pipeline.plan import Plan
from tests.dist import job
from tests.test_partitioner_auto import synthetic


@pytest.mark.parametrize(("schedule", "v"), [("interleaved-1f1b", 2), ("zb-h1", 1), ("1f1b", 1)])
def test_each_action_and_message_is_charged_once(schedule: str, v: int) -> None:
    prof = synthetic(8, rows=1, seed=0)
    balance = [2, 2, 2, 2] if v == 2 else [4, 4]
    costs = RuntimeCosts(action=1e-3, message=2e-4)
    bare = plan_for(prof, balance, schedule=schedule, n_microbatches=4, n_virtual=v)
    charged = plan_for(prof, balance, schedule=schedule, n_microbatches=4, n_virtual=v, runtime=costs)
    k = len(balance)
    split = schedule == "zb-h1"
    for s, (a, b) in enumerate(zip(bare.stages, charged.stages, strict=True)):
        messages = int(s > 0) + int(s < k - 1)  # receive the input, send the output (and back)
        each = 1e-3 + 2e-4 * messages
        assert b.forward_time - a.forward_time == pytest.approx(each, abs=1e-15)
        w = 1e-3 if split else 0.0  # zb-h1's W is an action of its own, with no message
        assert b.backward_time - a.backward_time == pytest.approx(each + w, abs=1e-15)
        assert b.weight_time - a.weight_time == pytest.approx(w, abs=1e-15)
    # every rank runs m * v * (2 or 3) actions one after another: the step grows at least by that
    per_rank = 4 * v * (3 if split else 2) * 1e-3
    assert charged.step_time >= bare.step_time + per_rank
    assert plan_for(prof, balance, schedule=schedule, n_microbatches=4, n_virtual=v,
                    runtime=NO_RUNTIME).step_time == bare.step_time  # fmt: skip


def _per_row(n: int) -> tuple[Profile, Profile]:
    """A profile at 8 rows whose layers' time is nearly all per row (0.02 ms per call, 0.1 ms per
    row forward), and the same at 1 row: the second size the search profiles. Its compute alone
    says: pipeline as many micro-batches as possible, the bubble shrinks."""

    def at(rows: int) -> Profile:
        prof = scale_profile(synthetic(n, rows=8, seed=1), 8, rows)
        layers = [
            dataclasses.replace(
                lp,
                forward_time=2e-5 + 1e-4 * rows,
                backward_time=4e-5 + 2e-4 * rows,
                input_time=2e-5 + 1e-4 * rows,
                weight_time=2e-5 + 1e-4 * rows,
            )
            for lp in prof.layers
        ]
        return dataclasses.replace(prof, layers=layers)

    return at(8), at(1)


def test_tiny_microbatches_lose_once_the_runtime_is_charged() -> None:
    at8, at1 = _per_row(8)
    kw = dict(batch_size=8, sample_rows=8, memory_limit=None, second=(at1, 1))
    free = search(at8, 2, runtime=NO_RUNTIME, **kw)  # type: ignore[arg-type]
    assert free.n_microbatches * free.n_virtual >= 8  # what the bench's GPT picked: the bubble hides
    measured = RuntimeCosts(action=1.5e-3, message=5e-4)  # what measure_runtime found under load
    charged = search(at8, 2, runtime=measured, **kw)  # type: ignore[arg-type]
    assert charged.n_microbatches * charged.n_virtual <= 2, charged.candidates_table()
    # and the default (a lightly loaded machine) already turns m = 8, v = 2 down
    default = search(at8, 2, **kw)  # type: ignore[arg-type]
    assert (default.schedule, default.n_microbatches) != ("interleaved-1f1b", 8)
    assert default.n_microbatches * default.n_virtual < free.n_microbatches * free.n_virtual


def test_fit_recovers_the_costs_a_benchmark_was_simulated_with() -> None:
    truth, c0 = RuntimeCosts(action=4e-4, message=3e-4), 5e-3
    scheds = [
        Plan(balance=[2 // v] * (2 * v), schedule=name, n_microbatches=m, n_virtual=v).build_schedule()
        for name, m, v in _configs(2)
    ]
    samples = [(s, c0 + _basis(s, truth)) for s in scheds]
    got = fit_runtime(samples)
    assert got.action == pytest.approx(truth.action, rel=1e-6)
    assert got.message == pytest.approx(truth.message, rel=1e-6)
    # steps that fall with more actions: no negative cost, the term is dropped
    falling = [(s, 0.05 - _basis(s, RuntimeCosts(action=1e-4))) for s in scheds]
    assert fit_runtime(falling).action == 0.0
    with pytest.raises(ValueError, match="at least 3 measured schedules"):
        fit_runtime(samples[:2])


def test_stage_extras_and_the_checks() -> None:
    costs = RuntimeCosts(action=1.0, message=0.5)
    assert stage_extras(4, 2, costs) == [(1.5, 1.5), (2.0, 2.0), (2.0, 2.0), (1.5, 1.5)]
    assert stage_extras(2, 1, costs) == [(1.0, 1.0), (1.0, 1.0)]  # one rank: no message crosses
    assert DEFAULT_RUNTIME.action > 0 and DEFAULT_RUNTIME.message > 0
    with pytest.raises(ValueError, match=r"RuntimeCosts.action \(-1.0\) must be finite seconds >= 0"):
        RuntimeCosts(action=-1.0)
    with pytest.raises(ValueError, match="initialised process group"):
        measure_runtime()  # collective: on the ranks, not in a lone process
    with pytest.raises(TypeError, match=r"must be a partitioner\.overhead\.RuntimeCosts"):
        plan_for(synthetic(4), [2, 2], runtime=0.1)  # type: ignore[arg-type]


def test_the_second_profile_is_the_smallest_micro_batch() -> None:
    assert second_rows(8, 8, [1, 2, 4, 8]) == 1  # c measured at 1 row, not extrapolated from 8 and 4
    assert second_rows(8, 8, [2]) == 4  # one m: its rows
    assert second_rows(1, 8, [1, 2, 4, 8]) == 8  # the sample has the smallest: the largest instead
    assert second_rows(4, 4, [1]) == 2  # one size only: another one for the slope
    assert second_rows(1, 1, [1]) == 2


def _measured_on_halves() -> tuple[list[int], RuntimeCosts]:
    """measure_runtime on a group of 2 of the 4 ranks: its pipelines run on that group (each half
    measures on its own), so what it fits is the group's."""
    import torch.distributed as dist

    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = halves[rank // 2]
    return dist.get_process_group_ranks(mine), measure_runtime(mine, steps=1, warmup=0)


_HALVES = job(4, _measured_on_halves, timeout=120.0)


def test_measure_runtime_runs_on_the_group_it_is_given(tmp_path_factory: pytest.TempPathFactory) -> None:
    results = _HALVES.results(tmp_path_factory)
    for g, (ranks, costs) in enumerate(results):
        assert ranks == ([0, 1] if g < 2 else [2, 3])
        assert costs.action >= 0.0 and costs.message >= 0.0
        assert costs == results[ranks[0]][1]  # collective: the group's ranks return the same
