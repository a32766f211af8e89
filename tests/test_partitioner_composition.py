"""The partitioner plans the composition with FSDP2 and tensor parallelism (``partitioner.composition``).

Every profile here is synthetic (fixed times, bytes and flops), so nothing depends on host load.
"""

from __future__ import annotations

import math

import pytest
from torch import nn

from partitioner import partition, plan_for
from partitioner.composition import Composition
from partitioner.figures import LayerProfile, Profile
from partitioner.graph import layer_graph
from partitioner.memory import stage_bytes
from pipeline.plan import REPLICA_BYTES, Plan

ROWS = 4
P, W = 40_000, 30_000  # a block's parameter bytes, of which its Linear weights
ACT = ROWS * 1024


def _layer(i: int, *, linear: bool = True, param: int = P) -> LayerProfile:
    return LayerProfile(
        i, f"l{i}", "Block" if linear else "Embedding", 1e-3 * (1 + i % 3), 2e-3 * (1 + i % 3),
        1_000_000 * (1 + i % 3), param, ACT, 2 * ACT, (ROWS, 256), "float32",
        weight_time=1e-3, input_time=1e-3, backward_flops=2_000_000 * (1 + i % 3),
        linear_weight_bytes=W if linear else 0,
    )  # fmt: skip


def synthetic(n: int = 6, embedding: bool = True) -> Profile:
    """n layers: the first an embedding (no Linear weight, unless ``embedding`` is False), the rest blocks."""
    layers = [_layer(i, linear=not (embedding and i == 0)) for i in range(n)]
    return Profile(layers, "cpu", layer_graph(layers), input_bytes=ROWS * 1024)


def _no_linear(n: int = 6) -> Profile:
    layers = [_layer(i, linear=False) for i in range(n)]
    return Profile(layers, "cpu", layer_graph(layers), input_bytes=ROWS * 1024)


def _model(n: int = 6) -> nn.Sequential:
    return nn.Sequential(*[nn.Identity() for _ in range(n)])


def _static(param: float, linear: float, shard: int, tp: int, f: float = 2.0) -> float:
    """The formula, written out again: L = P - W + W / T; S = 1: (2 + f) L; else 2 L + (1 + f) L / S."""
    local = param - linear + linear / tp
    return (2 + f) * local if shard == 1 else 2 * local + (1 + f) * local / shard


# -- memory ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shard", "tp"), [(1, 1), (2, 1), (4, 1), (1, 2), (4, 2), (8, 4)])
def test_static_bytes_follow_the_formula(shard: int, tp: int) -> None:
    rule = Composition(shard=shard, tp=tp)
    assert rule.static(P, W, 0.0) == pytest.approx(_static(P, W, shard, tp))
    prof = synthetic()
    held = stage_bytes(prof, [3, 3], rule)
    want = [_static(P, 0, shard, tp) + 2 * _static(P, W, shard, tp), 3 * _static(P, W, shard, tp)]
    assert [st.static for st in held] == pytest.approx(want)


def test_rank_peaks_fall_by_the_shard_factor() -> None:
    """Parameters, gradients and optimizer state: the sharded parts divide by S, the gathered copy and
    the unsharded gradients stay; the activations are the same."""
    prof = synthetic(embedding=False)
    peaks = {s: plan_for(prof, [3, 3], shard=s).rank_peaks for s in (1, 2, 4, 8)}
    for s in (2, 4, 8):
        for r in range(2):  # a sharded rank also holds the replicas' scalars (REPLICA_BYTES)
            gone = peaks[1][r] - peaks[s][r]
            assert gone == pytest.approx(3 * (_static(P, W, 1, 1) - _static(P, W, s, 1)) - REPLICA_BYTES)
    # the optimizer state alone: per parameter byte, f / S more bytes per unit of f
    for s in (1, 4):
        sgd, adam = (plan_for(prof, [3, 3], shard=s, optimizer_state_factor=f).rank_peaks[0]
                     for f in (0.0, 2.0))  # fmt: skip
        assert adam - sgd == pytest.approx(3 * 2.0 * P / s)
    # the gradients: the unsharded ones (L) beside the parameters' shard (L / S) and gathered copy
    # (L): 2 L + L / S with f = 0 (the reduce-scattered shard comes after the gathered copy is freed)
    zero_f = plan_for(prof, [3, 3], shard=4, optimizer_state_factor=0.0).rank_peaks[0]
    none = plan_for(prof, [3, 3], shard=1, optimizer_state_factor=0.0).rank_peaks[0]
    assert none - zero_f == pytest.approx(3 * (2 * P - (2 * P + P / 4)) - REPLICA_BYTES)


def test_tp_divides_only_the_linear_weights() -> None:
    prof = synthetic()
    one, two = (plan_for(prof, [1, 5], tp=t).rank_peaks for t in (1, 2))
    assert one[0] == pytest.approx(two[0])  # the embedding: replicated
    assert one[1] - two[1] == pytest.approx(5 * (2 + 2.0) * W / 2)


def test_partition_under_a_limit_fits_its_walk_with_shard_and_tp() -> None:
    """The rows the solver fits bound the walk under the composition too (partition checks it),
    and a limit only the sharded plan fits is met."""
    prof = synthetic(8, embedding=False)
    unsharded = plan_for(prof, [4, 4], n_microbatches=4).rank_peaks
    limit = max(unsharded) * 0.9
    with pytest.raises(ValueError, match="too small"):
        partition(_model(8), 2, None, profile=prof, n_microbatches=4, memory_limit=limit, cost="flops")
    plan = partition(_model(8), 2, None, profile=prof, n_microbatches=4, memory_limit=limit, cost="flops",
                     shard=4, tp=2)  # fmt: skip
    assert max(plan.rank_peaks) <= limit


# -- time --------------------------------------------------------------------------------------------


def test_tp_divides_the_compute_of_the_split_layers() -> None:
    prof = synthetic()
    one, two = (plan_for(prof, [1, 5], tp=t) for t in (1, 2))
    assert two.stages[0].forward_time == pytest.approx(one.stages[0].forward_time)  # the embedding: whole
    assert two.stages[1].forward_time == pytest.approx(one.stages[1].forward_time / 2)
    assert two.stages[1].backward_time == pytest.approx(one.stages[1].backward_time / 2)
    # and the flops the balance minimises (cost="flops")
    flops = [plan_for(prof, [1, 5], tp=t, cost="flops").stages[1].cost for t in (1, 2)]
    assert flops[1] == pytest.approx(flops[0] / 2)


def test_tp_all_reduces_cost_two_each_way_per_block() -> None:
    prof, bw, lat = synthetic(), 1e9, 1e-5
    one, two = (plan_for(prof, [1, 5], tp=t, bandwidth=bw, latency=lat) for t in (1, 2))
    reduce = lat + 2 * (2 - 1) / 2 * ACT / bw  # a ring all-reduce of the block's output
    link = one.stages[1].forward_time - sum(lp.forward_time for lp in prof.layers[1:])  # the cut
    assert two.stages[1].forward_time == pytest.approx(link + sum(lp.forward_time / 2 + 2 * reduce
                                                                  for lp in prof.layers[1:]))  # fmt: skip
    assert two.stages[1].backward_time - one.stages[1].backward_time / 2 == pytest.approx(
        5 * 2 * reduce + link / 2, rel=1e-6
    )


def test_fsdp_gathers_and_reduce_scatters_once_per_step() -> None:
    prof, bw = synthetic(embedding=False), 1e8
    base = plan_for(prof, [3, 3], bandwidth=bw)
    zero2 = plan_for(prof, [3, 3], bandwidth=bw, shard=4)
    collective = (4 - 1) / 4 * 3 * P / bw  # one all-gather (or reduce-scatter) of a stage's parameters
    assert zero2.step_time - base.step_time == pytest.approx(2 * collective)
    assert [st.forward_time for st in zero2.stages] == pytest.approx([st.forward_time for st in base.stages])
    # ZeRO-3: gathered before each F and each B instead, the reduce-scatter kept
    zero3 = plan_for(prof, [3, 3], bandwidth=bw, shard=4, zero=3)
    assert [a.forward_time - b.forward_time for a, b in zip(zero3.stages, base.stages, strict=True)] == (
        pytest.approx([collective] * 2)
    )
    assert zero3.step_time > zero2.step_time
    # a split backward keeps the weights gathered: ZeRO-3 there is ZeRO-2
    split = [plan_for(prof, [3, 3], bandwidth=bw, shard=4, zero=z, schedule="zb-h1").step_time
             for z in (2, 3)]  # fmt: skip
    assert split[0] == pytest.approx(split[1])


# -- the plan and the checks ---------------------------------------------------------------------------


def test_plans_carry_shard_tp_and_zero() -> None:
    prof = synthetic()
    fixed = partition(_model(), 2, None, profile=prof, shard=4, tp=2, zero=3, cost="flops")
    auto = partition(_model(), 2, None, profile=prof, schedule="auto", batch_size=4, shard=2, tp=2, zero=3)
    again = plan_for(prof, [3, 3], shard=2, tp=4)
    for plan, want in ((fixed, (4, 2, 3)), (auto, (2, 2, 3)), (again, (2, 4, 2))):
        assert (plan.shard, plan.tp, plan.zero) == want
        assert Plan.from_json(plan.to_json()) == plan
    assert fixed.world_size == 1 * 4 * 2 * 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shard": 0}, r"shard \(0\) must be an integer >= 1.*pass e\.g\. shard=2"),
        ({"tp": True}, r"tp \(True\) must be an integer >= 1"),
        ({"tp": 1.5}, r"tp \(1\.5\) must be an integer >= 1"),
        ({"zero": 1}, r"zero \(1\) must be 2 .* or 3 .*pass zero=2 or 3"),
        ({"zero": 3}, r"zero=3 reshards FSDP's parameters, but shard=1 shards nothing; pass shard >= 2"),
        ({"shard": "auto"}, r"shard='auto' searches .* pass world_size="),
        ({"world_size": 8}, r"world_size \(8\) is for the auto search .* omit world_size"),
        ({"tp": 2, "profile": _no_linear()},
         r"tp=2 splits nn\.Linear weights, but no layer of the profile holds one.*pass tp=1"),
    ],
)  # fmt: skip
def test_invalid_values_are_refused_with_the_fix(options: dict[str, object], message: str) -> None:
    kwargs: dict[str, object] = {"profile": synthetic(), "cost": "flops", **options}
    with pytest.raises(ValueError, match=message):
        partition(_model(), 2, None, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"world_size": 7, "shard": "auto"}, r"world_size \(7\) is not a multiple of n_ranks \(2\)"),
        ({"world_size": 8, "shard": "auto", "dp": 2}, r"dp \(2\) is what world_size leaves.*omit dp"),
        ({"world_size": 8, "shard": 3}, r"shard=3 x tp=1 does not divide world_size / n_ranks = 8 / 2 = 4"),
        ({"world_size": 0, "shard": "auto"}, r"world_size \(0\) must be an integer >= 1"),
    ],
)
def test_invalid_worlds_are_refused_with_the_fix(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition(_model(), 2, None, profile=synthetic(), schedule="auto", batch_size=4, **options)  # type: ignore[arg-type]


def test_tp_of_a_traced_model_is_refused() -> None:
    class Net(nn.Module):
        def forward(self, x: object) -> object:
            return x

    with pytest.raises(ValueError, match=r"tp=2 splits the layers of an nn\.Sequential.*or pass tp=1"):
        partition(Net(), 2, None, profile=synthetic(), tp=2)


# -- the auto search over (dp, shard, tp) -----------------------------------------------------------------


def _auto(limit: float | None, **options: object) -> Plan:
    return partition(_model(8), 2, None, profile=synthetic(8, embedding=False), schedule="auto", batch_size=4,
                     world_size=8, bandwidth=1e9, memory_limit=limit, **options)  # type: ignore[arg-type]  # fmt: skip


def test_auto_picks_data_parallelism_when_everything_fits() -> None:
    plan = _auto(None, shard="auto")
    assert (plan.dp, plan.shard, plan.tp) == (4, 1, 1)  # sharding only costs collectives here
    assert plan.world_size == 8


def test_auto_picks_a_shard_when_the_memory_cap_requires_it() -> None:
    # below the static bytes of any unsharded plan (4 layers on the fuller rank, 4 L with Adam) and
    # of a 2-way shard (2 L + 3 L / 2 under ZeRO-2 with Adam); a 4-way one (2 L + 3 L / 4) fits
    limit = 4 * _static(P, W, 2, 1) * 0.95
    assert 4 * _static(P, W, 2, 1) > limit > 4 * _static(P, W, 4, 1)
    plan = _auto(limit, shard="auto")
    assert (plan.dp, plan.shard, plan.tp) == (1, 4, 1)
    assert max(plan.rank_peaks) <= limit


def test_auto_searches_tp_too() -> None:
    limit = 4 * _static(P, W, 4, 1)  # a 4-way shard's static bytes alone: no room left for activations
    plan = _auto(limit, tp="auto")
    assert plan.tp > 1 and max(plan.rank_peaks) <= limit
    assert plan.dp * plan.shard * plan.tp * plan.n_ranks == 8


def test_auto_refuses_clearly_when_nothing_fits() -> None:
    limit = 4 * _static(P, W, 4, 1) * 0.5  # below even the 4-way sharded static bytes
    with pytest.raises(ValueError, match=r"no \(dp, shard, tp\) of world_size=8 with n_ranks=2 fits") as info:
        _auto(limit, shard="auto")
    text = str(info.value)
    for d, s in ((4, 1), (2, 2), (1, 4)):
        assert f"dp={d}, shard={s}, tp=1: memory_limit" in text
    assert math.isfinite(limit)


def test_each_rank_of_replicas_or_shards_holds_their_scalars_in_its_peak_and_its_rows() -> None:
    """A rank of dp x shard > 1 holds the replicas' row count and share (REPLICA_BYTES) beside its
    stages: in the walked peak, and in the solver's rows (split over its v stages), so a plan at its
    limit still fits what the run holds."""
    from partitioner._planning import memory_rows
    from pipeline.schedules.schedule import schedule

    prof = synthetic(8, embedding=False)
    sched = schedule("interleaved-1f1b", 2, 4, n_virtual=2)
    _, alone = memory_rows(prof, sched, "never", Composition())
    for dp, shard in ((2, 1), (1, 2), (2, 2)):
        beside = plan_for(
            prof, [2, 2, 2, 2], schedule="interleaved-1f1b", n_microbatches=4, dp=dp, shard=shard
        )
        shard_only = plan_for(prof, [2, 2, 2, 2], schedule="interleaved-1f1b", n_microbatches=4, shard=shard)
        if shard == 1:
            plain = plan_for(prof, [2, 2, 2, 2], schedule="interleaved-1f1b", n_microbatches=4)
            assert [b - a for a, b in zip(plain.rank_peaks, beside.rank_peaks, strict=True)] == [
                REPLICA_BYTES
            ] * 2
        else:  # the scalars once, however many of dp and shard
            assert beside.rank_peaks == shard_only.rank_peaks
        _, offsets = memory_rows(prof, sched, "never", Composition(shard=shard, dp=dp))
        for r in range(2):
            more = sum(offsets[s] - alone[s] for s in sched.stages_of(r))
            assert more == pytest.approx(REPLICA_BYTES)
    # at the smallest limit the search names, the plan's walk (its scalars too) fits: the rows,
    # offsets included, bound what the run holds (else the partitioner raises its own bug)
    options = dict(profile=prof, schedule="interleaved-1f1b", n_microbatches=4, dp=2)
    with pytest.raises(ValueError, match="the smallest limit that fits is") as refused:
        partition(_model(8), 2, None, memory_limit=640_000.0, **options)  # the static floor
    smallest = float(str(refused.value).split("the smallest limit that fits is ")[1].split(";")[0])
    plan = partition(_model(8), 2, None, memory_limit=smallest, **options)
    assert max(plan.rank_peaks) <= smallest
