"""Compiling a rank's lowered list: one instruction per compute and per comm block, reaps."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.runtime.microbatch import Batch
from pipeline.runtime.program import Compiled, Msg, compile_rank
from pipeline.runtime.stage import StageRuntime
from pipeline.schedules.actions import Kind, parse_action
from pipeline.schedules.schedule import schedule


class _Host:
    def __init__(self) -> None:
        self.inputs: list[Batch] = []
        self.targets: list[Any] = []
        self.posted: list[tuple[list[Msg], list[Msg], str]] = []

    def take(self, m: Msg) -> Any:
        raise AssertionError("not run")

    def post(self, sends: list[Msg], recvs: list[Msg], what: str) -> None:
        self.posted.append((sends, recvs, what))


def _compile(rank: int, lookahead: bool) -> tuple[Compiled, _Host]:
    sched = schedule("1f1b", 2, 4)
    stage = StageRuntime(rank, nn.Sequential(nn.Linear(2, 2)), n_stages=2, n_microbatches=4,
                         split_backward=False, recompute="never", loss_fn=None,
                         device=torch.device("cpu"))  # fmt: skip
    host = _Host()
    return compile_rank(sched, rank, {rank: stage}, host, lookahead), host


def test_program_has_one_instruction_per_comm_block() -> None:
    sched = schedule("1f1b", 2, 4)
    compiled, host = _compile(0, lookahead=False)
    lowered = sched.lowered()[0]
    blocks = sum(
        1
        for k, a in enumerate(lowered)
        if not a.kind.is_compute and (k == 0 or lowered[k - 1].kind.is_compute)
    )
    program = [a for a, _ in compiled.program]
    assert [a for a in program if a is not None] == list(sched.compute[0])
    assert program.count(None) == blocks == 5  # 0F0 | 0F1 | 0F2 | 0B0... blocks between computes
    assert all(a is None or a.kind in (Kind.F, Kind.B) for a in program)
    assert compiled.first_recvs == [] and not compiled.local  # no neighbour stage on this rank
    for a, fn in compiled.program:
        if a is None:
            fn()
    # without lookahead, each block posts its own sends and receives, named by its first action
    expected: list[tuple[list[Any], list[Any]]] = []
    for k, a in enumerate(lowered):
        if a.kind.is_compute:
            continue
        if k == 0 or lowered[k - 1].kind.is_compute:
            expected.append(([], []))
        expected[-1][0 if a.kind.is_send else 1].append(a)
    posted = [([m.action for m in s], [m.action for m in r], what) for s, r, what in host.posted]
    assert [(s, r) for s, r, _ in posted] == expected
    assert posted[0][2] == "0SEND_F0 to rank 1"


def test_sends_are_reaped_by_the_receive_that_proves_them_done() -> None:
    compiled, _ = _compile(0, lookahead=True)
    msgs = compiled.msgs
    for i in range(4):
        # rank 1 sends 1SEND_B{i} only after consuming 0SEND_F{i}: receiving it proves the send done
        reap = [m.action for m in msgs[parse_action(f"0RECV_B{i}")].reap]
        assert reap == [parse_action(f"0SEND_F{i}")]
    assert all(not m.reap for a, m in msgs.items() if a.kind.is_send)
    assert msgs[parse_action("0SEND_F2")].what == "0SEND_F2 to rank 1"
