"""The executor's compiled program and local passing, in one process (world size 1)."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.actions import Kind
from pipeline.models import mlp
from pipeline.pipe import Pipeline
from pipeline.simulate import simulate


def test_one_rank_interleaved_runs_in_schedule_order_without_comm() -> None:
    torch.manual_seed(0)
    model, x = mlp(width=8, depth=6, batch_size=8)
    y = torch.randn(8, 8)
    pipe = Pipeline(model, [2, 2, 2], schedule="interleaved-1f1b", n_virtual=3, n_microbatches=4,
                    loss_fn=nn.functional.mse_loss)  # fmt: skip
    ex = pipe.executor
    assert ex.comm is None and all(a is not None for a, _ in ex._program)  # no comm blocks at all
    pipe.step(x, y, record=True)
    events = pipe.timeline().of_rank(0)
    assert [e.action for e in events] == list(pipe.schedule.compute[0])
    assert all(e.action.kind.is_compute for e in events)
    assert abs(pipe.busy_time - sum(e.duration for e in events)) < 1e-3
    sim = simulate(pipe.schedule, forward=1.0, backward=1.0)
    assert [e.action for e in sim.of_rank(0)] == [e.action for e in events]
    assert ex._local and all(m.value is None for m in ex._local.values())  # every hand-over consumed


def test_program_has_one_instruction_per_comm_block() -> None:
    from pipeline.executor import Executor
    from pipeline.schedule import schedule
    from pipeline.stage import StageRuntime

    sched = schedule("1f1b", 2, 4)
    stage = StageRuntime(0, nn.Sequential(nn.Linear(2, 2)), n_stages=2, n_microbatches=4,
                         split_backward=False, checkpoint="never", loss_fn=None,
                         device=torch.device("cpu"))  # fmt: skip
    ex = Executor(sched, 0, {0: stage}, None, torch.device("cpu"), "test")
    lowered = sched.lowered()[0]
    blocks = sum(
        1
        for k, a in enumerate(lowered)
        if not a.kind.is_compute and (k == 0 or lowered[k - 1].kind.is_compute)
    )
    program = [a for a, _ in ex._program]
    assert [a for a in program if a is not None] == list(sched.compute[0])
    assert program.count(None) == blocks == 5  # 0F0 | 0F1 | 0F2 | 0B0... blocks between computes
    assert all(a is None or a.kind in (Kind.F, Kind.B) for a in program)
