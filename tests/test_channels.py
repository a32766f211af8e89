"""``pipeline.runtime.comm.channels``: what the NCCL path's transfers report, without a GPU.

``NcclTransfer`` holds the works NCCL returned for one posted group (a batched send and receive
can be several): it is complete only when every one of them is, or a receive would be read while
its bytes are still arriving.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline.runtime.comm.channels import Channels, NcclTransfer


class _Work:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def test_a_transfer_is_complete_only_when_every_work_of_its_group_is() -> None:
    tensors = [torch.zeros(2), torch.zeros(3)]
    assert not NcclTransfer([_Work(True), _Work(False)], tensors).is_completed()
    assert not NcclTransfer([_Work(False), _Work(True)], tensors).is_completed()
    assert not NcclTransfer([_Work(False), _Work(False)], tensors).is_completed()
    assert NcclTransfer([_Work(True), _Work(True)], tensors).is_completed()
    assert NcclTransfer([_Work(True)], tensors[:1]).is_completed()


class _Group:
    """A channel's two-rank group that fails any point-to-point call outside a batch."""

    def send(self, *args: Any) -> None:
        raise AssertionError("a lone send: ProcessGroupNCCL would make a second communicator for it")

    recv = send


def _nccl_channels(lanes: dict[tuple[int, int], tuple[Any, int, int]]) -> Channels:
    ch = object.__new__(Channels)  # the NCCL path without a GPU: the lanes stand in for new_group's
    ch.rank, ch.emulated, ch._global, ch._lanes = 0, False, [0, 1, 2], lanes
    return ch


def test_an_ordered_transfer_holds_its_tensors_no_longer(monkeypatch: pytest.MonkeyPatch) -> None:
    # the executor keeps its recent receives' transfers for the stuck report: once ordered, they must
    # not keep the buffers alive past their compute (tensors the memory plan does not count)
    import contextlib
    import weakref

    class _Waited(_Work):
        def wait(self) -> None:
            self.done = True

    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    buffer = torch.zeros(4)
    alive = weakref.ref(buffer)
    transfer = NcclTransfer([_Waited(False)], [buffer])
    del buffer
    assert alive() is not None  # held until ordered: NCCL may still be writing it
    transfer.order(object())  # type: ignore[arg-type]  # a stand-in: no CUDA here
    assert transfer.works[0].done and alive() is None and transfer.is_completed()


def test_every_message_goes_through_one_batch_on_its_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    """One communicator per channel: NCCL runs a batch (ncclGroupStart active) on the group's own
    communicator, a lone send/recv on a pair-keyed second one; so single tensors are batched too."""
    to_1, from_2 = _Group(), _Group()
    ch = _nccl_channels({(0, 1): (to_1, 1, 1), (2, 0): (from_2, 0, 2)})
    batches: list[list[tuple[Any, int, Any]]] = []

    def batch(ops: list[tuple[Any, int, Any]]) -> list[_Work]:
        batches.append(ops)
        return [_Work(True)]

    monkeypatch.setattr(dist, "P2POp", lambda op, t, peer, group: (op, peer, group))  # group unregistered
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    a, b = torch.zeros(1), torch.zeros(2)
    assert ch.post([(a, 1, True)], "one tensor").is_completed()
    ch.post([(a, 1, True), (b, 1, True)], "two tensors")
    ch.post([(b, 2, False)], "a receive")
    assert batches == [
        [(dist.isend, 1, to_1)],
        [(dist.isend, 1, to_1), (dist.isend, 1, to_1)],
        [(dist.irecv, 2, from_2)],
    ]
    with pytest.raises(RuntimeError, match="one NCCL group must stay on one channel, got 2"):
        ch.post([(a, 1, True), (b, 2, False)], "two channels")
