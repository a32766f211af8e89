"""Prefetching the next batch: the emulated host-to-device copy, and which call takes a prefetched copy.

The multi-rank check (values equal with and without prefetching, on gloo and the
NCCL emulation, where a prefetched batch used without ordering reads NaN) is in
test_pipe_outputs.py; here one process.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.runtime.comm import emulation, stream
from pipeline.runtime.pipe import Pipeline

CPU = torch.device("cpu")


def test_an_emulated_copy_is_poison_until_compute_waits_for_its_event() -> None:
    copies = stream.new_stream(CPU, True, "copy")
    x, ids = torch.arange(4.0), torch.arange(3)
    out, out_ids = stream.start_copy(x, CPU, copies), stream.start_copy(ids, CPU, copies)
    event = stream.record_event(copies)
    x.add_(10)  # the host tensor changes after its copy was queued: the copy keeps what was queued
    assert out.isnan().all() and (out_ids == torch.iinfo(torch.int64).min).all()  # not ordered yet
    stream.wait_event(emulation.DEFAULT, event)
    assert torch.equal(out, torch.arange(4.0)) and torch.equal(out_ids, torch.arange(3))


def test_to_device_orders_compute_after_the_copy_at_once() -> None:
    copies = stream.new_stream(CPU, True, "copy")
    out = stream.to_device(torch.ones(2), CPU, copies, emulation.DEFAULT)
    assert torch.equal(out, torch.ones(2))
    assert all(t.visible for t in copies.after)  # nothing left pending on the copy stream


def test_a_call_takes_the_prefetched_copy_only_of_the_same_objects() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    pipe = Pipeline(model, [3], schedule="1f1b", n_microbatches=2, loss_fn=nn.functional.mse_loss)
    assert pipe.needs_inputs and pipe.needs_targets  # one rank holds every stage
    x1, y1, x2, y2 = torch.randn(5, 3), torch.randn(5, 2), torch.randn(6, 3), torch.randn(6, 2)
    first = pipe.step(x1, y1, prefetch=[x2, y2])  # a DataLoader's [x, y] will do
    placer = pipe.runner.placer
    assert set(placer.prefetched) == {"inputs", "targets"} and placer.prefetch_used == 0
    assert pipe.evaluate(x1, y1) > 0  # other objects: copied as usual, the prefetched copy kept
    assert set(placer.prefetched) == {"inputs", "targets"} and placer.prefetch_used == 0
    second = pipe.step(x2, y2)
    assert not placer.prefetched and placer.prefetch_used == 2
    with torch.no_grad():
        ref = [float(nn.functional.mse_loss(model(x), y)) for x, y in ((x1, y1), (x2, y2))]
    assert abs(first - ref[0]) < 1e-6 and abs(second - ref[1]) < 1e-6
    pipe.predict(x1, prefetch=(x2, None))  # predict prefetches inputs alone
    assert set(placer.prefetched) == {"inputs"}
    assert pipe.predict(x2).shape == (6, 2) and placer.prefetch_used == 3
