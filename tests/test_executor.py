"""The executor's compiled program and local passing, in one process (world size 1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipeline.reference.models import mlp
from pipeline.runtime.comm import stream
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.actions import parse_action
from pipeline.schedules.schedule import schedule
from pipeline.schedules.simulate import simulate
from tests.dist import job


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


class _Polls:
    """A Comm stand-in that records what ``poll`` would wait for and name."""

    def __init__(self) -> None:
        self.polls: list[tuple[bool, str]] = []

    def poll(self, done: Any, what: Any) -> None:
        self.polls.append((done(), what()))


class _Work:
    def __init__(self, completed: bool) -> None:
        self.completed = completed

    def is_completed(self) -> bool:
        return self.completed


def test_run_ahead_waits_for_the_compute_two_back_and_names_the_open_receive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, _ = mlp(width=4, depth=2, batch_size=4)
    ex = Pipeline(model, [2], schedule="gpipe", n_microbatches=2, loss_fn=nn.functional.mse_loss).executor
    comm = _Polls()
    ex.comm = comm  # type: ignore[assignment]
    device_done = False
    monkeypatch.setattr(stream, "event_done", lambda event: device_done)
    ex._ends.extend([(parse_action("0F0"), None), (parse_action("0F1"), None)])
    ex._ordered.extend([("0RECV_B0 from rank 1", [_Work(True)]), ("0RECV_B1 from rank 1", [_Work(False)])])
    ex._run_ahead_wait()  # the device has not finished 0F0: wait, naming the receive that never came
    assert comm.polls == [(False, "0RECV_B1 from rank 1")]
    ex._ordered.clear()
    ex._run_ahead_wait()
    assert comm.polls[-1] == (False, "the device to finish 0F0")
    device_done = True
    ex._run_ahead_wait()
    assert len(comm.polls) == 2  # finished: no wait


def test_memory_stats_on_cpu() -> None:
    torch.manual_seed(0)
    model, x = mlp(width=8, depth=4, batch_size=8)
    pipe = Pipeline(model, [4], schedule="gpipe", n_microbatches=4, loss_fn=nn.functional.mse_loss)
    y = torch.randn(8, 8)
    pipe.step(x, y)  # a step that does not measure: no Python call per saved tensor, nothing counted
    stats = pipe.memory_stats()
    assert stats["peak"] is stats["activations"] is stats["counted_peak"] is None
    assert stats["source"].startswith("not measured") and stats["held"] == {0: 4}
    pipe.step(x, y, measure_memory=True)
    stats = pipe.memory_stats()
    assert stats["device"] == "cpu" and stats["allocated"] is None and stats["allocator_peak"] is None
    assert stats["held"] == pipe.peak_activations() == {0: 4}  # gpipe holds every micro-batch
    params = sum(p.numel() * 4 for p in pipe.parameters())
    assert stats["parameters"] == stats["gradients"] == params and stats["optimizer"] is None
    # 4 micro-batches of 2 rows held at once; each layer saves its ReLU output (the next
    # Linear's input, the same storage), plus the weighted loss (a float32 scalar) kept as the
    # graph's root; the data (the first Linear's input, the targets) is not counted
    assert stats["activations"] == 4 * (4 * (2 * 8 * 4) + 4)
    assert stats["counted_peak"] == 2 * params + stats["buffers"] + stats["activations"]
    assert stats["peak"] >= stats["counted_peak"]  # every storage: transients too
    assert pipe.executor.meter.now == 0  # everything released at the step's end


# ---- receive buffers alive, counted against the plan, on the NCCL code path (the emulation)


def _receive_buffers_alive() -> dict[str, tuple[int, float]]:
    """Per schedule: the most receive buffers alive at once in a step (weak references to every
    buffer posted, read after each post and each compute) and the plan's walk of them."""
    import weakref

    import torch.distributed as dist

    from pipeline.plan import Plan
    from pipeline.schedules.peaks import walk

    out: dict[str, tuple[int, float]] = {}
    for name, v, m, recompute in (("1f1b", 1, 4, "never"), ("gpipe", 1, 4, "always"),
                                  ("zb-h1", 1, 4, "never"), ("interleaved-1f1b", 2, 4, "never"),
                                  ("zb-v", 2, 4, "never"), ("dualpipe-v", 2, 4, "always")):  # fmt: skip
        torch.manual_seed(0)
        model, x = mlp(width=8, depth=8, batch_size=8)
        k = dist.get_world_size() * v
        plan = Plan(balance=[8 // k] * k, schedule=name, n_microbatches=m, n_virtual=v, recompute=recompute)
        pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, timeout=30.0)
        ex, live, most = pipe.executor, [], [0]

        def count(live: list[Any] = live, most: list[int] = most) -> None:
            most[0] = max(most[0], sum(ref() is not None for ref in live))

        def post(sends: Any, recvs: Any, what: str, _post: Any = ex.post, live: list[Any] = live) -> None:
            _post(sends, recvs, what)
            live.extend(weakref.ref(t) for msg in recvs for t in msg.tensors)
            count()

        def end(a: Any, _end: Any = ex.clock.end) -> Any:
            count()
            return _end(a)

        ex.post, ex.clock.end = post, end  # type: ignore[method-assign]
        pipe.step(x, torch.randn(8, 8))
        sched = pipe.schedule
        planned = walk(
            sched, dist.get_rank(), _receives_only(sched, dist.get_rank()), 1, [recompute] * sched.n_stages
        )[0]
        out[name] = (most[0], planned)
    return out


def _receives_only(sched: Any, r: int) -> Any:
    """The walk's weights that count rank r's receive buffers, one each: a remote stage's activation
    in, or gradient back."""
    ranks = [sched.rank_of(s) for s in range(sched.n_stages)]

    def weigh(key: tuple[str, int, int]) -> tuple[int, float]:
        kind, s, _ = key
        if kind == "in":
            return 0, float(s > 0 and ranks[s - 1] != r)
        return 0, float(kind == "gout" and s + 1 < len(ranks) and ranks[s + 1] != r)

    return weigh


_BUFFERS = job(2, _receive_buffers_alive, backend="nccl-emulated", timeout=120.0)


def test_receive_buffers_alive_never_exceed_the_plan_on_the_nccl_path(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # a buffer kept past its compute (a transfer held for the stuck report with its tensors, say)
    # is a tensor the plan does not count
    for rank, res in enumerate(_BUFFERS.results(tmp_path_factory)):
        for name, (alive, planned) in res.items():
            assert 0 < alive <= planned, (name, rank, alive, planned)
