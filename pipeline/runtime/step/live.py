"""``LiveBytes``: the bytes of tensor storage alive at once, counted as ops allocate and free it.

    with LiveBytes() as live:
        run()                      # any torch code: forward, backward, copies
    live.peak["cpu"]               # the most bytes alive at once on that device, since entering

A ``TorchDispatchMode`` sees every op below autograd, backward ops included, on every device.
A storage is counted when an op returns a tensor on one that none of the op's inputs uses (a new
allocation; views and in-place results share their input's storage and are not counted again),
and uncounted when the storage itself is freed: its Python object is kept for as long as the
storage lives, so a finalizer on it fires exactly then, whichever tensors (views, autograd's saved
tensors, a Parameter wrapping it) held it last::

    op returns t   storage new? --yes--> now += nbytes, peak = max(peak, now), finalize(storage)
                                                                                  |
    last holder of the storage dies ------------------------------------> now -= nbytes

A storage can also grow and shrink in place, under no op: ``UntypedStorage.resize_`` is a method
of the storage, not a dispatched op. FSDP2 keeps each unsharded parameter's storage and resizes it
to 0 after a reshard and back before the next all-gather writes into it, so a step's gathered
parameters (a stage's whole weights, under ZeRO-2 through the step) would never be seen. Every
resize is therefore reported to every mode entered and not yet left (``_resized``; torch's method is
wrapped once, at the first entry)::

    storage.resize_(n)   counted?  --yes--> now += n - its bytes
                                   --no, grown from 0--> counted from now, as if made here

Storages that existed before entering are not counted: ``peak`` is the extra memory of what runs
inside (one of them grown in place from nothing counts from then on, as a new allocation does).
It counts tensor bytes, not an allocator's cached blocks or fragmentation, and it slows every op
down (a Python call each), so nothing timed should run inside it. ``made`` and
``rounded`` add up every storage counted since the start, the second rounded up to
``block[device]`` bytes (an allocator's block; 1 where absent): how much an allocator's rounding
adds to those tensors (``partitioner.device_memory``).
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call, misc]
    """Live and peak bytes of the storages allocated inside, per device (``"cpu"``, ``"cuda:0"``)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.now: defaultdict[str, int] = defaultdict(int)
        self.peak: defaultdict[str, int] = defaultdict(int)
        self.made: defaultdict[str, int] = defaultdict(int)  # every storage counted, in bytes
        self.rounded: defaultdict[str, int] = defaultdict(int)  # the same, each rounded up to block[device]
        self.block: dict[str, int] = {}
        self._sizes: dict[int, tuple[str, int]] = {}  # id(storage) -> (device, nbytes), while alive
        self._lock = threading.Lock()  # finalizers and autograd's device threads may run anywhere

    def most(self) -> int:
        """The largest peak on any one device (0 before anything was allocated)."""
        return max(self.peak.values(), default=0)

    def reset_peak(self) -> None:
        """Start the peaks again from the bytes alive now."""
        with self._lock:
            for device, value in self.now.items():
                self.peak[device] = value

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage if it is not counted yet (for one made outside the mode)."""
        self._add(tensor.untyped_storage(), str(tensor.device))

    def __enter__(self) -> LiveBytes:
        _watch_resizes()
        with _modes_lock:
            _modes.append(self)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        with _modes_lock:
            _modes.remove(self)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if _real(t)}
        for t in tree_flatten(out)[0]:
            if _real(t):
                storage = t.untyped_storage()
                if id(storage) not in inputs:
                    self._add(storage, str(t.device))
        return out

    def _add(self, storage: Any, device: str) -> None:
        key, size = id(storage), int(storage.nbytes())
        with self._lock:
            if key in self._sizes or size == 0:
                return
            self._sizes[key] = (device, size)
            block = self.block.get(device, 1)
            self.made[device] += size
            self.rounded[device] += -(-size // block) * block
            self.now[device] += size
            self.peak[device] = max(self.peak[device], self.now[device])
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        with self._lock:
            device, size = self._sizes.pop(key)
            self.now[device] -= size

    def _resized(self, storage: Any, old: int) -> None:
        """``storage`` went from ``old`` bytes to its size now, in place (see the module docstring)."""
        key, size = id(storage), int(storage.nbytes())
        with self._lock:
            if key in self._sizes:
                device, _ = self._sizes[key]
                self._sizes[key] = (device, size)
                self.now[device] += size - old
                self.peak[device] = max(self.peak[device], self.now[device])
                return
        if old == 0:  # a storage from before, allocated again: counted as a new one
            self._add(storage, str(storage.device))


_modes: list[LiveBytes] = []  # the modes entered and not yet left, on any thread
_modes_lock = threading.Lock()
_resize: Any = None  # torch's UntypedStorage.resize_, once wrapped


def _watch_resizes() -> None:
    """Wrap ``torch.UntypedStorage.resize_`` (once) so that every live mode hears of each resize."""
    global _resize
    if _resize is not None:
        return
    _resize = original = torch.UntypedStorage.resize_

    def resize_(storage: Any, size: int) -> Any:
        if not _modes:  # nothing measures: torch's own method, one check more
            return original(storage, size)
        old = int(storage.nbytes())
        out = original(storage, size)
        with _modes_lock:
            modes = list(_modes)
        for mode in modes:
            mode._resized(storage, old)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]


def _real(t: object) -> bool:
    """A tensor with storage of its own kind (meta tensors and tensor subclasses have none to count)."""
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta
