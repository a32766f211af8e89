"""No posted transfer waits on its own rank's future: a device-wide sync mid-step never hangs a step.

The rule as data first (pipeline/schedules/program.py, ``drain_hazards``, validate's drain check):
every registry schedule's programs, training and forward-only, at p = 2..8, hold it; programs that
post every receive one block ahead (the rule switched off) break it where the issue's model said,
and the validator names the rank, the compute and the transfer in its grid. Then the runtime
(pipeline/runtime/step/drain.py): ``STAGEWISE_DRAIN_AT`` parsed, and every registry schedule run under
the NCCL emulation on 2 and 4 ranks with each rank in turn draining at each of its computes, equal
to one process, and ``R:K`` holding only rank R, at its compute K, at every step; with the rule
switched off, the drain names the receive that never comes.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.plan import Plan
from pipeline.reference.models import mlp
from pipeline.runtime.comm import emulation
from pipeline.runtime.comm.watchdog import PeerFailure, PipelineTimeout
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.step import drain
from pipeline.runtime.step.drain import drain_at
from pipeline.runtime.step.executor import Executor
from pipeline.schedules import program
from pipeline.schedules import validate as validate_module
from pipeline.schedules.actions import parse_action
from pipeline.schedules.program import Hazard, drain_hazards
from pipeline.schedules.registry import REGISTRY
from pipeline.schedules.schedule import forward_only, schedule_options, unchecked
from pipeline.schedules.validate import ScheduleError, validate
from tests.dist import job

BATCH, WIDTH, DEPTH = 8, 8, 8


# ---- the rule on programs


def _sizes(name: str, p: int) -> list[tuple[int, int]]:
    """(v, m) pairs the schedule takes at p: m from 1 to 3p, v its fewest stages per rank and 3 where open."""
    e = REGISTRY[name]
    vs = [e.min_virtual] + ([3] if e.takes_virtual(3) and e.min_virtual != 3 else [])
    return [
        (v, m)
        for v in vs
        for m in sorted({1, 2, p, p + 1, 2 * p, 3 * p})
        if not e.m_multiple_of_p or m % p == 0
    ]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registry_program_holds_the_rule_at_2_to_8_ranks(name: str) -> None:
    for p in range(2, 9):
        for v, m in _sizes(name, p):
            sched = unchecked(name, p, m, v)
            for sc in (sched, forward_only(sched)):
                assert drain_hazards(sc.programs(), sc.rank_of) == [], (sc.name, p, v, m)
            # replicas and weights tied across ranks add collectives and reductions, never a post
            ties = [(0, sched.n_stages - 1)]
            assert drain_hazards(sched.programs(dp=2, ties=ties), sched.rank_of) == [], (name, p, v, m)


@pytest.mark.parametrize(("name", "v"), [("gpipe", 1), ("1f1b", 1), ("zb-v", 2)])
def test_the_rule_holds_where_the_derivation_sheds_answered_bits(name: str, v: int) -> None:
    # past a few hundred bits the derivation shifts out the ones no receive asks about any more
    sched = unchecked(name, 16, 64, v)
    assert drain_hazards(sched.programs(), sched.rank_of) == []


def _all_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule switched off: every receive goes one block ahead, as programs did before it."""
    monkeypatch.setattr(program, "_late_receives", lambda sched, lowered: set())


def _hazard_cases() -> set[tuple[str, str, int, int]]:
    found = set()
    for name, e in REGISTRY.items():
        for p in (2, 3, 4):
            for m in (p, 2 * p):
                sched = unchecked(name, p, m, e.min_virtual)
                if drain_hazards(sched.programs(), sched.rank_of):
                    found.add((name, "train", p, m))
                try:
                    forward_only(sched)  # checks its programs as it makes them
                except ScheduleError:
                    found.add((name, "forward", p, m))
    return found


def test_without_the_rule_the_hazards_are_where_the_model_put_them(monkeypatch: pytest.MonkeyPatch) -> None:
    _all_ahead(monkeypatch)
    found = _hazard_cases()
    assert len(found) == 53
    # gpipe at every size; 1f1b and zb-h1 never; interleaved at m = p from p = 3; the V forwards; zb-v
    sizes = {(p, m) for p in (2, 3, 4) for m in (p, 2 * p)}
    assert {(p, m) for n, label, p, m in found if n == "gpipe" and label == "train"} == sizes
    assert not {f for f in found if f[0] in ("1f1b", "zb-h1")}
    assert {(p, m) for n, _, p, m in found if n == "interleaved-1f1b"} == {(3, 3), (4, 4)}
    assert all((n, "forward", p, m) in found for n in ("zb-v", "dualpipe-v", "v-half", "v-min")
               for p in (2, 3, 4) for m in (p, 2 * p))  # fmt: skip
    zb_v_train = {(p, m) for n, label, p, m in found if n == "zb-v" and label == "train"}
    assert zb_v_train == {(3, 3), (3, 6), (4, 4), (4, 8)}  # its training orders from p = 3 on
    sched = unchecked("gpipe", 2, 4, 1)
    assert drain_hazards(sched.programs(), sched.rank_of) == [
        Hazard(rank=0, at=sched.programs()[0].instructions.index(parse_action("0F3")),
               transfer=parse_action("0RECV_B0"), peer=1,
               peer_at=sched.programs()[1].instructions.index(program.Wait(parse_action("1RECV_F3"))))
    ]  # fmt: skip


def _held_at_each_compute(programs: Any, rank_of: Any) -> list[Hazard]:
    """The definition: each rank held at each of its computes in turn, the others played on (one game
    per rank, resumed from compute to compute), every transfer it posted since its last compute
    matched or a hazard."""
    out = []
    for r, prog in enumerate(programs):
        game = program.Game(programs)
        mine: list[Any] = []
        for t, x in enumerate(prog.instructions):
            if isinstance(x, program.Post):
                mine += (*x.sends, *x.recvs)
                continue
            if not isinstance(x, program.Action):
                continue
            game.run(hold=(r, t + 1))
            open_ = [
                a for a in mine
                if (program.sender(a) not in game.posted if a.kind.is_recv
                    else program.Action(*program._receiver(a)) not in game.ready)
            ]  # fmt: skip
            if open_:
                q = rank_of(open_[0].peer_stage)
                out.append(Hazard(r, t, open_[0], q, game.pos[q]))
                break
            mine = []
    return out


def test_one_game_with_clocks_finds_what_holding_each_rank_at_each_compute_finds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # with the rule off, hazards on many ranks (1f1b and zb-h1 hold it even so: their programs
    # still pass); replicas and tied weights add reductions and collectives to the tail
    _all_ahead(monkeypatch)
    compared = hazards = 0
    for name, e in REGISTRY.items():
        for p in (2, 3, 4):
            for m in (p, 2 * p):
                sched = unchecked(name, p, m, e.min_virtual)
                for programs in (sched.programs(), sched.programs(dp=2, ties=[(0, sched.n_stages - 1)])):
                    want = _held_at_each_compute(programs, sched.rank_of)
                    assert drain_hazards(programs, sched.rank_of) == want, (name, p, m)
                    compared, hazards = compared + 1, hazards + len(want)
    assert (compared, hazards) == (108, 110)  # not a vacuous comparison: hazards on many ranks


def _with_collective(programs: Any, group: tuple[int, ...], after: int) -> list[Any]:
    """``programs`` with a collective over ``group`` right after each member's ``after``-th compute
    (mid-step: derived programs hold theirs in the tail; it may deadlock, which the clocks must see)."""
    out = list(programs)
    for r in group:
        xs = list(out[r].instructions)
        at = [k for k, x in enumerate(xs) if isinstance(x, program.Action)][after] + 1
        out[r] = program.Program(r, (*xs[:at], program.Collective("all_reduce", "ties", group), *xs[at:]))
    return out


@pytest.mark.parametrize(("name", "p", "group", "after"), [
    ("1f1b", 3, (0, 2), 1), ("gpipe", 3, (0, 1, 2), 2), ("1f1b", 4, (1, 3), 0), ("zb-v", 2, (0, 1), 3),
    ("interleaved-1f1b", 2, (0, 1), 1), ("1f1b", 4, (0, 3), 4),
])  # fmt: skip
def test_a_game_with_clocks_knows_what_each_hold_lets_happen(
    name: str, p: int, group: tuple[int, ...], after: int
) -> None:
    # every send and receive posted: under a hold of rank r before its instruction h, posted exactly
    # when its Mark needs at most h of r's instructions (a collective is reached only below the hold)
    e = REGISTRY[name]
    sched = unchecked(name, p, 2 * p, e.min_virtual)
    programs = _with_collective(sched.programs(), group, after)
    free = program.Game(programs, clocks=True)
    free.run()
    for r, prog in enumerate(programs):
        for h in range(len(prog) + 1):
            held = program.Game(programs)
            held.run(hold=(r, h))
            for a, mark in free.sent_at.items():
                assert (a in held.posted) == (mark.on(r) <= h), (r, h, a, mark.on(r))
            for a, mark in free.ready_at.items():
                assert (a in held.ready) == (mark.on(r) <= h), (r, h, a, mark.on(r))
            assert len(held.posted) <= len(free.sent_at) and held.ready <= set(free.ready_at)
    mark = program.Mark([3, 5, 2], rank=0, count=7)
    assert (mark.on(0), mark.on(1), mark.joined([9, 1, 1])) == (7, 5, [9, 5, 2])


def test_the_validator_names_the_held_compute_the_transfer_and_where_the_peer_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _all_ahead(monkeypatch)
    sched = unchecked("gpipe", 2, 4, 1)
    with pytest.raises(ScheduleError) as info:
        validate(sched)
    msg = str(info.value)
    assert "device-wide sync hazard: with rank 0's host held at 0F3" in msg
    assert "its posted 0RECV_B0 never completes: rank 1 stops at wait 1RECV_F3" in msg
    assert "[0F3]" in msg and "[wait 1RECV_F3]" in msg  # the grid's bracketed cells
    # forward-only programs are proven where they are made
    with pytest.raises(ScheduleError, match=r"rank 0's host held at 0F1.*posted 3RECV_F0"):
        forward_only(unchecked("zb-v", 2, 2, 2))


def test_a_send_whose_receive_is_never_posted_is_a_hazard_too() -> None:
    sched = unchecked("1f1b", 2, 2, 1)
    progs = list(sched.programs())
    one = progs[1].instructions
    # rank 1 posts 1RECV_F1 only at its step's end: 0SEND_F1 (posted after 0F1) finds no receive
    late = [x for x in one if not (isinstance(x, program.Post) and parse_action("1RECV_F1") in x.recvs)]
    progs[1] = program.Program(1, tuple(late))
    found = drain_hazards(progs, sched.rank_of)
    assert found and found[0].rank == 0 and found[0].transfer == parse_action("0SEND_F1")


# ---- STAGEWISE_DRAIN_AT


def test_drain_points_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    computes = [6, 6, 4]
    monkeypatch.delenv(drain.ENV, raising=False)
    assert drain_at(0, computes) is None
    monkeypatch.setenv(drain.ENV, "1:2")
    at = drain_at(1, computes)
    assert at is not None and [at(0, k) for k in range(6)] == [False, False, True, False, False, False]
    other = drain_at(0, computes)
    assert other is not None and not any(other(s, k) for s in range(3) for k in range(6))
    every = drain_at(2, computes, "2:*")
    assert every is not None and all(every(s, k) for s in range(3) for k in range(4))
    turns = [drain_at(r, computes, "turns") for r in range(3)]
    assert [[bool(t is not None and t(step, 0)) for t in turns] for step in range(4)] == [
        [True, False, False], [False, True, False], [False, False, True], [True, False, False]]  # fmt: skip
    # random: one (rank, compute) per step, the same on every rank, differing between steps
    drawn = [drain_at(r, computes, "random:7") for r in range(3)]

    def hits(step: int) -> tuple[tuple[int, int], ...]:
        return tuple((r, k) for r, d in enumerate(drawn) for k in range(computes[r]) if d and d(step, k))

    assert all(len(hits(step)) == 1 for step in range(20))
    picks = {hits(step) for step in range(20)}
    assert len(picks) > 3


def test_a_training_steps_compute_past_a_forward_only_programs_end_drains_nowhere_there() -> None:
    # evaluate's program on rank 2 has 4 computes, its step 6: K = 5 is the step's, not an error
    forward = drain_at(2, [4, 4, 4], "2:5", training=False)
    assert forward is not None and not any(forward(0, k) for k in range(4))
    with pytest.raises(ValueError, match="never reaches compute 5"):
        drain_at(2, [4, 4, 4], "2:5")


@pytest.mark.parametrize(
    ("value", "words"),
    [("2", "is not one of 'R:K'"), ("3:1", "with R in [0, 3)"), ("0:x", "'R:*'"), ("random:", "random:SEED"),
     ("2:4", "rank 2 runs 4 computes per step (0 to 3), so it never reaches compute 4")],
)  # fmt: skip
def test_a_bad_drain_point_is_refused_with_the_forms_it_takes(value: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        drain_at(2, [6, 6, 4], value)
    assert "STAGEWISE_DRAIN_AT=" in str(info.value) and words in str(info.value)


# ---- the runtime under the emulation: every registry schedule, each rank drained at each compute


def _configs(p: int) -> list[tuple[str, int, int]]:
    out = []
    for name in REGISTRY:
        v, m = schedule_options(name, p, 2 * p, REGISTRY[name].min_virtual)
        out.append((name, v, m))
    return out


def _build() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model, x = mlp(width=WIDTH, depth=DEPTH, batch_size=BATCH)
    return model, x, torch.randn(BATCH, WIDTH)


def _balance(n_stages: int) -> list[int]:
    return [DEPTH // n_stages + (1 if k < DEPTH % n_stages else 0) for k in range(n_stages)]


def _pipeline(model: nn.Module, name: str, v: int, m: int, recompute: str, timeout: float) -> Pipeline:
    plan = Plan(balance=_balance(dist.get_world_size() * v), schedule=name, n_microbatches=m, n_virtual=v,
                recompute=recompute)  # fmt: skip
    return Pipeline(model, plan, loss_fn=nn.functional.mse_loss, timeout=timeout)


def _drained_matrix() -> dict[str, Any]:
    assert os.environ.get(emulation.ENV) == "1"
    p, out = dist.get_world_size(), {}
    os.environ[drain.ENV] = "turns"  # step t: rank t % p drains after each of its computes
    try:
        for name, v, m in _configs(p):
            recompute = "always" if name in ("1f1b", "zb-v") else "never"
            model, x, y = _build()
            pipe = _pipeline(model, name, v, m, recompute, timeout=20.0)
            evals, losses = [], []
            for _ in range(p):  # every rank's turn
                evals.append(pipe.evaluate(x, y))
                for t in pipe.parameters():
                    t.grad = None
                losses.append(pipe.step(x, y))
            grads = {k: t.grad.detach().clone() for k, t in pipe.named_parameters() if t.grad is not None}
            out[name] = (losses, evals, grads)
        out[AT] = _drained_at_one_compute()
    finally:
        del os.environ[drain.ENV]
    return out


AT = "1:2"  # rank 1 (not the first, nor on 4 ranks the last) at its third compute: gpipe's 1F2


def _drained_at_one_compute() -> tuple[list[float], list[str], dict[str, torch.Tensor]]:
    """gpipe under ``STAGEWISE_DRAIN_AT=AT`` for 2 steps: the losses, the computes where this rank's
    host drained, and the second step's gradients."""
    os.environ[drain.ENV] = AT
    drained: list[str] = []
    sync = Executor._device_sync

    def spy(self: Executor, a: Any) -> None:
        drained.append(str(a))
        sync(self, a)

    Executor._device_sync = spy  # type: ignore[method-assign]
    try:
        model, x, y = _build()
        pipe = _pipeline(model, "gpipe", 1, 2 * dist.get_world_size(), "never", timeout=20.0)
        losses = []
        for _ in range(2):  # at every step
            for t in pipe.parameters():
                t.grad = None
            losses.append(pipe.step(x, y))
    finally:
        Executor._device_sync = sync  # type: ignore[method-assign]
    grads = {k: t.grad.detach().clone() for k, t in pipe.named_parameters() if t.grad is not None}
    return losses, drained, grads


_MATRIX = {p: job(p, _drained_matrix, timeout=120.0, backend="nccl-emulated") for p in (2, 4)}


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_survives_a_drain_at_every_compute_of_every_rank(
    tmp_path_factory: pytest.TempPathFactory, p: int
) -> None:
    results = _MATRIX[p].results(tmp_path_factory)
    for name, _, m in _configs(p):
        model, x, y = _build()
        with torch.no_grad():
            chunks = zip(x.chunk(m), y.chunk(m), strict=True)
            ev_ref = float(torch.stack([nn.functional.mse_loss(model(a), b) for a, b in chunks]).mean())
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        loss_ref = float(loss.detach())
        for rank, res in enumerate(results):
            losses, evals, _ = res[name]
            assert len(losses) == len(evals) == p, (name, rank)
            assert all(abs(v - loss_ref) <= 1e-5 * abs(loss_ref) for v in losses), (name, rank, losses)
            assert all(abs(v - ev_ref) <= 1e-5 * abs(ev_ref) for v in evals), (name, rank, evals)
        merged = {k: g for r in results for k, g in r[name][2].items()}
        for k, t in model.named_parameters():
            assert t.grad is not None
            rel = float((merged[k] - t.grad).abs().max() / t.grad.abs().max().clamp_min(1e-12))
            assert rel < 1e-5, f"{name}: {k} relative error {rel:.2e}"


@pytest.mark.parametrize("p", [2, 4])
def test_a_drain_at_one_compute_holds_that_rank_there_only_at_every_step_equal_to_one_process(
    tmp_path_factory: pytest.TempPathFactory, p: int
) -> None:
    results = _MATRIX[p].results(tmp_path_factory)
    model, x, y = _build()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    loss_ref = float(loss.detach())
    for rank, res in enumerate(results):
        losses, drained, _ = res[AT]
        assert drained == (["1F2", "1F2"] if rank == 1 else []), (rank, drained)
        assert all(abs(v - loss_ref) <= 1e-5 * abs(loss_ref) for v in losses), (rank, losses)
    merged = {k: g for r in results for k, g in r[AT][2].items()}
    for k, t in model.named_parameters():
        assert t.grad is not None
        rel = float((merged[k] - t.grad).abs().max() / t.grad.abs().max().clamp_min(1e-12))
        assert rel < 1e-5, f"{k} relative error {rel:.2e}"


def _drained_without_the_rule() -> str:
    """gpipe on 2 ranks with every receive posted ahead and rank 0 draining at each compute."""
    program._late_receives = lambda sched, lowered: set()  # type: ignore[assignment]
    validate_module.check_drain = lambda sched, **kw: None  # type: ignore[assignment]  # as if unproven
    os.environ[drain.ENV] = "0:*"
    try:
        model, x, y = _build()
        pipe = _pipeline(model, "gpipe", 1, 2, "never", timeout=3.0)
        try:
            pipe.step(x, y)
        except (PipelineTimeout, PeerFailure) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "the step finished"
    finally:
        del os.environ[drain.ENV]


_UNRULED = job(2, _drained_without_the_rule, timeout=60.0, backend="nccl-emulated", batch="drain", last=True)


def test_without_the_rule_the_drain_names_the_receive_that_never_comes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    got = _UNRULED.results(tmp_path_factory)
    # rank 0 times out on the receive, or learns first that rank 1 timed out on the send rank 0 holds
    # back: either way its error names the receive the drain waited for
    assert got[0].startswith(("PipelineTimeout: rank 0 timed out", "PeerFailure: rank 1 failed")), got[0]
    named = "0RECV_B0 from rank 1, posted before the device-wide sync forced at 0F1 (STAGEWISE_DRAIN_AT)"
    assert named in got[0], got[0]
