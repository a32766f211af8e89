"""dualpipe-v, v-half and v-min: torch's DualPipeV order, the controllable-memory V's memory and bubble,
the auto search choosing them under a tight limit, and a weight tied across the V on one rank.

# p: ranks, m: micro-batches; a "unit" is one action at F = B = W = 1 (a V stage is half of a
# 1F1B stage, so 1F1B at equal work costs 2 per action and holds 2 units per micro-batch)
"""

from __future__ import annotations

import functools
import re
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from partitioner import partition, profile
from partitioner.auto import rank_peaks, search
from partitioner.figures import LayerProfile, Profile
from partitioner.graph import layer_graph
from partitioner.memory import StageBytes
from partitioner.memory import rank_peaks as walked_peaks
from partitioner.overhead import RuntimeCosts
from pipeline.plan import Plan
from pipeline.reference.graph_models import gpt_tied
from pipeline.reference.models import gpt_loss
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules import generators
from pipeline.schedules.program import Collective
from pipeline.schedules.schedule import schedule
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import Timeline
from tests.dist import job
from tests.pipe_common import assert_close

NEW = ("dualpipe-v", "v-half", "v-min")
V_SCHEDULES = ("zb-v", *NEW)


@functools.cache
def _unit(name: str, p: int, m: int) -> Timeline:
    """The validated schedule simulated at F = B = W = 1 (1F1B at equal work: 2 per action)."""
    if name == "1f1b":
        return simulate(schedule(name, p, m), 2, 2, 2)
    return simulate(schedule(name, p, m), 1, 1, 1)


@pytest.mark.parametrize("name", NEW)
def test_builds_and_validates_for_any_m(name: str) -> None:
    for p, m in [(2, 1), (2, 3), (2, 4), (4, 5), (4, 8), (8, 16)]:  # m < 2p too (dualpipe-v: its docstring)
        sched = schedule(name, p, m)  # validated
        assert (sched.placement, sched.n_virtual, sched.split_backward) == ("v", 2, True)
        assert [sched.stages_of(r) for r in range(p)] == [[r, 2 * p - 1 - r] for r in range(p)]


@pytest.mark.parametrize("name", NEW)
def test_two_stages_per_rank_only(name: str) -> None:
    with pytest.raises(ValueError, match=rf"n_virtual \(3\) must be at most 2 for '{name}'"):
        schedule(name, 2, 4, n_virtual=3)
    with pytest.raises(ValueError, match=rf"{name} places exactly 2 stages per rank, got n_virtual=1; pass"):
        getattr(generators, name.replace("-", "_"))(2, 1, 4)


def _torch_dualpipe_v(p: int, m: int) -> list[list[str]]:
    """torch's ScheduleDualPipeV order, its overlapped pairs and unsplit backwards spelt as ours."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    out = []
    spelt = {"F": "{s}F{i}", "I": "{s}B{i}", "W": "{s}W{i}", "B": "{s}B{i} {s}W{i}"}  # B: the whole backward
    for r in range(p):
        fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
        ops: list[Any] = cast(Any, ScheduleDualPipeV)._calculate_single_rank_operations(fake, r)
        row: list[str] = []
        for op in ops:
            for a in op.sub_actions or (op,):  # an overlapped pair: its F, then its B
                s, kind, i = re.fullmatch(r"(\d+)([FIWB])(\d+)", str(a)).groups()  # type: ignore[union-attr]
                row += spelt[kind].format(s=s, i=i).split()
        out.append(row)
    return out


def test_dualpipe_v_is_torchs_order_up_to_message_order() -> None:
    """Equal to torch's where its messages come in our channels' order (p <= 2); from p = 3 on the
    same actions, some forwards run later, each stage's F's, B's and W's still in micro-batch order."""
    for p, m in [(1, 2), (1, 3), (2, 4), (2, 7)]:
        ours = [[str(a) for a in row] for row in schedule("dualpipe-v", p, m).compute]
        assert ours == _torch_dualpipe_v(p, m)
    ours = [[str(a) for a in row] for row in schedule("dualpipe-v", 4, 8).compute]
    assert ours != _torch_dualpipe_v(4, 8)
    for r, theirs in enumerate(_torch_dualpipe_v(4, 8)):
        mine = ours[r]
        assert sorted(mine) == sorted(theirs)
        for s in (r, 7 - r):
            for kind in "FBW":
                assert [a for a in mine if a.startswith(f"{s}{kind}")] == [f"{s}{kind}{i}" for i in range(8)]
    for p in (4, 8):  # moving a forward later holds no more: torch's order's 2p + 1 on every rank
        assert _unit("dualpipe-v", p, 2 * p).peak_activations == [2 * p + 1] * p
    assert " ".join(str(a) for a in schedule("dualpipe-v", 2, 4).compute[1]) == (
        "1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2 1B0 1W0 1F3 2B1 2W1 2F3 1B1 1W1 2B2 2W2 1B2 1W2 2B3 1B3 2W3 1W3"
    )  # warm-up; two F + B pairs per step; the last two B's split, their W's at the end


def test_dualpipe_v_message_order_at_scale() -> None:
    """Putting p = 32's order in message order takes well under a second (a play restarted after each
    of its ~5000 moves took ~40 s; the auto search builds p = 64): the bound is loose for a loaded
    machine. The result validates (message order included) with DualPipeV's bubble and memory."""
    p, m = 32, 64
    start = time.perf_counter()
    orders = generators._dualpipe_v.__wrapped__(p, m)  # uncached
    assert time.perf_counter() - start < 10
    sched = schedule("dualpipe-v", p, m)  # validated once (_unit would validate it again: seconds)
    assert sched.compute == orders
    timeline = simulate(sched, 1, 1, 1)  # _unit's, on the schedule just validated
    assert timeline.makespan - 6 * m == p - 1
    assert timeline.peak_activations == [2 * p + 1] * p


# 1F1B's rank 0 holds p micro-batches; the paper's V-Half (p + 2) // 2, V-Min (p + 4) // 3
HELD = {"v-half": (2, 2), "v-min": (4, 3)}  # (a, b): (p + a) // b
RATIOS = {2: (1.0, 1.0), 4: (0.75, 0.5), 8: (0.625, 0.5)}  # (v-half, v-min) against 1F1B, exactly


@pytest.mark.parametrize("p", [2, 4, 8])
def test_controllable_memory_holds_the_papers_micro_batches(p: int) -> None:
    """Every rank's peak, in V stage activations, is twice the paper's micro-batch count (a V stage
    is half a 1F1B stage), whatever m; and the partitioner's walk of the program counts the same."""
    assert max(_unit("1f1b", p, 2 * p).peak_activations) == p
    for name, (a, b) in HELD.items():
        for m in (p, 2 * p):
            assert max(_unit(name, p, m).peak_activations) == 2 * ((p + a) // b), (name, m)
    got = tuple(max(_unit(name, p, 2 * p).peak_activations) / 2 / p for name in HELD)
    assert got == RATIOS[p]
    ones = [StageBytes(saved=1.0, input=0.0, output=0.0)] * (2 * p)
    for name in NEW:
        sched = schedule(name, p, 2 * p)
        assert walked_peaks(sched, ones, "never") == _unit(name, p, 2 * p).peak_activations


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubbles_within_the_published_ones(p: int) -> None:
    """F = B = W = 1, m = 2p and 3p; the work is 6m per rank. Published: 1F1B (p - 1)(F + B + W) at
    equal work, 6(p - 1); V-Half about half of it, p / 2m of the work: 3p; V-Min 2p / 3m: 4p;
    DualPipeV (p - 1)(F&B + B - 3W) with B the whole backward, F&B = F + B (ours runs the pair one
    after the other): 2(p - 1)."""
    for m in (2 * p, 3 * p):
        bubble = {name: _unit(name, p, m).makespan - 6 * m for name in (*NEW, "1f1b")}
        assert bubble["1f1b"] == 6 * (p - 1)
        assert bubble["dualpipe-v"] == p - 1 <= 2 * (p - 1)  # rank p - 1's wait for its first input
        assert bubble["v-half"] <= 3 * p and bubble["v-half"] < bubble["1f1b"] * 0.6
        assert bubble["v-min"] <= 4 * p and bubble["v-min"] < bubble["1f1b"] * 0.7
        assert bubble["dualpipe-v"] <= bubble["v-half"] <= bubble["v-min"]
    spans = [_unit(name, 4, 8).makespan for name in ("1f1b", "dualpipe-v", "v-half", "v-min")]
    assert spans == [66, 51, 58, 59]  # the docstrings' grids


def _activation_heavy(n: int) -> Profile:
    """n equal layers at 4 rows whose saved activations dwarf their outputs and weights (a
    transformer block's do): where holding fewer micro-batches pays."""
    layers = [
        LayerProfile(i, f"l{i}", "Linear", 10e-3, 20e-3, 10, 4096, 8 * 1024, 256 * 1024, (4, 512), "float32",
                     weight_time=10e-3, input_time=10e-3)
        for i in range(n)
    ]  # fmt: skip
    return Profile(layers, "cpu", layer_graph(layers), input_bytes=8 * 1024)


def test_auto_picks_a_controllable_memory_v_where_1f1b_and_zb_v_do_not_fit() -> None:
    prof = _activation_heavy(8)
    kw: dict[str, Any] = dict(batch_size=8, sample_rows=4, n_microbatches=8, bandwidth=1e9, latency=1e-5,
                              runtime=RuntimeCosts(action=2e-4, message=1e-4))  # fmt: skip
    free = {name: search(prof, 4, memory_limit=None, schedules=[name], **kw) for name in ("1f1b", "zb-v")}
    limit = 0.95 * min(max(rank_peaks(plan)) for plan in free.values())
    plan = search(prof, 4, memory_limit=limit, **kw)
    assert plan.schedule in ("v-half", "v-min") and plan.recompute == "never"
    assert max(rank_peaks(plan)) <= limit
    rival = search(prof, 4, memory_limit=limit, schedules=["1f1b", "zb-v"], **kw)
    assert rival.recompute != "never" and rival.step_time > plan.step_time  # they fit only recomputing


# ---- a weight tied across the V: the embedding on stage 0 and the head on stage 2p - 1, both on rank 0


def _tied(plan_json: str, names: tuple[str, ...]) -> list[tuple[float, dict[str, torch.Tensor]]]:
    out = []
    for name in names:
        torch.manual_seed(0)
        model, x = gpt_tied(vocab_size=16, width=16, n_layers=4, n_heads=2, max_seq_len=8, batch_size=8)
        y = torch.randint(0, 16, x.shape)
        plan = Plan.from_json(plan_json).replace(schedule=name)
        pipe = Pipeline(model, plan, loss_fn=gpt_loss, timeout=60.0)
        loss = pipe.step(x, y)
        out.append((loss, {k: t.grad.clone() for k, t in pipe.named_parameters() if t.grad is not None}))
        pipe.close()
    return out


def _tied_plan(_: Any) -> tuple[str, tuple[str, ...]]:
    torch.manual_seed(0)
    model, x = gpt_tied(vocab_size=16, width=16, n_layers=4, n_heads=2, max_seq_len=8, batch_size=8)
    prof = profile(model, x[:2], warmup=0, repeat=1)
    # balanced by flops: the same V on any machine (the host's load must not choose the stages)
    plan = partition(model, 2, x[:2], schedule="zb-v", n_microbatches=4, profile=prof, cost="flops")
    return plan.to_json(), V_SCHEDULES


_TIED = job(2, _tied, make_args=_tied_plan, batch="c")


def test_a_weight_tied_across_the_v_on_one_rank(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every V schedule: stages 0 and 3 are both rank 0's, so the tie needs no group; the gradients
    equal one process's (the tied weight's, summed over its two uses, included)."""
    results = _TIED.results(tmp_path_factory)
    plan_json, names = _TIED.args
    plan = Plan.from_json(plan_json)
    assert plan.ties == {"tok.weight": [0, 3]}
    for name in names:
        sched = plan.replace(schedule=name).build_schedule()
        assert sched.rank_of(0) == sched.rank_of(3) == 0
        tail = sched.program(0, ties=[[0, 3]]).tail()
        assert not any(isinstance(x, Collective) and x.what == "ties" for x in tail)  # no group: one rank
    torch.manual_seed(0)
    model, x = gpt_tied(vocab_size=16, width=16, n_layers=4, n_heads=2, max_seq_len=8, batch_size=8)
    y = torch.randint(0, 16, x.shape)
    loss = gpt_loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    ref = {k: t.grad for k, t in model.named_parameters() if t.grad is not None}
    assert "tok.weight" in ref
    for k, name in enumerate(names):
        assert results[0][k][0] == pytest.approx(float(loss.detach()), rel=1e-5), name
        grads = {**results[0][k][1], **results[1][k][1]}
        assert_close(grads, ref, name)  # every parameter, each once
        assert "tok.weight" in results[0][k][1] and "tok.weight" not in results[1][k][1]
