"""``pipeline.plan.Plan``: the contract's defaults and checks, JSON of every field, split, the table.

# p: ranks, v: stages per rank, m: micro-batches (letters: pipeline/__init__.py)
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import partitioner
from pipeline.plan import Plan, StagePlan


def _stage(start: int, stop: int, fwd: float, bwd: float, weight: float = 0.0) -> StagePlan:
    return StagePlan(
        start=start,
        stop=stop,
        names=[str(layer) for layer in range(start, stop)],
        forward_time=fwd,
        backward_time=bwd,
        cost=fwd + bwd,
        memory_bytes=1e6 * (start + 1),
        sent_bytes=512 * stop,
        weight_time=weight,
    )


def _plan() -> Plan:
    return Plan(
        balance=[2, 1],
        schedule="1f1b",
        n_microbatches=4,
        dp=2,
        stages=[_stage(0, 2, 0.001, 0.002), _stage(2, 3, 0.002, 0.002)],
        bottleneck=0.004,
        step_time=0.02,
        bubble=0.25,
        cost="time",
        prediction="simulator",
    )


def test_one_definition() -> None:
    assert partitioner.Plan is Plan and partitioner.StagePlan is StagePlan


def test_defaults_follow_schedule_options() -> None:
    plan = Plan(balance=[1, 2, 3])
    assert (plan.schedule, plan.n_microbatches, plan.n_virtual, plan.recompute) == ("1f1b", 3, 1, "never")
    assert (plan.n_ranks, plan.n_stages, plan.n_layers) == (3, 3, 6)
    assert (plan.stages, plan.prediction, plan.extra) == ([], "none", {})
    inter = Plan(balance=[1, 1, 1, 1, 1, 1], schedule="interleaved-1f1b")
    assert (inter.n_virtual, inter.n_ranks, inter.n_microbatches) == (2, 3, 3)  # v = 2, m = p
    three = Plan(balance=[1] * 6, schedule="interleaved-1f1b", n_virtual=3, n_microbatches=4)
    assert (three.n_ranks, three.n_microbatches) == (2, 4)
    sched = three.build_schedule()
    assert (sched.name, sched.n_ranks, sched.n_virtual, sched.n_microbatches) == ("interleaved-1f1b", 2, 3, 4)
    assert three.build_schedule() is sched  # built once per plan shape


def test_json_round_trips_every_field() -> None:
    plan = Plan(
        balance=[1, 2, 1, 3],
        schedule="interleaved-1f1b",
        n_microbatches=4,
        n_virtual=2,
        recompute="except_last",
        dp=3,
        stages=[
            _stage(0, 1, 1.0, 2.0, 0.5),
            _stage(1, 3, 0.5, 0.5, 0.25),
            _stage(3, 4, 2.0, 2.0, 1.0),
            _stage(4, 7, 0.25, 0.25, 0.125),
        ],
        bottleneck=4.0,
        step_time=30.5,
        bubble=0.125,
        cost="flops",
        prediction="simulator",
        extra={"note": "measured on cpu", "speeds": [1.0, 2.0], "nested": {"k": 4}},
    )
    defaults = Plan(balance=[1, 1])
    for f in dataclasses.fields(Plan):  # every field is set away from its default, so the test sees it
        if f.name != "balance":
            assert getattr(plan, f.name) != getattr(defaults, f.name), f.name
    assert all(st.weight_time > 0 for st in plan.stages)
    text = plan.to_json()
    assert set(json.loads(text)) == {f.name for f in dataclasses.fields(Plan)}
    back = Plan.from_json(text)
    assert back == plan
    for f in dataclasses.fields(Plan):
        assert getattr(back, f.name) == getattr(plan, f.name), f.name
    assert all(isinstance(st, StagePlan) for st in back.stages)
    assert Plan.from_json(Plan(balance=[3, 4]).to_json()) == Plan(balance=[3, 4])  # no predictions


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"balance": []}, ValueError, r"balance \[\] must hold at least one stage"),
        ({"balance": [2, 0]}, ValueError, r"balance \[2, 0\] must hold at least one stage, each of >= 1"),
        ({"balance": "3,4"}, TypeError, r"balance must be a list of layer counts per stage, got '3,4'"),
        ({"balance": [1.5, 2]}, TypeError, r"got \[1\.5, 2\]"),
        ({"balance": [True, 2]}, TypeError, r"got \[True, 2\]"),
        ({"balance": 4}, TypeError, "got 4"),
        ({"balance": [1, 1], "recompute": "sometimes"}, ValueError, "'sometimes'"),
        (
            {"balance": [1, 1, 1], "schedule": "interleaved-1f1b"},
            ValueError,
            r"balance has 3 stages, not a multiple of n_virtual \(2\) stages per rank",
        ),
        (
            {"balance": [1, 1, 1, 1], "schedule": "interleaved-1f1b", "n_virtual": 3},
            ValueError,
            r"balance has 4 stages, not a multiple of n_virtual \(3\)",
        ),
        ({"balance": [1, 1], "schedule": "nope"}, ValueError, "unknown schedule 'nope'"),
        ({"balance": [1, 1], "n_virtual": 2}, ValueError, r"n_virtual \(2\) must be 1 for '1f1b'"),
        ({"balance": [1, 1], "n_virtual": -1}, ValueError, r"n_virtual \(-1\) must be an integer >= 1"),
        (
            {"balance": [1, 1, 1, 1], "schedule": "interleaved-1f1b", "n_microbatches": 3},
            ValueError,
            r"n_microbatches \(3\) must be a multiple of the number of ranks \(2\)",
        ),
        (
            {"balance": [1, 1], "stages": [_stage(0, 1, 1.0, 1.0)]},
            ValueError,
            "plan has 1 stage predictions for 2 stages",
        ),
    ],
)
def test_bad_plans(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Plan(**kwargs)  # type: ignore[arg-type]


def test_replace_checks_again() -> None:
    plan = Plan(balance=[1, 1, 1, 1], schedule="interleaved-1f1b")
    assert plan.replace(n_microbatches=4).n_microbatches == 4
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        plan.replace(n_microbatches=3)
    with pytest.raises(TypeError):
        Plan([1, 1])  # type: ignore[misc]  # keyword-only


def test_split_keeps_layers_and_names() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    first, second = _plan().split(model)
    assert first[0] is model[0] and first[1] is model[1] and second[0] is model[2]
    assert [n for n, _ in second.named_parameters()] == ["2.weight", "2.bias"]
    names = [n for part in (first, second) for n, _ in part.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    x = torch.randn(5, 3)
    assert torch.equal(second(first(x)), model(x))
    # a plan without predictions splits by its balance alone
    a, b = Plan(balance=[1, 2]).split(model)
    assert len(a) == 1 and len(b) == 2 and b[1] is model[2]


def test_split_rejects_another_model() -> None:
    with pytest.raises(ValueError, match=r"nn\.Sequential of 3 layers, got 2 layers"):
        _plan().split(nn.Sequential(nn.ReLU(), nn.ReLU()))
    with pytest.raises(ValueError, match="got Linear"):
        _plan().split(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_table() -> None:
    text = str(_plan())
    assert "stage" in text and "0-1" in text and "balance [2, 1]" in text and "bubble 0.250" in text
    assert "[1f1b, m=4, v=1, recompute never, dp=2]" in text  # dp shown when the pipeline is replicated
    assert "(2.000x ours)" in _plan().table(reference=0.002)
    assert str(Plan(balance=[3, 4])) == "balance [3, 4]  [1f1b, m=2, v=1, recompute never] (no predictions)"


def test_predicted_busy_sums_each_ranks_stages() -> None:
    stages = [
        _stage(0, 1, 1.0, 2.0),
        _stage(1, 2, 0.5, 0.5),
        _stage(2, 3, 2.0, 2.0),
        _stage(3, 4, 0.25, 0.25),
    ]
    plan = Plan(balance=[1, 1, 1, 1], schedule="interleaved-1f1b", n_microbatches=4, stages=stages)
    # p = 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; every stage runs m = 4 micro-batches
    assert plan.predicted_busy() == [4 * (3.0 + 4.0), 4 * (1.0 + 0.5)]
    flat = Plan(balance=[1, 1, 1, 1], n_microbatches=2, stages=stages)
    assert flat.predicted_busy() == [6.0, 2.0, 8.0, 1.0]


def test_dp_is_the_number_of_replicas() -> None:
    plan = Plan(balance=[1, 1, 1, 1], schedule="interleaved-1f1b")
    assert plan.dp == 1 and plan.world_size == 2  # 2 ranks x 2 stages each, one pipeline
    four = plan.replace(dp=2)
    assert four.world_size == 4 and four.n_ranks == 2 and four.summary().endswith(", dp=2]")
    assert Plan.from_json(four.to_json()).dp == 2
    old = json.loads(plan.to_json())
    del old["dp"]  # a plan written before dp existed: one pipeline
    assert Plan.from_json(json.dumps(old)) == plan
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=rf"dp \({bad!r}\) must be an integer >= 1: the number of "):
            Plan(balance=[1, 1], dp=bad)  # type: ignore[arg-type]


def test_recompute_per_stage_round_trips_and_reads_per_stage() -> None:
    plan = Plan(balance=[2, 2, 1, 1], schedule="interleaved-1f1b", n_microbatches=2,
                recompute=["always", "never", "except_last", "never"])  # fmt: skip
    assert plan.recompute == ("always", "never", "except_last", "never")  # a list becomes a tuple
    assert [plan.recompute_of(s) for s in range(4)] == ["always", "never", "except_last", "never"]
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.recompute == plan.recompute
    assert "recompute (always, never, except_last, never)" in plan.summary()
    one = Plan(balance=[1, 1], recompute="always")
    assert [one.recompute_of(s) for s in (0, 1)] == ["always", "always"]
    assert Plan.from_json(one.to_json()).recompute == "always"
    with pytest.raises(ValueError, match=r"stage 2 is not one of the plan's stages 0..1"):
        one.recompute_of(2)


@pytest.mark.parametrize(
    ("recompute", "error", "match"),
    [
        (
            ("always", "sometimes"),
            ValueError,
            r"recompute\[1\] \(stage 1\) is 'sometimes'; each must be one of",
        ),
        (("always",), ValueError, r"recompute has 1 modes for 2 stages; give one mode per stage"),
        (("never", "never", "never"), ValueError, r"recompute has 3 modes for 2 stages"),
        (3, TypeError, r"recompute must be a mode .* or a list of one mode per stage, got int 3"),
        (("never", None), ValueError, r"recompute\[1\] \(stage 1\) is None"),
    ],
)
def test_recompute_per_stage_is_checked(recompute: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Plan(balance=[1, 1], recompute=recompute)  # type: ignore[arg-type]


def test_table_shows_a_traced_plans_cuts_and_ties() -> None:
    plan = Plan(balance=[2, 2], extra={"cuts": ["blocks.2"], "ties": {"wte.weight": [0, 1]}})
    text = plan.table()
    assert "cuts before blocks.2" in text and "tied weights wte.weight: stages [0, 1]" in text
    assert "cuts before" not in Plan(balance=[2, 2]).table()
    assert "no candidates" in Plan(balance=[2, 2]).candidates_table()


def test_a_plan_prints_each_ranks_program() -> None:
    plan = Plan(balance=[2, 2], schedule="1f1b", n_microbatches=2)
    assert plan.program(1) == plan.build_schedule().program(1)
    assert str(plan.program(0)).splitlines()[:2] == ["0F0", "post 0SEND_F0 0RECV_B0"]
    with pytest.raises(ValueError, match=r"rank \(2\) must be an integer in \[0, 2\)"):
        plan.program(2)
