"""What a device holds beyond the tensors the plan counts, measured once by the profile where it runs.

    # r: rank

The memory walk (``partitioner.memory``, ``Plan.rank_peaks``) counts tensor storages, as
``pipe.memory_stats()`` does on CPU. A CUDA device holds more, and a rank's limit must leave room
for it (``DeviceMemory`` in ``pipeline.plan``: the rule, read by the partitioner and the runtime)::

    need(peak) = peak * (1 + rounding) + workspaces  <=  limit * (1 - headroom)

    workspaces  cuBLAS and cuBLASLt keep one workspace per (cuBLAS handle, stream), and a handle is
                per thread: a step runs its forwards on the rank's thread and its backwards on
                autograd's device thread, both on the compute stream, so two per rank whatever its
                stages. Measured as the growth of the allocator's bytes in use
                (``torch.cuda.memory_allocated``: torch allocates the workspaces there) across a
                linear layer's forward and backward on a fresh stream, their tensors freed before
                the reading: whatever torch makes for them (cuBLAS's; cuBLASLt's where it is not
                unified with cuBLAS's, ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``; nothing when the size
                is set to 0), at the allocator's rounding. torch 2.13 also reports the configured
                size (``torch.backends.cuda.cublas_workspace_size()``, ``CUBLAS_WORKSPACE_CONFIG``),
                but not how many a step makes, nor whether cuBLASLt's is apart: the growth is what a
                step holds. The fresh stream makes it independent of what ran before (a workspace is
                made at its stream's first product); the measurement's workspaces are freed after
                it (``torch._C._cuda_clearCublasWorkspaces``), so they cost the run nothing.
    block       the allocator rounds every allocation up to a multiple of it: the growth when a
                1-byte tensor is made (CUDA's caching allocator: 512 B).
    rounding    what that rounding adds to the tensors the walk counts, as a fraction of them: per
                layer, the storages its profile allocates (inputs, saved tensors, outputs, weight
                gradients: what the walk's figures are made of; ``LiveBytes.rounded`` over
                ``made``), the worst layer's. A fraction rather than bytes per tensor because the
                walk's figures are bytes (a stage's, per micro-batch), not counts of tensors; the
                worst layer's fraction bounds any stage's mix of layers. It is taken at the profiled
                micro-batch: at fewer rows a tensor is smaller and its rounding weighs more, so
                ``partitioner.scaling`` grows it as 1 / rows. It leaves out the 2 MiB and 20 MiB
                segments the blocks are cut from: their slack is fragmentation, for the headroom.
    headroom    the fraction of the limit kept free, a policy rather than a measure:
                ``DEFAULT_HEADROOM`` by device type, ``partition(..., memory_headroom=...)``.

Why a headroom: when cudaMalloc fails, the caching allocator frees its whole cache and retries,
synchronising the device, which in a pipeline step (a rank's queued receives waiting on its
peers) can stall or deadlock it. What the allocator reserves beyond what is allocated (segments
only partly used, free blocks it cannot split or merge) depends on the order of allocations and
cannot be predicted from sizes; 10 % of the limit is left for it on CUDA. With
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` there is less of it, and a smaller headroom
may do. Outside the allocator, and so outside the limit: the CUDA context, NCCL's own buffers.

On CPU the same measurement reads ``LiveBytes`` (what ``memory_stats`` counts there): a matrix
product keeps no tensor and a 1-byte tensor holds 1 byte, so the term is 0, ``DeviceMemory()``
exactly, and plans are what they were without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.plan import DeviceMemory, check_headroom
from pipeline.runtime.step.live import LiveBytes

__all__ = ["DEFAULT_HEADROOM", "DeviceMemory", "Meter", "Readers", "measure_device_memory", "with_headroom"]

# the share of each rank's limit kept free, by device type (see the module docstring); others: 0
DEFAULT_HEADROOM: dict[str, float] = {"cuda": 0.1}


@dataclass(frozen=True)
class Readers:
    """How to read a device's memory: ``allocated()``, the bytes its allocator holds in use now;
    ``stream()``, a context running on a stream no product has run on yet; ``sync()``, waiting for
    the device's queued work; ``release()``, freeing what the measurement left (its workspaces)."""

    allocated: Callable[[], int]
    stream: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    sync: Callable[[], None] = lambda: None
    release: Callable[[], None] = lambda: None


def measure_device_memory(
    device: torch.device | str, readers: Readers | None = None, headroom: float | None = None
) -> DeviceMemory:
    """The device's workspaces per rank and allocator block (see the module docstring; ``rounding``
    is the profile's, 0 here). ``readers``: how to read its memory (default: CUDA's allocator on a
    CUDA device, else ``LiveBytes``' count of tensor storages); ``headroom``: None for the device
    type's default (``DEFAULT_HEADROOM``)."""
    dev = torch.device(device)
    share = DEFAULT_HEADROOM.get(dev.type, 0.0) if headroom is None else headroom
    check_headroom(share)
    if readers is not None:
        workspace, block = _measure(dev, readers)
    elif dev.type == "cuda":
        workspace, block = _measure(dev, _cuda_readers(dev))
    else:
        with LiveBytes() as live:
            workspace, block = _measure(dev, Readers(lambda: live.now[str(dev)]))
    return DeviceMemory(
        device=str(dev), workspace_bytes=float(max(workspace, 0)), block_bytes=max(block, 1), headroom=share
    )


def _measure(dev: torch.device, read: Readers) -> tuple[int, int]:
    """(bytes a linear layer's first forward and backward on a fresh stream keep, a 1-byte tensor's)."""
    before = read.allocated()
    one = torch.empty(1, dtype=torch.uint8, device=dev)
    block = read.allocated() - before
    del one
    try:
        before = read.allocated()
        with read.stream():
            # the forward's product on this thread, the backward's on autograd's: a step's two handles;
            # ones, not random values: the profile leaves the generators untouched
            x = torch.ones(8, 16, device=dev, requires_grad=True)
            w = torch.ones(16, 16, device=dev, requires_grad=True)
            b = torch.ones(16, device=dev, requires_grad=True)
            torch.autograd.backward((F.linear(x, w, b) @ w).sum())  # addmm (cuBLASLt's epilogue), mm
            del x, w, b
            read.sync()
        return read.allocated() - before, block
    finally:
        read.sync()
        read.release()


def _cuda_readers(dev: torch.device) -> Readers:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    return Readers(
        allocated=lambda: int(torch.cuda.memory_allocated(dev)),
        stream=lambda: torch.cuda.stream(torch.cuda.Stream(dev)),  # type: ignore[no-untyped-call]
        sync=lambda: torch.cuda.synchronize(dev),
        release=clear if clear is not None else lambda: None,
    )


def with_headroom(found: DeviceMemory, headroom: float | None) -> DeviceMemory:
    """``found`` with ``headroom`` as its share of the limit kept free (None: as measured)."""
    return found if headroom is None else dataclasses.replace(found, headroom=float(headroom))


class Meter:
    """A profile's ``DeviceMemory``: each device measured the first time a layer runs there, and the
    rounding of the storages each layer allocates (within ``layer``, counted by ``live``), the
    worst layer's (see the module docstring)."""

    def __init__(self, live: LiveBytes) -> None:
        self.live = live
        self.found: dict[str, DeviceMemory] = {}
        self.rounding = 0.0

    def on(self, device: torch.device) -> None:
        """Measure ``device`` unless it was; its storages are rounded to its block from now on."""
        key = str(device)
        if key not in self.found:
            self.found[key] = measure_device_memory(device)
            self.live.block[key] = self.found[key].block_bytes

    @contextlib.contextmanager
    def layer(self) -> Iterator[None]:
        """Count what the rounding adds to the storages allocated inside, as one layer's."""
        made, rounded = sum(self.live.made.values()), sum(self.live.rounded.values())
        yield
        made = sum(self.live.made.values()) - made
        extra = sum(self.live.rounded.values()) - rounded - made
        if made > 0:
            self.rounding = max(self.rounding, extra / made)

    def result(self) -> DeviceMemory:
        """A rank's: the most any device the profile ran on needs (each rank runs on one of them)."""
        if not self.found:
            return DeviceMemory()
        found = list(self.found.values())
        return DeviceMemory(
            device=",".join(dict.fromkeys(d.device for d in found)),
            workspace_bytes=max(d.workspace_bytes for d in found),
            block_bytes=max(d.block_bytes for d in found),
            rounding=self.rounding,
            headroom=max(d.headroom for d in found),
        )
