"""Layers profiled once: a layer's structure, and per layer whether it is measured, takes the figures
of an earlier layer of the same structure, or (past the time budget) is left to its flops.

    # l: layer

Layers of the same structure on inputs of the same shapes cost the same: timing each on a shared
machine only gives the noise a chance to tell them apart (six identical decoder layers once
balanced as [2, 2, 1, 5]). Layer l's structure is what one untimed forward of it runs below
autograd, recorded op by op (``structure``; that forward's output is the next layer's input)::

    key(l) = (kind, device,
              modules' classes and training modes,
              parameters' and buffers' shapes, dtypes, requires_grad,
              the input's tensors' shapes, dtypes, strides, requires_grad,   (layer 0's: none)
              per aten op in order: its name; per tensor argument its shape, dtype, stride,
              requires_grad and whether it is a parameter or buffer; every other argument's value)

so a stride, an epsilon, a dropout's probability or training mode, a frozen weight or a longer
input all make another key. The first layer of a key is measured (``_measure``); a later one takes
its figures as they are (``LayerProfile.same_as``), with its own index, name and kind, and the
caller gives it its own parameters' names (a tie is per layer). The model's last layer, which
alone runs under the loss, measures its bytes itself (its closing transients are its own) and
takes only the times.

The time budget (``Run.deadline``): a layer of a new key that comes after it is measured
untimed (its flops and bytes), its times left to what its flops predict (``partitioner.noise``),
once some timed layer had flops to price them by; a layer being timed at the deadline stops at
``repeat`` samples. Time spent past the budget is then the untimed passes (a few forwards and
backwards per layer of a new key) and at most one layer's ``repeat`` samples.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from partitioner._measure import Rejected, Run, fresh, measure, precision
from partitioner._trees import tensors, tree_map
from partitioner.figures import LayerProfile

__all__ = ["Layers", "structure"]

# what a layer takes from the earlier layer of its structure when it measures its bytes itself
_TIMES = ("forward_time", "backward_time", "input_time", "weight_time", "samples", "spread", "error", "noisy",
          "timing")  # fmt: skip


def _tensor(t: torch.Tensor, owned: set[int]) -> tuple[Hashable, ...]:
    return (
        tuple(t.shape),
        str(t.dtype),
        t.stride() if t.layout == torch.strided else str(t.layout),
        t.requires_grad,
        t.untyped_storage().data_ptr() in owned if t.layout == torch.strided else False,
    )


def _described(x: Any, owned: set[int]) -> Hashable:
    """``x`` (an op's arguments, a layer's input) as a hashable value: tensors by ``_tensor``, containers
    by their items, scalars, dtypes and names by value, anything else by its type and repr (an
    object's address makes the key its own: no reuse, never a wrong one)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", *_tensor(x, owned))
    if isinstance(x, list | tuple):
        return (type(x).__name__, *(_described(v, owned) for v in x))
    if isinstance(x, dict):
        return ("dict", *((k, _described(v, owned)) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))))
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return (type(x).__name__, repr(x))


class _Ops(TorchDispatchMode):  # type: ignore[no-untyped-call, misc]
    """Records each aten op run inside, with its arguments described (``_described``)."""

    def __init__(self, owned: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.owned = owned
        self.ops: list[Hashable] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        self.ops.append((str(func), _described(args, self.owned), _described(kwargs, self.owned)))
        return func(*args, **kwargs)


def structure(
    kind: str, module: nn.Module, fn: Callable[[Any], Any], x: Any, run: Run, first: bool
) -> tuple[Hashable, Any]:
    """(key, output) of one untimed forward of ``fn`` (the working copy ``module``) on ``x`` (see the
    module docstring); ``Rejected`` when it raises."""
    held = [*module.parameters(), *module.buffers()]
    owned = {t.untyped_storage().data_ptr() for t in held}
    a, _ = fresh(x, first)
    recorder = _Ops(owned)
    with precision(run):
        try:
            with recorder:
                out = fn(a)
        except Exception as err:
            raise Rejected(str(err)) from err
    key = (
        kind,
        str(run.device),
        tuple((type(m).__qualname__, m.training) for m in module.modules()),
        tuple((tuple(t.shape), str(t.dtype), t.requires_grad) for t in held),
        _described(a, owned),
        tuple(recorder.ops),
    )
    return key, tree_map(out, lambda t: t.detach())


@dataclass
class Layers:
    """One profile's layers so far, by structure: ``measured`` the first layer of each key."""

    measured: dict[Hashable, LayerProfile] = field(default_factory=dict)
    priced: bool = False  # a timed layer had flops: a layer past the budget can be priced by them

    def figures(
        self,
        index: int,
        name: str,
        kind: str,
        work: nn.Module,
        x: Any,
        run: Run,
        *,
        first: bool,
        closing: bool,
    ) -> tuple[LayerProfile, Any]:
        """Layer ``index``'s figures and output: measured, or an earlier layer's (see the module
        docstring). ``Rejected`` when it raises on ``x``."""
        key, out = structure(kind, work, work, x, run, first)
        same = self.measured.get(key)
        if same is not None and not closing:
            for t in tensors(out):  # held as the next layer's input, as a measured layer's output is
                run.live.track(t)
            return dataclasses.replace(same, index=index, name=name, kind=kind, same_as=same.index), out
        del out  # measure's own: not held beside what it measures
        late = run.deadline is not None and self.priced and time.perf_counter() >= run.deadline
        timed = same is None and not late
        figures, out = measure(
            index, name, kind, work, work, x, run, first=first, closing=closing, timed=timed
        )
        if same is not None:  # its bytes, the first one's times
            return dataclasses.replace(
                figures, same_as=same.index, **{f: getattr(same, f) for f in _TIMES}
            ), out
        self.measured[key] = figures
        self.priced = self.priced or (timed and figures.flops + figures.backward_flops > 0)
        return figures, out
