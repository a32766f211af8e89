"""Measured memory: the bytes a rank holds for backward during a step, and its peak split by kind.

    # s: stage, i: micro-batch, r: this rank

``ActivationMeter`` (one per rank, shared by its stages and its training executor) counts the
tensor storages that the pipeline keeps for a backward, each storage ONCE however many tensors
(views, the same tensor saved by two ops, a stage's input that its first layer also saves) point
at it, from the moment something holds it until the last holder lets go::

    held by                                      from                 until
    autograd (saved_tensors_hooks' pack)          the op saves it      its graph node frees it
    a stage: input, outputs / layer chain         F (or B's replay)    the micro-batch is freed
    a split stage: the layers' output grads       B                    W
    the executor: a receive buffer                posted               its compute action ends
    the executor: a send buffer                   posted               reaped (proven delivered)

Parameters and buffers (their storages, tied or viewed) are not activations and are skipped.
Each holder gets a token (``_Held``) that adds the storage's bytes if it is the storage's first
and takes them back when the last token dies (CPython frees it when its holder drops it, so the
count follows the program, not the garbage collector)::

    pack(t) --> key = storage data_ptr --> refs[key] += 1 (first: now += nbytes, peak = max(...))
    token dies (graph freed, micro-batch freed, buffer consumed) --> refs[key] -= 1 (last: now -= nbytes)

Parameters, buffers and the step's data (inputs, targets: the caller holds them anyway) are
skipped. It counts only in a step that measures memory (``step(..., measure_memory=True)``): it
costs a few Python calls per saved tensor, 3-4 % of the CPU time of a 2-stage GPT step of width
256 on one thread (cProfile, ``scripts/bench_schedules.py``'s gpt case), which put our 1F1B step
behind torch.distributed.pipelining's; a step that does not measure pays nothing.

``memory_stats(pipe, optimizer)`` adds the rank's static bytes (parameters, buffers, gradients
as they are after the step, the optimizer's state of this rank's parameters when given) to the
last step's peak activations; on CUDA it also reports the allocator's own peak.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pipeline.runtime.step.live import LiveBytes

__all__ = ["ActivationMeter", "measured", "memory_stats", "storage_bytes"]


class _Held:
    """One holder's claim on a storage; its death releases the claim."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: ActivationMeter, key: int, size: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor
        meter._acquire(key, size)

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Bytes of unique storages held for backward on one rank: now, and the peak since ``begin_step``."""

    def __init__(self) -> None:
        self.enabled = True  # Pipeline.step turns it on only in a step that measures memory
        self.now = 0
        self.peak = 0
        self.last_peak: int | None = None  # the last training step's peak (None before any)
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._owned: set[int] = set()
        self._lock = threading.Lock()  # a CUDA backward frees saved tensors on autograd's threads

    # ---- the step

    @staticmethod
    def owned(modules: Iterable[torch.nn.Module], batches: Iterable[Any]) -> list[torch.Tensor]:
        """What a step skips: ``modules``' parameters and buffers, and the tensors of ``batches`` (the
        step's inputs and targets, tensors or tuples of them). Listed again at every step that measures
        (FSDP swaps a stage's parameters for their gathered copies), and at no other."""
        out = [t for mod in modules for t in (*mod.parameters(), *mod.buffers())]
        return out + [t for batch in batches for t in _tensors(batch)]

    def begin_step(self, owned: Iterable[torch.Tensor]) -> None:
        """Start a step's peak from what is held now; ``owned``: parameters and buffers (skipped)."""
        # a DTensor (a shard of FSDP's or tensor parallelism's) has its storage in its local tensor
        local = (t.to_local() if isinstance(t, DTensor) else t for t in owned)
        self._owned = {t.untyped_storage().data_ptr() for t in local}
        with self._lock:
            self.peak = self.now

    def end_step(self) -> None:
        self.last_peak = self.peak if self.enabled else None

    # ---- holders

    def saving(self) -> contextlib.AbstractContextManager[Any]:
        """Count what autograd saves inside (a no-op when disabled)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def hold(self, tensors: Iterable[Any]) -> list[_Held]:
        """Tokens for ``tensors`` (non-tensors and owned storages skipped): held while the list lives."""
        if not self.enabled:
            return []
        out = []
        for t in tensors:
            if isinstance(t, torch.Tensor):
                held = self._pack(t)
                if isinstance(held, _Held):
                    out.append(held)
        return out

    def _pack(self, t: torch.Tensor) -> Any:
        if t.is_meta or type(t) not in (torch.Tensor, torch.nn.Parameter):
            return t  # no storage of its own to count (fake, meta, a subclass)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._owned:
            return t
        return _Held(self, key, storage.nbytes(), t)

    def _acquire(self, key: int, size: int) -> None:
        with self._lock:
            refs = self._refs.get(key, 0)
            self._refs[key] = refs + 1
            if refs == 0:
                self._sizes[key] = size
                self.now += size
                if self.now > self.peak:
                    self.peak = self.now

    def _release(self, key: int) -> None:
        with self._lock:
            refs = self._refs[key] - 1
            if refs:
                self._refs[key] = refs
                return
            del self._refs[key]
            self.now -= self._sizes.pop(key)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, tuple):
        return [t for item in batch for t in _tensors(item)]
    return [batch] if isinstance(batch, torch.Tensor) else []


def _unpack(held: Any) -> torch.Tensor:
    return held.tensor if isinstance(held, _Held) else held  # type: ignore[no-any-return]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages of ``tensors`` (Nones skipped): views and repeats count once; a
    DTensor's (a shard's) are its local tensor's, what this rank holds."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and isinstance(t, DTensor):
            t = t.to_local()
        if t is not None and not t.is_meta:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer: torch.optim.Optimizer, params: set[int]) -> Iterator[torch.Tensor]:
    """The optimizer's state tensors of this rank's parameters (``params``: their ids)."""
    for p, state in optimizer.state.items():
        if id(p) in params:
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


@contextlib.contextmanager
def measured(pipe: Any, on: bool, kept: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """With ``on``: count every storage allocated inside (``LiveBytes``); the step's true peak is then
    what was alive before it (parameters, buffers, gradients, and ``kept``: what else persists from
    step to step, the replicas' gradient buckets) plus the most allocated at once inside. Kept as
    ``pipe.measured_peak`` (None after a step that did not measure)."""
    pipe.measured_peak = None
    if not on:
        yield
        return
    params = list(pipe.parameters())
    before = storage_bytes([*params, *pipe.buffers(), *(p.grad for p in params), *kept])
    with LiveBytes() as live:
        yield
    pipe.measured_peak = before + live.most()


def memory_stats(pipe: Any, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """This rank's measured memory of ``pipe``'s last ``step`` (see ``Pipeline.memory_stats``)."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (the one stepping this pipeline's parameters), "
            f"got {type(optimizer).__name__}"
        )
    params = list(pipe.parameters())
    parameters = storage_bytes(params)
    buffers = storage_bytes(pipe.buffers())
    gradients = storage_bytes(p.grad for p in params)
    state = None
    if optimizer is not None:
        state = storage_bytes(_optimizer_tensors(optimizer, {id(p) for p in params}))
    activations = pipe.executor.meter.last_peak
    device = pipe.device
    cuda = device.type == "cuda"
    counted = None  # the hooks' count: what is held for backward, no transients
    if activations is not None:
        counted = parameters + buffers + gradients + (state or 0) + activations
    live = getattr(pipe, "measured_peak", None)
    peak: int | None
    if cuda:
        peak, source = torch.cuda.max_memory_allocated(device), "the CUDA allocator's peak"
    elif live is not None:
        peak, source = live + (state or 0), "every storage allocated in the step, from allocation to free"
    else:
        peak = None
        source = "not measured: on CPU, step(..., measure_memory=True) measures every storage"
    return {
        "device": str(device),
        "source": source,
        "peak": peak,
        "counted_peak": counted,
        "parameters": parameters,
        "buffers": buffers,
        "gradients": gradients,
        "optimizer": state,
        "activations": activations,
        "allocator_peak": torch.cuda.max_memory_allocated(device) if cuda else None,
        "allocated": torch.cuda.memory_allocated(device) if cuda else None,
        "held": pipe.peak_activations(),
    }
