"""Where a call reads tensors on the host, recorded on CPU.

On CUDA each such read of a device tensor (``.item()``, ``float()``, ``.tolist()``, ``.cpu()``, ...)
waits for the device to drain: a host synchronisation. On CPU nothing waits, so the reads are found
by wrapping ``torch.Tensor``'s read methods for the duration of the call and keeping each caller's
stack (``tests/test_host_sync.py``, ``tests/test_nccl_emulation.py``).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["READS", "host_reads", "innermost_library_line"]

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
_PIPELINE = str(Path(__file__).resolve().parent.parent / "pipeline")


def host_reads(fn: Callable[[], Any]) -> list[traceback.StackSummary]:
    """Run ``fn``; the stack of each tensor read on the host in it (outermost first, the reader's)."""
    stacks: list[traceback.StackSummary] = []
    real = {n: getattr(torch.Tensor, n) for n in READS}
    depth = [0]  # a read inside a read (a torch function mode calls the method again) is the same one

    def reading(n: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not depth[0]:
                caller = traceback.extract_stack()[:-1]  # not this frame
                stacks.append(traceback.StackSummary.from_list(caller))
            depth[0] += 1
            try:
                return real[n](self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return read

    for n in READS:
        setattr(torch.Tensor, n, reading(n))
    try:
        fn()
    finally:
        for n in READS:
            setattr(torch.Tensor, n, real[n])
    return stacks


def innermost_library_line(stack: traceback.StackSummary) -> tuple[str, int] | None:
    """(file, line) of the innermost frame of pipeline/ in ``stack``; None when it has none."""
    ours = [f for f in stack if str(Path(f.filename).resolve()).startswith(_PIPELINE)]
    return (str(Path(ours[-1].filename).resolve()), ours[-1].lineno or 0) if ours else None
