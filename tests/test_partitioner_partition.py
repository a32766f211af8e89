"""``partitioner.partition`` and ``plan_for`` on real small models: the count means ranks, the plan
carries the options, cost modes, the memory model, recomputation, bad input.

# p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, n: layers
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

from partitioner import (
    LayerProfile,
    Plan,
    Profile,
    layer_costs,
    layer_graph,
    partition,
    plan_for,
    predict,
    profile,
    solve,
)
from partitioner.memory import coefficients
from pipeline.plan import REPLICA_BYTES, DeviceMemory
from pipeline.reference.models import gpt, gpt_loss, mlp
from pipeline.schedules.schedule import schedule
from pipeline.schedules.simulate import simulate


@pytest.fixture(scope="module")
def small_gpt() -> tuple[nn.Sequential, torch.Tensor, object]:
    torch.manual_seed(0)
    model, sample = gpt(vocab_size=64, width=32, n_layers=4, n_heads=2, max_seq_len=16, batch_size=2)
    return model, sample, profile(model, sample, warmup=1, repeat=2)  # 7 layers


def test_cost_modes(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, sample, prof = small_gpt
    uni = partition(model, 3, sample, cost="uniform", profile=prof)
    assert uni.balance == [3, 3, 1] and uni.bottleneck == 3.0  # ties: earlier stages take more
    params = partition(model, 2, sample, cost="params", profile=prof)
    assert params.balance == solve([float(lp.param_bytes) for lp in prof.layers], 2)
    flops = partition(model, 2, sample, cost="flops", profile=prof)
    assert flops.balance == solve([float(lp.flops) for lp in prof.layers], 2)
    t = partition(model, 2, sample, cost="time", profile=prof)
    assert t.balance == solve([lp.forward_time + lp.backward_time for lp in prof.layers], 2)
    assert t.bottleneck == max(s.cost for s in t.stages)
    assert t.stages[0].sent_bytes == prof.layers[t.balance[0] - 1].activation_bytes
    assert t.prediction == "simulator" and t.step_time > 0 and t.cost == "time"


def test_count_means_ranks_for_interleaved(small_gpt) -> None:  # type: ignore[no-untyped-def]
    # The old meaning made this a one-rank plan with bubble 0: now 2 ranks x 2 stages, m = 2.
    model, sample, prof = small_gpt
    plan = partition(model, 2, sample, schedule="interleaved-1f1b", profile=prof)
    assert isinstance(plan, Plan)
    assert (plan.n_ranks, plan.n_virtual, plan.n_stages, plan.n_microbatches) == (2, 2, 4, 2)
    times = [lp.forward_time + lp.backward_time for lp in prof.layers]
    assert plan.balance == solve(times, 4) and len(plan.stages) == 4
    assert plan.bubble > 0
    sched = schedule("interleaved-1f1b", 2, 2, n_virtual=2)
    fwd, bwd = [st.forward_time for st in plan.stages], [st.backward_time for st in plan.stages]
    weight = [st.weight_time for st in plan.stages]
    assert (plan.step_time, plan.bubble) == predict(sched, fwd, bwd, weight)
    three = partition(
        model, 2, sample, schedule="interleaved-1f1b", n_virtual=3, n_microbatches=4, profile=prof
    )
    assert (three.n_ranks, three.n_virtual, three.n_stages, three.n_microbatches) == (2, 3, 6, 4)


def test_zb_v_plans_stages_in_a_v(small_gpt) -> None:  # type: ignore[no-untyped-def]
    # 2 ranks x 2 stages in a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (the turn)
    model, sample, prof = small_gpt
    plan = partition(model, 2, sample, schedule="zb-v", profile=prof)
    assert (plan.n_ranks, plan.n_virtual, plan.n_stages, plan.n_microbatches) == (2, 2, 4, 2)
    sched = plan.build_schedule()
    assert sched.placement == "v" and [sched.stages_of(r) for r in range(2)] == [[0, 3], [1, 2]]
    busy = [plan.n_microbatches * (st.forward_time + st.backward_time) for st in plan.stages]
    assert plan.predicted_busy() == pytest.approx([busy[0] + busy[3], busy[1] + busy[2]])
    mem = [st.memory_bytes for st in plan.stages]
    for r, stages in enumerate(([0, 3], [1, 2])):  # the walked peak of a rank: its two stages
        assert plan.rank_peaks[r] <= sum(mem[s] for s in stages)
    # a rank's memory limit binds its own two stages: stages 0 and 3 share rank 0's row
    limit = 2 * max(mem[0], mem[3])
    tight = partition(model, 2, sample, schedule="zb-v", profile=prof, memory_limit=[limit, 1e18])
    assert max(tight.stages[0].memory_bytes, tight.stages[3].memory_bytes) <= limit / 2
    assert tight.rank_peaks[0] <= limit
    # one link, taken both ways (ranks 0 and 1); the turn (stage 1 -> 2, on rank 1) costs nothing
    slow = partition(model, 2, sample, schedule="zb-v", profile=prof, latency=[1.0])
    assert all(1.0 <= st.forward_time < 2.0 for st in slow.stages)
    refused = (
        r"latency has 2 entries but 2 ranks with n_virtual=2 \(placement 'v'\) have 1 links \(link r: ranks"
    )
    with pytest.raises(ValueError, match=refused + r" r and r \+ 1, either way\)"):
        partition(model, 2, sample, schedule="zb-v", profile=prof, latency=[0.0, 1.0])


@pytest.mark.parametrize(
    ("name", "kw", "shape"),
    [
        ("1f1b", {}, (3, 1, 3)),  # (p, v, m): m defaults to p
        ("gpipe", {"n_microbatches": 5}, (3, 1, 5)),
        ("zb-h1", {"recompute": "always"}, (3, 1, 3)),
        ("interleaved-1f1b", {"n_microbatches": 6, "recompute": "except_last"}, (3, 2, 6)),
    ],
)
def test_plan_records_the_options(small_gpt, name: str, kw: dict, shape: tuple[int, int, int]) -> None:  # type: ignore[no-untyped-def, type-arg]
    model, sample, prof = small_gpt
    plan = partition(model, 3, sample, schedule=name, profile=prof, **kw)
    assert plan.schedule == name and (plan.n_ranks, plan.n_virtual, plan.n_microbatches) == shape
    assert plan.recompute == kw.get("recompute", "never")
    assert Plan.from_json(plan.to_json()) == plan
    same = plan_for(prof, plan.balance, schedule=name, **kw)
    assert same == plan  # the plan of a balance is the same whoever made it
    assert plan.dp == 1  # one pipeline unless dp says otherwise


def test_dp_is_recorded_and_the_split_is_one_pipeline_s(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, sample, prof = small_gpt
    one = partition(model, 2, sample, profile=prof)
    two = partition(model, 2, sample, profile=prof, dp=2)
    assert two.dp == 2 and two.world_size == 4
    # the same balance and predictions (each replica is one pipeline), and each rank also holds the
    # replicas' scalars (pipeline.plan.REPLICA_BYTES: their row count and its share of the batch), in
    # its walked peak and in its stages' rows (one stage per rank here)
    peaks = [peak + REPLICA_BYTES for peak in one.rank_peaks]
    stages = [dataclasses.replace(st, memory_bytes=st.memory_bytes + REPLICA_BYTES) for st in one.stages]
    assert two == one.replace(dp=2, rank_peaks=peaks, stages=stages)
    assert plan_for(prof, one.balance, dp=2) == two
    bad_sample = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 2)), 2, torch.randn(2, 4)  # fails profiling
    with pytest.raises(ValueError, match=r"dp \(0\) must be an integer >= 1"):
        partition(*bad_sample, dp=0)  # checked before the model is profiled


def test_memory_model_and_limit(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, sample, prof = small_gpt
    plan = partition(model, 2, sample, schedule="gpipe", n_microbatches=4, cost="uniform", profile=prof)
    # gpipe holds all 4 micro-batches' sets on both stages, 1f1b 2 then 1 (the walk with unit bytes)
    assert [c["saved"] for c in coefficients(schedule("gpipe", 2, 4), "never")] == [4, 4]
    assert [c["saved"] for c in coefficients(schedule("1f1b", 2, 4), "never")] == [2, 1]
    one = partition(model, 2, sample, schedule="1f1b", n_microbatches=4, cost="uniform", profile=prof)
    for p in (plan, one):  # v = 1: a stage's bound is >= its rank's walked peak (what a run holds)
        for st, walked in zip(p.stages, p.rank_peaks, strict=True):
            assert walked <= st.memory_bytes
    assert one.rank_peaks[1] < plan.rank_peaks[1]  # 1 set held, not 4
    # The smallest feasible limit, by brute force over the 6 two-stage splits, is what the error states;
    # at that limit the plan fits exactly, and it moves the boundary when time alone wanted another.
    opts = {"schedule": "gpipe", "n_microbatches": 4}
    free = partition(model, 2, sample, profile=prof, **opts)
    peaks = {b: max(s.memory_bytes for s in plan_for(prof, [b, 7 - b], **opts).stages) for b in range(1, 7)}
    smallest = min(peaks.values())
    with pytest.raises(ValueError, match=f"smallest limit that fits is {smallest!r}"):
        partition(model, 2, sample, profile=prof, memory_limit=smallest - 1, **opts)
    ok = partition(model, 2, sample, profile=prof, memory_limit=smallest, **opts)
    assert peaks[ok.balance[0]] == smallest
    assert max(ok.rank_peaks) <= smallest
    if peaks[free.balance[0]] > smallest:
        assert ok.balance != free.balance


def test_recompute_costs_a_forward_and_keeps_inputs(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, sample, prof = small_gpt
    opts = {"schedule": "1f1b", "n_microbatches": 4}
    never = plan_for(prof, [3, 4], **opts)
    always = plan_for(prof, [3, 4], recompute="always", **opts)
    last = plan_for(prof, [3, 4], recompute="except_last", **opts)
    for s, (a, b, c) in enumerate(zip(never.stages, always.stages, last.stages, strict=True)):
        lps = prof.layers[a.start : a.stop]
        fwd = math.fsum(lp.forward_time for lp in lps)
        assert b.forward_time == a.forward_time
        assert b.backward_time == pytest.approx(a.backward_time + fwd)
        assert c.backward_time == pytest.approx(a.backward_time + 0.75 * fwd)  # 3 of 4 recompute
        for p in (never, always, last):  # each stage's bound covers its rank's walk
            assert p.rank_peaks[s] <= p.stages[s].memory_bytes
    # stage 0 holds 2 micro-batches: recomputing keeps 1 set (the replay) instead of 2
    assert always.rank_peaks[0] < never.rank_peaks[0]
    assert last.rank_peaks[0] == never.rank_peaks[0]  # its 2nd is the last one
    assert always.step_time > never.step_time
    costs = layer_costs(prof, "time", recompute="always", n_microbatches=4)
    assert costs == [lp.forward_time * 2 + lp.backward_time for lp in prof.layers]
    plan = partition(model, 2, sample, recompute="always", profile=prof, **opts)
    assert plan.balance == solve(costs, 2)


def test_recompute_memory_limit_is_kept(small_gpt) -> None:  # type: ignore[no-untyped-def]
    # With recomputation each stage keeps its inputs; the split must still fit the limit.
    model, sample, prof = small_gpt
    opts = {"schedule": "gpipe", "n_microbatches": 4, "recompute": "always", "cost": "uniform"}
    peaks = {b: max(s.memory_bytes for s in plan_for(prof, [b, 7 - b], **opts).stages) for b in range(1, 7)}
    limit = sorted(peaks.values())[len(peaks) // 2] * 1.5
    plan = partition(model, 2, sample, profile=prof, memory_limit=limit, **opts)
    assert max(st.memory_bytes for st in plan.stages) <= limit
    assert max(plan.rank_peaks) <= limit
    info = _refused_at_the_floor(lambda x: partition(model, 2, sample, profile=prof, memory_limit=x, **opts))
    assert re.search(r"recompute='always', where a stage keeps up to .* bytes of inputs", str(info.value))


def _refused_at_the_floor(call: Callable[[float], object]) -> pytest.ExceptionInfo[ValueError]:
    """The refusal that names the exact smallest limit: a limit below the static bytes alone is
    refused first, naming their floor (no schedule built: partitioner._floors); asked at that floor,
    partition names the smallest limit that fits, activations included."""
    with pytest.raises(
        ValueError, match="fits even the weights, gradients, optimizer state and buff"
    ) as info:
        call(1.0)
    floor = float(str(info.value).split("a limit of at least ")[1].split(" ")[0])
    with pytest.raises(ValueError, match="the smallest limit that fits is") as exact:
        call(floor)
    assert _least_of(exact) > floor  # activations on top of the static bytes
    return exact


def _least_of(
    error: pytest.ExceptionInfo[ValueError], what: str = "the smallest limit that fits is "
) -> float:
    return float(str(error.value).split(what)[1].split(" ")[0].rstrip(";("))


def test_a_limit_keeps_the_devices_reserve(small_gpt) -> None:  # type: ignore[no-untyped-def]
    """What the device holds beyond the walk (one H200's workspaces, faked here: the CPU's are 0),
    its allocator's rounding and the headroom come off each rank's limit: a limit that holds the
    weights and activations but not them beside is refused, naming them and the fixes; the
    smallest limit is the CPU's grown by exactly the reserve; the plan carries it."""
    model, sample, prof = small_gpt
    assert prof.device_memory == DeviceMemory()  # profiled on CPU: nothing beyond the tensors
    opts = {"schedule": "gpipe", "n_microbatches": 4}
    device = DeviceMemory(
        device="cuda:0", workspace_bytes=64 * 2**20, block_bytes=512, rounding=0.01, headroom=0.1
    )
    gpu = dataclasses.replace(prof, device_memory=device)
    info = _refused_at_the_floor(lambda x: partition(model, 2, sample, profile=prof, memory_limit=x, **opts))
    least = _least_of(info)  # the weights, gradients, optimizer state and activations: the CPU's
    cpu = partition(model, 2, sample, profile=prof, memory_limit=least * 1.01, **opts)
    assert cpu.device_memory == DeviceMemory() and cpu.rank_needs == cpu.rank_peaks
    assert cpu == partition(
        model, 2, sample, profile=prof, memory_limit=least * 1.01, memory_headroom=0.0, **opts
    )
    kept = (r"each rank's limit keeps 64.00 MiB for the matrix products' workspaces on cuda:0 "
            r"\(torch.backends.cuda.cublas_workspace_size, CUBLAS_WORKSPACE_CONFIG\), 1.00% of the "
            r"counted bytes for the allocator's rounding to 512 B, and 10% of itself free "
            r"\(memory_headroom=\)")  # fmt: skip
    # below the static bytes beside the 64 MiB kept, the floor comes first, naming what is kept
    with pytest.raises(
        ValueError, match=rf"a limit of at least [0-9.e+]+ bytes per rank \({kept}\)"
    ) as first:
        partition(model, 2, sample, profile=gpu, memory_limit=least * 1.01, **opts)
    floor = float(str(first.value).split("a limit of at least ")[1].split(" ")[0])
    with pytest.raises(ValueError, match=rf"is too small: no split into 2 stages fits it; the smallest limit "
                       rf"that fits is [0-9.e+]+ \({kept}\); raise memory_limit or lower memory_headroom or "
                       r"the workspaces, or use more ranks") as info:  # fmt: skip
        partition(model, 2, sample, profile=gpu, memory_limit=floor, **opts)
    reserved = _least_of(info)
    assert reserved == pytest.approx(device.limit_for(least), rel=1e-12)
    plan = partition(model, 2, sample, profile=gpu, memory_limit=reserved, **opts)
    assert plan.device_memory == device and plan.memory_limit == [reserved] * 2
    assert plan.rank_needs == [device.need(x) for x in plan.rank_peaks]
    assert max(plan.rank_needs) <= reserved * (1 - device.headroom) * (1 + 1e-12)
    with pytest.raises(ValueError, match="the smallest limit that fits is"):
        partition(model, 2, sample, profile=gpu, memory_limit=math.nextafter(reserved, 0.0), **opts)
    with pytest.raises(ValueError, match=r"limits must grow by a factor of at least [0-9.e+]+ \(each rank's"):
        partition(model, 2, sample, profile=gpu, memory_limit=[least * 1.01] * 2, **opts)
    # the headroom is the caller's to set, and each plan records what it kept
    none = partition(model, 2, sample, profile=gpu, memory_limit=reserved * 0.9, memory_headroom=0.0, **opts)
    assert none.device_memory == dataclasses.replace(device, headroom=0.0)
    free = plan_for(gpu, plan.balance, **opts)
    assert free.device_memory == device and free.rank_peaks == plan.rank_peaks  # the walk is the CPU's
    with pytest.raises(ValueError, match=r"memory_headroom \(1.0\) must be a fraction in \[0, 1\)"):
        partition(model, 2, sample, profile=gpu, memory_limit=reserved, memory_headroom=1.0, **opts)
    # two stages per rank: the reserve is the rank's, kept once whatever its stages
    inter = {"schedule": "interleaved-1f1b", "n_microbatches": 4}
    info = _refused_at_the_floor(lambda x: partition(model, 2, sample, profile=prof, memory_limit=x, **inter))
    least = _least_of(info)
    info = _refused_at_the_floor(lambda x: partition(model, 2, sample, profile=gpu, memory_limit=x, **inter))
    assert _least_of(info) == pytest.approx(device.limit_for(least), rel=1e-12)


def _synthetic(n: int, f: float, b: float, w: float) -> Profile:
    """A profile with known figures: every layer takes f forward, b backward of which w is W
    (and b - w the input gradient, timed apart as the split backward runs it)."""
    layers = [
        LayerProfile(
            layer, str(layer), "Linear", f, b, 10, 4, 8, 8, (1,), "float32", weight_time=w, input_time=b - w
        )
        for layer in range(n)
    ]
    return Profile(layers, "cpu", layer_graph(layers), input_bytes=8)


def test_weight_time_feeds_the_zb_h1_prediction() -> None:
    prof = _synthetic(4, 1.0, 2.0, 1.0)
    plan = plan_for(prof, [2, 2], schedule="zb-h1", n_microbatches=4)
    assert [(st.forward_time, st.backward_time, st.weight_time) for st in plan.stages] == [
        (2.0, 4.0, 2.0)
    ] * 2
    sched = schedule("zb-h1", 2, 4)
    assert (plan.step_time, plan.bubble) == predict(sched, [2.0] * 2, [4.0] * 2, [2.0] * 2)
    # m (f + b + w) + (p - 1)(f + b - w) with f = 2, input gradient b = 2, w = 2: W fills the bubble
    assert plan.step_time == 4 * 6.0 + 1 * 2.0
    assert plan.step_time < predict(sched, [2.0] * 2, [4.0] * 2)[0] == (4 + 1) * 6.0


def test_measured_weight_time_reaches_the_plan(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, sample, prof = small_gpt
    plan = partition(model, 2, sample, schedule="zb-h1", n_microbatches=4, profile=prof)
    for st in plan.stages:
        assert st.weight_time == math.fsum(lp.weight_time for lp in prof.layers[st.start : st.stop])
        assert 0.0 <= st.weight_time <= st.backward_time


def test_links_cost_both_ends_of_each_cut(small_gpt) -> None:  # type: ignore[no-untyped-def]
    # Link 0 (rank 0 -> 1) has little bandwidth, link 1 (rank 1 -> 2) a long latency. Each cut
    # costs both of its stages 2 x (latency + bytes / bandwidth) of its own link.
    model, sample, prof = small_gpt
    lat, bw = [1e-4, 2e-3], [1e6, 5e7]
    plan = partition(model, 3, sample, profile=prof, latency=lat, bandwidth=bw)
    times = [lp.forward_time + lp.backward_time for lp in prof.layers]
    rows = [[2.0 * (lat[r] + lp.activation_bytes / bw[r]) for lp in prof.layers] for r in range(2)]
    assert plan.balance == solve(times, 3, cut_costs=rows)
    one_way = [lat[r] + plan.stages[r].sent_bytes / bw[r] for r in range(2)]
    links = [one_way[0], one_way[0] + one_way[1], one_way[1]]  # what each stage sends and receives
    for st, link in zip(plan.stages, links, strict=True):
        lps = prof.layers[st.start : st.stop]
        assert st.forward_time == pytest.approx(sum(lp.forward_time for lp in lps) + link)
        assert st.backward_time == pytest.approx(sum(lp.backward_time for lp in lps) + link)
        assert st.cost == pytest.approx(sum(times[st.start : st.stop]) + 2 * link)
    # interleaved: the boundary between chunks, stage 1 (rank 1) -> stage 2 (rank 0), is link 1
    inter = partition(model, 2, sample, schedule="interleaved-1f1b", profile=prof, latency=[0.0, 1.0])
    assert [st.forward_time >= 1.0 for st in inter.stages] == [False, True, True, False]
    with pytest.raises(ValueError, match="latency has 1 entries but 2 ranks with n_virtual=2 have 2 links"):
        partition(model, 2, sample, schedule="interleaved-1f1b", profile=prof, latency=[0.0])


def test_speeds_and_memory_limits_per_rank(small_gpt) -> None:  # type: ignore[no-untyped-def]
    model, sample, prof = small_gpt
    times = [lp.forward_time + lp.backward_time for lp in prof.layers]
    fast = partition(model, 2, sample, profile=prof, speeds=[4.0, 1.0])
    assert fast.balance == solve(times, 2, speeds=[4.0, 1.0])
    first = prof.layers[: fast.balance[0]]
    assert fast.stages[0].forward_time == pytest.approx(sum(lp.forward_time for lp in first) / 4.0)
    opts = {"schedule": "gpipe", "n_microbatches": 4, "cost": "uniform"}
    peaks = {b: [s.memory_bytes for s in plan_for(prof, [b, 7 - b], **opts).stages] for b in range(1, 7)}
    # rank 0 gets exactly what [2, 5] needs, rank 1 plenty: [2, 5] is the only balance that fits
    limits = [peaks[2][0], max(max(p) for p in peaks.values())]
    fitting = [b for b, (m0, m1) in peaks.items() if m0 <= limits[0] and m1 <= limits[1]]
    plan = partition(model, 2, sample, profile=prof, memory_limit=limits, **opts)
    assert plan.balance[0] in fitting and plan.balance[0] == max(fitting)
    assert all(st.memory_bytes <= lim for st, lim in zip(plan.stages, limits, strict=True))
    smallest = min(max(m0 / limits[0], m1 / limits[1]) for m0, m1 in peaks.values())
    with pytest.raises(ValueError, match="limits must grow by a factor of at least"):
        partition(model, 2, sample, profile=prof, memory_limit=[x * 0.5 * smallest for x in limits], **opts)


def test_profiles_when_not_given_and_split_runs() -> None:
    model, sample = mlp(width=16, depth=4, batch_size=4)
    plan = partition(model, 2, sample)
    parts = plan.split(model)
    assert torch.equal(parts[1](parts[0](sample)), model(sample))
    assert dataclasses.asdict(plan)["balance"] == plan.balance


@pytest.mark.parametrize(
    ("p", "kw", "match"),
    [
        (0, {}, r"n_ranks \(0\) must be an integer >= 1"),
        (True, {}, r"n_ranks \(True\) must be an integer >= 1"),
        (8, {}, r"n_ranks \(8\) x n_virtual \(1\) is 8 stages but the model has 7 layers.*at most 7 ranks"),
        (
            4,
            {"schedule": "interleaved-1f1b"},
            r"n_ranks \(4\) x n_virtual \(2\) is 8 stages but the model has 7 layers.*"
            r"at most 3 ranks or fewer stages per rank \(n_virtual\)",
        ),
        (2, {"cost": "joules"}, "unknown cost 'joules'"),
        (2, {"schedule": "nope"}, "unknown schedule 'nope'"),
        (2, {"bandwidth": 0.0}, r"bandwidth\[0\] is 0.0; each must be a finite number of bytes per second"),
        (2, {"bandwidth": [1e9, 1e9]}, r"bandwidth has 2 entries but 2 ranks with n_virtual=1 have 1 links"),
        (2, {"latency": -1.0}, r"latency\[0\] is -1.0; each must be a finite number of seconds per message"),
        (2, {"latency": 1e-5, "cost": "params"}, "latency turns bytes into seconds and needs cost='time'"),
        (2, {"speeds": [1.0]}, r"speeds has 1 entries for 2 ranks; pass one per rank"),
        (2, {"speeds": [1.0, 0.0]}, r"speeds\[1\] \(0.0\) must be a number > 0"),
        (2, {"memory_limit": [1e9, -1.0]}, r"memory_limit\[1\] \(-1.0\) must be a number >= 0"),
        (2, {"autocast": torch.float64}, r"autocast \(torch.float64\) must be torch.bfloat16"),
        (2, {"autocast": torch.bfloat16}, "autocast=bfloat16 but the profile ran under fp32"),
        (2, {"loss_fn": lambda out, y: out.sum()}, "loss_fn is given but the profile has no loss figures"),
        (2, {"bandwidth": 1e9, "cost": "flops"}, "needs cost='time'"),
        (2, {"memory_limit": -1.0}, r"memory_limit \(-1.0\) must be a number >= 0"),
        (2, {"optimizer_state_factor": -1.0}, r"optimizer_state_factor \(-1.0\) must be >= 0"),
        (2, {"recompute": "sometimes"}, "'sometimes'"),
        (2, {"n_virtual": 2}, r"n_virtual \(2\) must be 1 for '1f1b'"),
        (2, {"n_microbatches": 0}, r"n_microbatches \(0\) must be an integer >= 1"),
        (2, {"schedule": "interleaved-1f1b", "n_microbatches": 3}, r"multiple of the number of ranks \(2\)"),
    ],
)
def test_bad_input(small_gpt, p: int, kw: dict, match: str) -> None:  # type: ignore[no-untyped-def, type-arg]
    model, sample, prof = small_gpt
    with pytest.raises(ValueError, match=match):
        partition(model, p, sample, profile=prof, **kw)


def test_bad_input_before_profiling() -> None:
    with pytest.raises(ValueError, match="empty"):
        partition(nn.Sequential(), 1, torch.randn(1))
    with pytest.raises(ValueError, match=r"must be an nn\.Module .*got function"):
        partition(lambda x: x, 1, torch.randn(1, 2))  # type: ignore[arg-type]
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 2))  # rejects the sample at layer 1
    with pytest.raises(ValueError, match=r"layer 1 .* shape \(2, 4\)"):
        partition(model, 2, torch.randn(2, 4))
    for kw in ({"schedule": "nope"}, {"recompute": "sometimes"}, {"cost": "joules"}):  # checked first
        with pytest.raises(ValueError, match=r"unknown|'sometimes'"):
            partition(model, 2, torch.randn(2, 4), **kw)  # type: ignore[arg-type]
    prof = profile(
        *gpt(vocab_size=8, width=8, n_layers=4, n_heads=2, max_seq_len=4, batch_size=1), warmup=0, repeat=1
    )
    with pytest.raises(ValueError, match="profile has 7 layers but the model has 2"):
        partition(model, 2, torch.randn(2, 4), profile=prof)


def test_plan_for_defaults_and_errors(small_gpt) -> None:  # type: ignore[no-untyped-def]
    _, _, prof = small_gpt
    plan = plan_for(prof, [3, 4])
    assert (plan.schedule, plan.n_ranks, plan.n_microbatches, plan.n_virtual) == ("1f1b", 2, 2, 1)
    inter = plan_for(prof, [2, 2, 2, 1], schedule="interleaved-1f1b")
    assert (inter.n_ranks, inter.n_virtual, inter.n_microbatches) == (2, 2, 2)
    cases = [
        ({"balance": [3, 3]}, "balance \\[3, 3\\] covers 6 layers but the profile has 7"),
        ({"balance": [3, 4], "n_microbatches": 0}, r"n_microbatches \(0\) must be an integer >= 1"),
        (
            {"balance": [2, 2, 3], "schedule": "interleaved-1f1b"},
            r"3 stages, not a multiple of n_virtual \(2\)",
        ),
        (
            {"balance": [2, 2, 2, 1], "schedule": "interleaved-1f1b", "n_virtual": 0},
            r"n_virtual \(0\) must be",
        ),
        ({"balance": [3, 4], "cost": "joules"}, "unknown cost 'joules'"),
        ({"balance": [3, 4], "recompute": "sometimes"}, "'sometimes'"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            plan_for(prof, **kw)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="balance must be a list of layer counts"):
        plan_for(prof, "3,4")


def test_the_loss_runs_on_the_last_stage() -> None:
    torch.manual_seed(0)
    model, sample = gpt(vocab_size=64, width=16, n_layers=2, n_heads=2, max_seq_len=8, batch_size=2)
    target = torch.randint(0, 64, (2, 8))
    prof = profile(model, sample, loss_fn=gpt_loss, target=target, warmup=0, repeat=1)
    loss = prof.loss
    assert loss is not None
    bare = dataclasses.replace(prof, loss=None)
    opts = {"schedule": "gpipe", "n_microbatches": 2}
    with_loss, without = plan_for(prof, [2, 3], **opts), plan_for(bare, [2, 3], **opts)
    assert with_loss.stages[0] == without.stages[0]
    last, plain = with_loss.stages[1], without.stages[1]
    assert last.forward_time == pytest.approx(plain.forward_time + loss.forward_time)
    assert last.backward_time == pytest.approx(plain.backward_time + loss.backward_time)
    # each graph keeps the loss's saved tensors and the loss itself (its root); a copy of each loss is
    # kept to the step's end; both graphs (m = 2) held at once under gpipe
    assert last.held.saved == plain.held.saved + loss.saved_bytes + loss.activation_bytes
    assert last.held.kept == loss.activation_bytes and plain.held.kept == 0
    assert last.memory_bytes >= plain.memory_bytes + 2 * (loss.saved_bytes + loss.activation_bytes)
    assert with_loss.loss_profiled and not without.loss_profiled
    plan = partition(model, 2, sample, loss_fn=gpt_loss, target=target, profile=prof)
    assert plan.loss_profiled
    costs = layer_costs(prof, "time")
    head = prof.layers[-1]
    whole = head.forward_time + head.backward_time + loss.forward_time + loss.backward_time
    assert costs[-1] == pytest.approx(whole)


def test_zb_h1_predicts_the_simulator_on_measured_costs(small_gpt) -> None:  # type: ignore[no-untyped-def]
    # zb-h1 runs the split backward: B = the input gradients, W = the weight gradients, each
    # measured as it runs; the plan's step is the simulator's on exactly those.
    _, _, prof = small_gpt
    plan = plan_for(prof, [3, 2, 2], schedule="zb-h1", n_microbatches=6)
    f, b, w = [], [], []
    for st in plan.stages:
        lps = prof.layers[st.start : st.stop]
        f.append(math.fsum(lp.forward_time for lp in lps))
        w.append(math.fsum(lp.weight_time for lp in lps))
        b.append(math.fsum(lp.input_time + lp.weight_time for lp in lps) - w[-1])
        assert st.weight_time == pytest.approx(w[-1]) and st.backward_time == pytest.approx(b[-1] + w[-1])
    line = simulate(schedule("zb-h1", 3, 6), f, b, w)
    assert plan.step_time == pytest.approx(line.makespan)
    assert all(x > 0 for x in w)  # every stage holds parameters


def test_infeasible_limit_raises_fast_on_1000_layers_64_ranks() -> None:
    n, p = 1000, 64
    layers = [
        LayerProfile(i, str(i), "Linear", 1e-3, 2e-3, 10, 4096 + i, 8192, 1024 * (1 + i % 7), (1,), "float32")
        for i in range(n)
    ]
    prof = Profile(layers, "cpu", layer_graph(layers), input_bytes=8192)
    model = nn.Sequential(*[nn.Identity() for _ in range(n)])
    free = partition(model, p, None, profile=prof, bandwidth=1e9)
    peak = max(st.memory_bytes for st in free.stages)
    best = math.inf
    for _ in range(3):  # the best of three, in CPU time: other processes' load is not the algorithm's
        start = time.process_time()
        with pytest.raises(ValueError, match="the smallest limit that fits is") as info:
            partition(model, p, None, profile=prof, bandwidth=1e9, memory_limit=peak / 8)
        best = min(best, time.process_time() - start)
    assert best < 0.1, f"{best * 1e3:.1f} ms"
    smallest = float(str(info.value).split("the smallest limit that fits is ")[1].split(";")[0])
    fits = partition(model, p, None, profile=prof, bandwidth=1e9, memory_limit=smallest)
    assert max(st.memory_bytes for st in fits.stages) <= smallest
    with pytest.raises(ValueError, match="too small"):
        partition(model, p, None, profile=prof, bandwidth=1e9, memory_limit=math.nextafter(smallest, 0))


@pytest.mark.parametrize("schedule_name", ["zb-h1", "1f1b", "gpipe"])
def test_plans_at_the_smallest_limit_fit_the_walk(schedule_name: str) -> None:
    # large activations, small saved graphs: zb-h1's output gradients (kept from B to W) and the
    # transfer buffers dominate; at the smallest limit the error names, every rank's walked peak fits
    # (partition raises a RuntimeError rather than return a plan the walk does not fit)
    layers = [
        LayerProfile(
            i,
            str(i),
            "Linear",
            1e-3,
            2e-3,
            10,
            1024 * (1 + i % 3),
            65536 * (1 + i % 4),
            4096,
            (1,),
            "float32",
            weight_time=1e-3,
            input_time=1e-3,
        )
        for i in range(12)
    ]
    prof = Profile(layers, "cpu", layer_graph(layers), input_bytes=8192)
    model = nn.Sequential(*[nn.Identity() for _ in range(12)])
    opts = {"profile": prof, "schedule": schedule_name, "n_microbatches": 6}
    info = _refused_at_the_floor(lambda x: partition(model, 3, None, memory_limit=x, **opts))  # type: ignore[arg-type]
    smallest = float(str(info.value).split("the smallest limit that fits is ")[1].split(";")[0])
    plan = partition(model, 3, None, memory_limit=smallest, **opts)  # type: ignore[arg-type]
    assert max(plan.rank_peaks) <= smallest
