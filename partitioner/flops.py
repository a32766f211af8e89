"""``FlopCount``: floating-point operations of every op that runs inside it, forward and backward.

    with FlopCount() as count:
        out = layer(x)                 # count.total: the forward's
        out.backward(grad)             # and now the backward's too

``torch.utils.flop_counter`` knows formulas for matrix products, convolutions and CUDA attention
and counts nothing else: LayerNorm, embeddings, softmax, activations and the CPU attention kernel
are 0 there, so a cost built on it is blind to them, and differs between CPU and CUDA. Here every
op counts, by one rule chosen per op::

    rule                         ops                                     flops
    formula                      mm, addmm, bmm, conv, every attention   torch's formula (CPU flash
                                 kernel (CUDA and CPU)                    attention: the CUDA one's)
    no arithmetic                views, copies, casts, fills, creation   0
                                 (arange, zeros), gathers (embedding
                                 lookup, cat, index)
    reduction (op tag)           sum, mean, amax, var_mean, ...           elements of the largest input
    everything else              pointwise, norms, softmax, their         elements of the largest output
                                 backwards, embedding backward (below)

An op below autograd is the same op on CPU and CUDA (``aten.convolution``, ``aten.native_layer_norm``),
so the counts agree across devices; attention, which picks a device-specific kernel, gets the same
formula for every kernel. The embedding backward adds each incoming gradient row into the weight's
gradient: the incoming gradient's elements, not the (vocabulary-sized) output's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["FlopCount", "op_flops"]

_aten = torch.ops.aten


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


def _cpu_flash(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    count: Any = flop_counter.sdpa_flop_count  # untyped in torch
    return int(count(_shape(query), _shape(key), _shape(value)))


def _cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    count: Any = flop_counter.sdpa_backward_flop_count  # untyped in torch
    return int(count(_shape(grad_out), _shape(query), _shape(key), _shape(value)))


# the CPU attention kernels, priced like their CUDA counterparts (torch has no formula for them)
_CPU_FORMULAS: dict[Any, Callable[..., int]] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}

_NO_ARITHMETIC = {
    getattr(_aten, name)
    for name in (
        "_to_copy",
        "alias",
        "arange",
        "cat",
        "clone",
        "constant_pad_nd",
        "copy",
        "copy_",
        "detach",
        "embedding",
        "empty",
        "empty_like",
        "empty_strided",
        "expand",
        "fill",
        "fill_",
        "full",
        "full_like",
        "gather",
        "index",
        "index_select",
        "lift_fresh",
        "lift_fresh_copy",
        "new_empty",
        "new_empty_strided",
        "new_full",
        "new_ones",
        "new_zeros",
        "ones",
        "ones_like",
        "repeat",
        "scalar_tensor",
        "select_backward",
        "slice_backward",
        "stack",
        "zero_",
        "zeros",
        "zeros_like",
    )
    if hasattr(_aten, name)
}


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """The flops of one call of the aten op ``func`` (an ``OpOverload``), by the rules above."""
    packet = func.overloadpacket
    if packet in _CPU_FORMULAS:
        return _CPU_FORMULAS[packet](*args, **kwargs)
    if packet in flop_counter.flop_registry:
        return int(flop_counter.flop_registry[packet](*args, **kwargs, out_val=out))
    if func.is_view or packet in _NO_ARITHMETIC:
        return 0
    if packet is _aten.embedding_dense_backward:
        return _elements(list(args[:1]))  # grad_output's rows are added into the weight's gradient
    if torch.Tag.reduction in func.tags:
        return _elements(tree_flatten((args, kwargs))[0])
    return _elements(tree_flatten(out)[0])


def _elements(items: list[Any]) -> int:
    return max((t.numel() for t in items if isinstance(t, torch.Tensor)), default=0)


class FlopCount(TorchDispatchMode):  # type: ignore[no-untyped-call, misc]
    """Counts ``total`` flops of every op run inside (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.total = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.total += op_flops(func, args, kwargs, out)
        return out
