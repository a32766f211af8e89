"""The executor's compiled program and local passing, in one process (world size 1)."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.reference.models import mlp
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.schedule import schedule
from pipeline.schedules.simulate import simulate


def test_one_rank_interleaved_runs_in_schedule_order_without_comm() -> None:
    torch.manual_seed(0)
    model, x = mlp(width=8, depth=6, batch_size=8)
    y = torch.randn(8, 8)
    sched = schedule("interleaved-1f1b", 1, 4, n_virtual=3)
    pipe = Pipeline(model, [2, 2, 2], schedule=sched, n_virtual=3, loss_fn=nn.functional.mse_loss)
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
