"""Binding a rank's program: one instruction per compute and per post, the frees as reaps."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.runtime.inputs.microbatch import Batch
from pipeline.runtime.step.program import Compiled, Msg, compile_rank
from pipeline.runtime.step.stage import StageRuntime
from pipeline.schedules.actions import Action, parse_action
from pipeline.schedules.program import Free, Post, Wait
from pipeline.schedules.schedule import schedule


class _Host:
    def __init__(self) -> None:
        self.inputs: list[Batch] = []
        self.targets: list[Any] = []
        self.posted: list[tuple[list[Msg], list[Msg], str]] = []
        self.released: list[list[Msg]] = []

    def take(self, m: Msg) -> Any:
        raise AssertionError("not run")

    def post(self, sends: list[Msg], recvs: list[Msg], what: str) -> None:
        self.posted.append((sends, recvs, what))

    def release(self, sends: list[Msg]) -> None:
        self.released.append(sends)


def _compile(rank: int) -> tuple[Compiled, _Host]:
    sched = schedule("1f1b", 2, 4)
    stage = StageRuntime(rank, nn.Sequential(nn.Linear(2, 2)), n_stages=2, n_microbatches=4,
                         split_backward=False, recompute="never", loss_fn=None,
                         device=torch.device("cpu"))  # fmt: skip
    host = _Host()
    return compile_rank(sched, rank, {rank: stage}, host), host


def test_one_bound_instruction_per_compute_and_per_post() -> None:
    sched = schedule("1f1b", 2, 4)
    for rank in (0, 1):
        compiled, host = _compile(rank)
        program = sched.program(rank)
        posts = [x for x in program if isinstance(x, Post)]
        xs = program.instructions
        # a free right after a wait is that receive's reap; any other is an instruction of its own
        alone = [x for k, x in enumerate(xs) if isinstance(x, Free) and not isinstance(xs[k - 1], Wait)]
        bound = [a for a, _ in compiled.program]
        assert [a for a in bound if a is not None] == program.compute()
        assert bound == [x if isinstance(x, Action) else None for x in xs
                         if isinstance(x, Action | Post) or x in alone]  # fmt: skip
        assert not compiled.local  # no neighbour stage on this rank
        for a, fn in compiled.program:
            if a is None:
                fn()
        # each post hands the host its sends and receives, named by its first message
        assert [[m.action for m in ms] for ms in host.released] == [list(x.sends) for x in alone]
        got = [([m.action for m in s], [m.action for m in r], what) for s, r, what in host.posted]
        assert [(s, r) for s, r, _ in got] == [(list(x.sends), list(x.recvs)) for x in posts]
        first = (posts[0].sends or posts[0].recvs)[0]
        assert got[0][2] == f"{first} {'to' if first.kind.is_send else 'from'} rank {1 - rank}"


def test_sends_are_reaped_by_the_receive_that_proves_them_done() -> None:
    compiled, _ = _compile(0)
    msgs = compiled.msgs
    for i in range(4):
        # rank 1 sends 1SEND_B{i} only after consuming 0SEND_F{i}: receiving it proves the send done
        reap = [m.action for m in msgs[parse_action(f"0RECV_B{i}")].reap]
        assert reap == [parse_action(f"0SEND_F{i}")]
    assert all(not m.reap for a, m in msgs.items() if a.kind.is_send)
    assert msgs[parse_action("0SEND_F2")].what == "0SEND_F2 to rank 1"
