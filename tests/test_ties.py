"""Tied weights (``pipeline.runtime.trace.ties``): found by identity, copies synced, this step's grads summed.

The reducer runs across real ranks (gloo) on hand-made gradients: every copy must end with the
sum of the copies' gradients of this step, on top of what ``.grad`` held before the step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.runtime.comm.p2p import PeerFailure, PipelineTimeout
from pipeline.runtime.trace.ties import Tie, TiedGrads, find_ties
from pipeline.schedules.program import Collective
from pipeline.schedules.schedule import schedule
from tests.dist import run_ranks


def test_find_ties_by_identity_in_stage_order() -> None:
    shared = nn.Linear(2, 2)
    other = nn.Linear(2, 2)
    stages = [nn.Sequential(shared), nn.Sequential(other), nn.Sequential(nn.ReLU(), shared)]
    assert find_ties(stages) == [
        Tie(("0.weight", "1.weight"), (0, 2)),
        Tie(("0.bias", "1.bias"), (0, 2)),
    ]
    assert find_ties([nn.Sequential(shared, shared)]) == []  # within one stage: one object, nothing to do


def _two_ranks() -> list[torch.Tensor]:
    r = dist.get_rank()
    p = nn.Parameter(torch.full((3,), float(r + 1)))
    ties = [Tie(("tok.weight", "head.weight"), (0, 1))]
    name = "tok.weight" if r == 0 else "head.weight"
    tied = TiedGrads(ties, {(r, name): p}, rank_of=lambda s: s, rank=r, timeout=20.0)
    tied.sync()
    synced = p.detach().clone()
    earlier = torch.full((3,), 10.0)  # both copies hold the same summed grad of an earlier step
    p.grad = earlier.clone()
    tied.begin()
    assert p.grad is None  # put aside: only this step's part is summed
    p.grad = torch.arange(3.0) * (r + 1)  # this step's backward on this rank
    tied.reduce()
    counted = tied.counted(p)
    tied.close()
    return [synced, p.grad.clone(), torch.tensor(float(counted))]


def test_two_ranks_sum_this_steps_grads(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, _two_ranks, 2)
    for r, (synced, grad, counted) in enumerate(results):
        assert torch.equal(synced, torch.ones(3))  # rank 0's copy
        assert torch.equal(grad, torch.full((3,), 10.0) + torch.arange(3.0) * 3)  # earlier + g0 + g1
        assert bool(counted) == (r == 0)  # one copy per tie in a global norm


def _four_ranks() -> dict[str, list[float]]:
    r = dist.get_rank()
    rank_of = lambda s: s % 4  # noqa: E731 (v = 2: stages 0..7)
    ties = [
        Tie(("a", "a"), (0, 3)),  # ranks 0 and 3
        Tie(("b", "b"), (1, 2)),  # ranks 1 and 2
        Tie(("c", "c", "c", "c"), (0, 1, 2, 3)),  # every rank, in float64
        Tie(("d", "d"), (1, 5)),  # rank 1 twice: one object there, no group
        Tie(("e", "e"), (3, 7)),  # ranks 3 and 3
    ]
    params: dict[tuple[int, str], nn.Parameter] = {}
    made: dict[str, nn.Parameter] = {}
    for tie in ties:
        for s, name in zip(tie.stages, tie.names, strict=True):
            if rank_of(s) == r:
                dtype = torch.float64 if name == "c" else torch.float32
                p = made.setdefault(name, nn.Parameter(torch.zeros(2, dtype=dtype)))
                params[(s, name)] = p
    tied = TiedGrads(ties, params, rank_of=rank_of, rank=r, timeout=20.0)
    tied.begin()
    for name, p in made.items():
        p.grad = torch.full((2,), float(r + 1), dtype=p.dtype) if not (name == "c" and r == 2) else None
    # one group at a time, in the order of the program's tail (what Pipeline.step runs)
    sched = schedule("interleaved-1f1b", 4, 4, n_virtual=2)
    for x in sched.program(r, ties=[tie.stages for tie in ties]).tail():
        if isinstance(x, Collective) and x.what == "ties":
            tied.reduce(x.ranks)
    tied.close()
    return {name: p.grad.tolist() for name, p in made.items()}


def test_four_ranks_each_tie_over_its_own_ranks(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, _four_ranks, 4)
    g = [float(r + 1) for r in range(4)]
    assert results[0] == {"a": [g[0] + g[3]] * 2, "c": [g[0] + g[1] + g[3]] * 2}  # rank 2's c: no grad
    assert results[1] == {"b": [g[1] + g[2]] * 2, "c": [g[0] + g[1] + g[3]] * 2, "d": [g[1]] * 2}
    assert results[2] == {"b": [g[1] + g[2]] * 2, "c": [g[0] + g[1] + g[3]] * 2}
    assert results[3] == {"a": [g[0] + g[3]] * 2, "c": [g[0] + g[1] + g[3]] * 2, "e": [g[3]] * 2}


def _peer_never_reduces() -> str:
    r = dist.get_rank()
    p = nn.Parameter(torch.zeros(2))
    tied = TiedGrads([Tie(("w", "w"), (0, 1))], {(r, "w"): p}, rank_of=lambda s: s, rank=r, timeout=1.5)
    tied.begin()
    p.grad = torch.ones(2)
    if r == 1:
        time.sleep(4.0)  # never joins the sum
        return "slept"
    try:
        tied.reduce()
    except (PipelineTimeout, PeerFailure, RuntimeError) as exc:
        return str(exc)
    return "no error"


def test_a_peer_that_never_reduces_times_out_naming_the_tie(tmp_path: Path) -> None:
    message, _ = run_ranks(tmp_path, _peer_never_reduces, 2)
    assert "gradients of tied w (stages 0, 1)" in message and "ranks [0, 1]" in message


def test_a_tie_split_into_two_objects_on_one_rank_is_refused() -> None:
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    with pytest.raises(
        ValueError, match=r"tied parameter w \(stages 0, 2\) is 2 different tensors on rank 0"
    ):
        TiedGrads([Tie(("w", "w"), (0, 2))], {(0, "w"): a, (2, "w"): b}, rank_of=lambda s: s % 2, rank=0)


def _groups_made_by_every_rank() -> list[tuple[list[int], bool]]:
    """The new_group calls of one rank while TiedGrads builds the ties of ``_four_ranks``'s kind."""
    r = dist.get_rank()
    ties = [
        Tie(("a", "a"), (0, 3)),
        Tie(("b", "b"), (1, 2)),
        Tie(("c",) * 4, (0, 1, 2, 3)),
        Tie(("e",) * 2, (3, 7)),
    ]
    params = {(s, t.names[0]): nn.Parameter(torch.zeros(1)) for t in ties for s in t.stages if s % 4 == r}
    for t in ties:  # one object per tie on a rank
        mine = [params[(s, t.names[0])] for s in t.stages if s % 4 == r]
        for s in t.stages:
            if s % 4 == r:
                params[(s, t.names[0])] = mine[0]
    calls: list[tuple[list[int], bool]] = []
    real = dist.new_group

    def recording(ranks: list[int], **kw: Any) -> Any:
        calls.append((list(ranks), bool(kw.get("use_local_synchronization", False))))
        return real(ranks, **kw)

    dist.new_group = recording  # type: ignore[assignment]
    try:
        TiedGrads(ties, params, rank_of=lambda s: s % 4, rank=r, timeout=20.0).close()
    finally:
        dist.new_group = real
    return calls


def test_every_rank_makes_every_ties_group_in_one_order(tmp_path: Path) -> None:
    """With init_process_group(device_id=...) a new group splits the world's NCCL communicator, which
    every world rank must join: so every rank makes every tie's group, in the ties' order, never
    with use_local_synchronization (ranks 3 and 7's tie is within one rank: no group)."""
    calls = run_ranks(tmp_path, _groups_made_by_every_rank, 4)
    assert calls == [[([0, 3], False), ([1, 2], False), ([0, 1, 2, 3], False)]] * 4
