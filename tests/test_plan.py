"""``pipeline.plan.Plan``: the contract's defaults and checks, JSON of every field (and of the old
``extra``), split, the table.

# p: ranks, v: stages per rank, m: micro-batches (letters: pipeline/__init__.py)
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import partitioner
from pipeline.plan import Candidate, DeviceMemory, Plan, SearchStats, StagePlan, TracedGraph
from pipeline.schedules.peaks import PARTS, StageBytes


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


def _candidate(balance: list[int], step: float, recompute: str | tuple[str, ...] = "never") -> Candidate:
    return Candidate(schedule="interleaved-1f1b", n_microbatches=4, n_virtual=2, recompute=recompute,
                     balance=balance, step_time=step, bubble=0.25, peak_bytes=[3e6, 2.5e6])  # fmt: skip


# one H200's as the review found them: two 32 MiB workspaces, 512 B blocks; the default headroom
_H200 = DeviceMemory(
    device="cuda:0", workspace_bytes=64 * 2**20, block_bytes=512, rounding=0.002, headroom=0.1
)
_GRAPH = TracedGraph(method="export", fingerprint="9f2c", sample=[([2, 8], "int64")], layers=["tok", "head"])


def test_one_definition() -> None:
    assert partitioner.Plan is Plan and partitioner.StagePlan is StagePlan


def test_defaults_follow_schedule_options() -> None:
    plan = Plan(balance=[1, 2, 3])
    assert (plan.schedule, plan.n_microbatches, plan.n_virtual, plan.recompute) == ("1f1b", 3, 1, "never")
    assert (plan.n_ranks, plan.n_stages, plan.n_layers) == (3, 3, 6)
    assert (plan.stages, plan.prediction, plan.rank_peaks, plan.ties, plan.cuts) == ([], "none", [], {}, [])
    assert (plan.graph, plan.candidates, plan.search, plan.batch_size) == (None, [], None, 0)
    inter = Plan(balance=[1, 1, 1, 1, 1, 1], schedule="interleaved-1f1b")
    assert (inter.n_virtual, inter.n_ranks, inter.n_microbatches) == (2, 3, 3)  # v = 2, m = p
    three = Plan(balance=[1] * 6, schedule="interleaved-1f1b", n_virtual=3, n_microbatches=4)
    assert (three.n_ranks, three.n_microbatches) == (2, 4)
    sched = three.build_schedule()
    assert (sched.name, sched.n_ranks, sched.n_virtual, sched.n_microbatches) == ("interleaved-1f1b", 2, 3, 4)
    assert three.build_schedule() is sched  # built once per plan shape


def test_json_round_trips_every_field() -> None:
    held = StageBytes(saved=3.0, input=1.0, output=2.0, static=7.0, squared=(0.5, *[0.0] * (len(PARTS) - 1)))
    first = _stage(0, 1, 1.0, 2.0, 0.5)  # with the length² shares and the walk's figures
    first = dataclasses.replace(
        first, forward_squared=0.25, backward_squared=0.5, weight_squared=0.125, held=held
    )
    plan = Plan(
        balance=[1, 2, 1, 3],
        schedule="interleaved-1f1b",
        n_microbatches=4,
        n_virtual=2,
        recompute="except_last",
        dp=3,
        shard=2,
        tp=2,
        zero=3,
        stages=[
            first,
            _stage(1, 3, 0.5, 0.5, 0.25),
            _stage(3, 4, 2.0, 2.0, 1.0),
            _stage(4, 7, 0.25, 0.25, 0.125),
        ],
        bottleneck=4.0,
        step_time=30.5,
        bubble=0.125,
        cost="flops",
        prediction="simulator",
        rank_peaks=[4e6, 3.5e6],
        ties={"tok.weight": [0, 3]},
        cuts=["blocks.0", "blocks.1", "head"],
        problems=["the boundary between stages 0 and 1: layer 1 (1: ReLU) writes into its input"],
        graph=_GRAPH,
        autocast="bfloat16",
        loss_profiled=True,
        candidates=[_candidate([1, 2, 1, 3], 30.5), _candidate([2, 1, 1, 3], 31.0, ("always",) * 4)],
        search=SearchStats(grid=48, simulated=7, pruned_group=30, pruned_fit=4, pruned_balance=7, seconds=1),
        batch_size=32,
        micro_batch_rows=8,
        micro_batch_shape=[8, 64],
        memory_limit=[5e6, 6e6],
        device_memory=_H200,
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
    assert back.stages[0].held == held and back.stages[1].held is None  # the walk's figures, typed again
    assert isinstance(back.graph, TracedGraph) and isinstance(back.search, SearchStats)
    assert all(isinstance(c, Candidate) for c in back.candidates)
    assert back.candidates[1].recompute == ("always",) * 4  # a tuple again, as given
    assert isinstance(back.device_memory, DeviceMemory) and back.usable_limits() == plan.usable_limits()
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


def test_a_plan_written_with_extra_reads_into_the_typed_fields() -> None:
    """Run folders hold plans written before the typed fields: their findings in an "extra" object."""
    new = Plan(balance=[2, 2], rank_peaks=[1e6, 2e6], ties={"tok.weight": [0, 1]}, cuts=["blocks.1"],
               problems=["a boundary"], graph=_GRAPH, autocast="bfloat16", loss_profiled=True,
               candidates=[_candidate([2, 2], 0.5)], search=SearchStats(grid=3, simulated=2, seconds=0.1),
               batch_size=8, micro_batch_rows=4)  # fmt: skip
    old = {k: v for k, v in json.loads(new.to_json()).items() if k in ("balance", "schedule", "dp")}
    old["extra"] = {
        "rank_peaks": [1e6, 2e6],
        "ties": {"tok.weight": [0, 1]},
        "cuts": ["blocks.1"],
        "problems": ["a boundary"],
        "graph": {"method": "export", "fingerprint": "9f2c", "sample": [[[2, 8], "int64"]],
                  "layers": ["tok", "head"]},
        "autocast": "bfloat16",
        "loss": True,  # now loss_profiled
        "candidates": [json.loads(json.dumps(dataclasses.asdict(_candidate([2, 2], 0.5))))],
        "search": {"grid": 3, "simulated": 2, "pruned_group": 0, "pruned_fit": 0, "pruned_balance": 0,
                   "seconds": 0.1},
        "batch_size": 8,
        "micro_batch_rows": 4,
        "recorded_in": "runs/ckpt/step-00000200",  # a script's note: no field, dropped
    }  # fmt: skip
    assert Plan.from_json(json.dumps(old)) == new
    bare = {"balance": [2, 2], "extra": {"autocast": None, "loss": False, "note": "x"}}  # a balance's plan
    assert Plan.from_json(json.dumps(bare)) == Plan(balance=[2, 2])


def test_a_plan_written_before_the_length_figures_reads_as_linear() -> None:
    """Plans written before micro-batch shapes, length² shares and the walk's figures: read with
    every share 0 (all as the tokens), no figures, no shape and no memory_limit (varlen's fallback)."""
    text = _plan().to_json()
    old = json.loads(text)
    del old["micro_batch_shape"], old["memory_limit"]
    for st in old["stages"]:
        for key in ("forward_squared", "backward_squared", "weight_squared", "held"):
            del st[key]
    back = Plan.from_json(json.dumps(old))
    assert back == _plan() and (back.micro_batch_shape, back.memory_limit) == ([], [])
    assert all((st.forward_squared, st.backward_squared, st.weight_squared, st.held) == (0, 0, 0, None)
               for st in back.stages)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"graph": {"method": "fx"}}, TypeError, r"graph must be a TracedGraph or None, got dict"),
        ({"search": {"grid": 3}}, TypeError, r"search must be a SearchStats or None, got dict"),
        ({"candidates": [{"schedule": "1f1b"}]}, TypeError, r"candidates must be a list of Candidate, got"),
        ({"cuts": "blocks.1"}, TypeError, r"cuts must be a list of layer names, got str 'blocks.1'; pass a"),
        ({"rank_peaks": 1e6}, TypeError, r"rank_peaks must be a list of peak bytes, one per rank, got float"),
        ({"rank_peaks": [1e6, "2MB"]}, TypeError, r"rank_peaks must be a list .*got list \[1000000.0, '2MB'"),
        ({"ties": ["tok.weight"]}, TypeError, r"ties must be a dict of parameter name -> the stages holding"),
        ({"ties": {"tok.weight": 1}}, TypeError, r"ties\['tok.weight'\] must be a list of stage indices"),
        ({"batch_size": -1}, ValueError, r"batch_size \(-1\) must be an integer >= 0 \(0: not searched\)"),
        ({"micro_batch_rows": 2.5}, ValueError, r"micro_batch_rows \(2.5\) must be an integer >= 0"),
        ({"micro_batch_shape": [8]}, ValueError, r"micro_batch_shape \(\[8\]\) must be \[rows, length\]"),
        ({"memory_limit": [1e9]}, ValueError, r"memory_limit has 1 entries for 2 ranks; give one per rank"),
        ({"device_memory": {"rounding": 0}}, TypeError, r"device_memory must be a DeviceMemory, got dict"),
    ],
)  # fmt: skip
def test_bad_findings_are_named(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Plan(balance=[1, 1], **kwargs)  # type: ignore[arg-type]


def test_findings_are_kept_as_lists() -> None:
    plan = Plan(balance=[1, 1], rank_peaks=(1, 2.5), ties={"w": (0, 1)}, cuts=("l1",))  # type: ignore[arg-type]
    assert (plan.rank_peaks, plan.ties, plan.cuts) == ([1.0, 2.5], {"w": [0, 1]}, ["l1"])
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.replace(dp=2).ties == plan.ties  # replace keeps the findings


def test_table_shows_a_traced_plans_cuts_and_ties() -> None:
    plan = Plan(balance=[2, 2], cuts=["blocks.2"], ties={"wte.weight": [0, 1]})
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
    # the plan's replicas and tied weights are in it: its reductions and collectives
    tied = plan.replace(dp=2, ties={"wte.weight": [0, 1]})
    assert [str(x) for x in tied.program(0).tail()] == [
        "wait reduce 0", "all_reduce ties 0,1", "broadcast loss 1 0,1", "all_reduce loss replicas",
    ]  # fmt: skip


# ---- what a rank's device holds beyond the walk (DeviceMemory): one rule for fit, need and messages


def test_device_memory_reserves_workspaces_rounding_and_headroom() -> None:
    d = _H200
    limit = 1e9
    usable = d.usable(limit)
    assert usable == pytest.approx((limit * 0.9 - 64 * 2**20) / 1.002)
    assert d.need(usable) == pytest.approx(limit * 0.9) and d.limit_for(usable) == pytest.approx(limit)
    plan = Plan(balance=[1, 1], rank_peaks=[usable, 1e8], memory_limit=[limit, limit], device_memory=d)
    assert plan.usable_limits() == [usable, usable] and plan.usable_limits([2e9]) == [d.usable(2e9)]
    assert plan.rank_needs == [d.need(usable), d.need(1e8)]
    assert "device memory per rank: peak + 67.11 MB workspaces + 0.20% rounding = 900.00, 167.31 MB on " \
        "cuda:0; 10% of the limit kept free" in plan.table()  # fmt: skip
    assert "64.00 MiB for the matrix products' workspaces" in d.describe()
    assert "memory_headroom=" in d.describe() and "CUBLAS_WORKSPACE_CONFIG" in d.describe()


def test_cpu_device_memory_reserves_nothing() -> None:
    """The default is a CPU's: the limit is the walk's own, and the table is as without it."""
    d = DeviceMemory()
    assert not d.reserves and (d.usable(123.0), d.need(123.0), d.limit_for(123.0)) == (123.0, 123.0, 123.0)
    plan = Plan(balance=[1, 1], rank_peaks=[1e6, 2e6], memory_limit=[5e6, 5e6])
    assert plan.rank_needs == plan.rank_peaks and plan.usable_limits() == plan.memory_limit
    assert "device memory" not in plan.table()
    old = json.loads(plan.to_json())
    del old["device_memory"]  # a plan written before the field reads as a CPU's
    assert Plan.from_json(json.dumps(old)) == plan


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workspace_bytes": -1.0}, r"DeviceMemory.workspace_bytes \(-1.0\) must be a finite number >= 0"),
        ({"rounding": float("nan")}, r"DeviceMemory.rounding \(nan\) must be a finite number >= 0"),
        ({"block_bytes": 0}, r"DeviceMemory.block_bytes \(0\) must be an integer >= 1 \(1: no rounding\)"),
        ({"headroom": 1.0}, r"DeviceMemory.headroom \(1.0\) must be a fraction in \[0, 1\)"),
        ({"headroom": True}, r"DeviceMemory.headroom \(True\) must be a fraction in \[0, 1\)"),
    ],
)
def test_bad_device_memory_is_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DeviceMemory(**kwargs)  # type: ignore[arg-type]
