"""Where each layer is profiled, and the working copy of it that the profiler runs.

    # l: layer

``profile`` never runs the model's own modules. For layer l it makes a working copy on the
profiling device, runs that (in training mode, as the pipeline does), and drops it before layer
l + 1; so the model's ``.grad``, buffers, train/eval modes and ``requires_grad`` cannot change, and
only one layer's worth of memory is added at a time::

    layer's tensors           profiling device     the working copy's parameters and buffers
    on that device            same                 parameters: the model's own storage (no copy;
                                                   a write into them is caught by their version
                                                   counter); buffers: copies (BatchNorm updates them)
    on another device         device=...           copies on the profiling device
    on the meta device        device=...           materialised there: ``reset_parameters``
                                                   of every submodule, then ``init_fn``
                                                   (``pipeline.runtime.trace.materialize``: a tensor
                                                   neither sets is an error), then dropped

The profiling device of layer l is ``device`` if given, else where its tensors live (a model
spread over devices is profiled where each layer lives), else (no tensors, e.g. ReLU) where its
input is. ``torch.device("cuda")`` means the current CUDA device: it is compared as ``cuda:N``,
since ``torch.device("cuda") != torch.device("cuda:0")``.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pipeline.runtime.trace.materialize import materialize

__all__ = ["changed_parameters", "layer_device", "normalize", "working_copy"]


def normalize(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``cuda`` becomes ``cuda:N`` for the current device N."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} is CUDA, which this process cannot use; pass 'cpu'")
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _tensors_of(layer: nn.Module) -> Iterator[torch.Tensor]:
    return itertools.chain(layer.parameters(), layer.buffers())


def layer_device(
    label: str, layer: nn.Module, device: torch.device | None, input_device: torch.device
) -> torch.device:
    """Where layer ``label`` is profiled (see the module docstring)."""
    homes = {normalize(t.device) for t in _tensors_of(layer)}
    if device is not None:
        return device
    if len(homes) > 1:
        names = ", ".join(sorted(str(d) for d in homes))
        raise ValueError(
            f"{label} has tensors on several devices ({names}); pass device= to profile it on one"
        )
    if not homes:
        return input_device
    home = homes.pop()
    if home.type == "meta":
        raise ValueError(
            f"{label} is on the meta device, which holds no data to time or size; pass device= (where "
            "to materialise each layer in turn) and, if reset_parameters is not enough, init_fn="
        )
    return home


def working_copy(
    layer: nn.Module, dev: torch.device, init_fn: Callable[[nn.Module], None] | None
) -> nn.Module:
    """A copy of ``layer`` on ``dev`` to run instead of it (see the module docstring)."""
    if any(t.is_meta for t in _tensors_of(layer)):
        work = copy.deepcopy(layer)  # meta tensors: nothing to copy
        materialize([work], dev, init_fn)  # ties kept; a tensor nothing initialises is an error
        for t in _tensors_of(work):  # a layer holding real and meta tensors: the real ones too
            if normalize(t.device) != dev:
                t.data = t.data.to(dev)
        return work.train()
    memo: dict[int, object] = {}
    for p in layer.parameters():
        same = normalize(p.device) == dev
        data = p.detach() if same else p.detach().to(dev, copy=True)
        memo[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
    for b in layer.buffers():
        memo[id(b)] = b.detach().to(dev, copy=True)
    return copy.deepcopy(layer, memo).train()  # the pipeline trains it


def versions(layer: nn.Module) -> list[int]:
    """The parameters' version counters: a write into one (through any alias) moves its counter."""
    return [p._version for p in layer.parameters()]


def changed_parameters(layer: nn.Module, before: list[int]) -> list[str]:
    """Names of the parameters written into since ``versions`` gave ``before``."""
    return [name for (name, p), v in zip(layer.named_parameters(), before, strict=True) if p._version != v]
