"""``pipeline.runtime.channels``: what the NCCL path's transfers report, without a GPU.

``NcclTransfer`` holds the works NCCL returned for one posted group (a batched send and receive
can be several): it is complete only when every one of them is, or a receive would be read while
its bytes are still arriving.
"""

from __future__ import annotations

import torch

from pipeline.runtime.channels import NcclTransfer


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
