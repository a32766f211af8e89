"""Per-layer profile of an ``nn.Sequential``: time, flops, bytes; the model is left exactly as it was.

    # i: layer, B: batch

Each layer i is run on the output of layer i - 1 (detached, so its backward stops at the layer):

    sample -> layer 0 -> x1 -> layer 1 -> x2 ... -> layer n-1 -> out
              |---------|     |---------|
              timed fwd+bwd   timed fwd+bwd      (warm-up runs first, then medians of `repeat`)

The layers run in training mode (the pipeline trains them); afterwards parameters, buffers
(BatchNorm running statistics), ``.grad`` (None stays None), ``requires_grad`` and every
submodule's train/eval mode are put back.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["LayerProfile", "Profile", "profile"]


@dataclass(frozen=True)
class LayerProfile:
    """Figures for one layer; times in seconds, sizes in bytes, for one micro-batch (the sample)."""

    index: int
    name: str
    kind: str
    forward_time: float
    backward_time: float
    flops: int
    param_bytes: int
    activation_bytes: int  # its output: what crosses a cut right after it
    saved_bytes: int  # what autograd keeps for its backward (parameters excluded)
    output_shape: tuple[int, ...]
    output_dtype: str


@dataclass
class Profile:
    """The layers' figures plus ``graph``: a DiGraph with a node per layer and bytes on its edges."""

    layers: list[LayerProfile]
    device: str
    graph: nx.DiGraph = field(repr=False)

    def __len__(self) -> int:
        return len(self.layers)


def profile(
    model: nn.Sequential,
    sample: Any,
    *,
    device: torch.device | str | None = None,
    warmup: int = 2,
    repeat: int = 5,
) -> Profile:
    """Profile every layer of ``model`` on ``sample`` (one micro-batch). Raises ``ValueError`` for an
    empty model, bad counts, or a sample the model rejects (naming the layer and its input's shape)."""
    from partitioner.graph import layer_graph

    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"model must be an nn.Sequential, got {type(model).__name__}; wrap the layers in one"
        )
    if len(model) == 0:
        raise ValueError("model is an empty nn.Sequential: there are no layers to profile; add layers")
    if warmup < 0 or repeat < 1:
        raise ValueError(f"warmup ({warmup}) must be >= 0 and repeat ({repeat}) >= 1")
    dev = _model_device(model) if device is None else torch.device(device)
    state = _snapshot(model)
    try:
        model.train()
        layers = [layer if _model_device(layer) == dev else copy.deepcopy(layer).to(dev) for layer in model]
        inputs = _chain_inputs(model, layers, _to(sample, dev))
        names = [name for name, _ in model.named_children()]
        found = [
            _profile_layer(i, names[i], layer, x, dev, warmup, repeat)
            for i, (layer, x) in enumerate(zip(layers, inputs, strict=True))
        ]
    finally:
        _restore(model, state)
    return Profile(found, str(dev), layer_graph(found))


def _chain_inputs(model: nn.Sequential, layers: list[nn.Module], sample: Any) -> list[Any]:
    # One forward pass without autograd, keeping every layer's input; a failure names the layer.
    inputs, x = [], sample
    with torch.no_grad():
        for i, ((name, _), layer) in enumerate(zip(model.named_children(), layers, strict=True)):
            inputs.append(x)
            try:
                x = layer(x)
            except Exception as err:
                raise ValueError(
                    f"layer {i} ({name}: {type(layer).__name__}) rejected its input {_describe(x)}: {err}; "
                    "pass a sample that the model accepts (one micro-batch)"
                ) from err
    return inputs


def _profile_layer(
    i: int, name: str, layer: nn.Module, x: Any, dev: torch.device, warmup: int, repeat: int
) -> LayerProfile:
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    fwd, bwd = [], []
    out: Any = None
    for r in range(warmup + repeat):
        xin = _detached(x)
        _sync(dev)
        t0 = time.perf_counter()
        out = layer(xin)
        _sync(dev)
        t1 = time.perf_counter()
        outs = [t for t in _tensors(out) if t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        _sync(dev)
        t2 = time.perf_counter()
        if r >= warmup:  # first calls (allocation, kernel selection, CUDA start-up) do not count
            fwd.append(t1 - t0)
            bwd.append(t2 - t1 if outs else 0.0)

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:  # a saved weight is not an activation
            saved[storage.data_ptr()] = storage.nbytes()  # views of one storage count once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        held = layer(_detached(x))
    del held
    with FlopCounterMode(display=False) as counter:
        layer(_detached(x))
    first = _tensors(out)[0] if _tensors(out) else None
    return LayerProfile(
        index=i,
        name=name,
        kind=type(layer).__name__,
        forward_time=statistics.median(fwd),
        backward_time=statistics.median(bwd),
        flops=int(counter.get_total_flops()),
        param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
        activation_bytes=sum(t.numel() * t.element_size() for t in _tensors(out)),
        saved_bytes=sum(saved.values()),
        output_shape=tuple(first.shape) if first is not None else (),
        output_dtype=str(first.dtype).removeprefix("torch.") if first is not None else "",
    )


# -- state snapshot and restore --------------------------------------------------------------------


def _snapshot(model: nn.Module) -> dict[str, Any]:
    # Keep the very tensors (p.grad objects included) and copies of their values.
    with torch.no_grad():
        return {
            "params": [
                (
                    p,
                    p.detach().clone(),
                    p.grad,
                    None if p.grad is None else p.grad.detach().clone(),
                    p.requires_grad,
                )
                for p in model.parameters()
            ],
            "buffers": [(b, b.detach().clone()) for b in model.buffers()],
            "modes": [(m, m.training) for m in model.modules()],
        }


def _restore(model: nn.Module, state: dict[str, Any]) -> None:
    with torch.no_grad():
        for p, data, grad, grad_data, req in state["params"]:
            p.copy_(data)
            if grad is not None:
                grad.copy_(grad_data)
            p.grad = grad
            p.requires_grad_(req)
        for b, data in state["buffers"]:
            b.copy_(data)
    for m, training in state["modes"]:
        m.training = training


# -- small helpers ---------------------------------------------------------------------------------


def _model_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    for buf in module.buffers():
        return buf.device
    return torch.device("cpu")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


def _map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(item, fn) for item in x)
    return x


def _detached(x: Any) -> Any:
    return _map(x, lambda t: t.detach().requires_grad_(t.is_floating_point()))


def _to(x: Any, dev: torch.device) -> Any:
    return _map(x, lambda t: t.to(dev))


def _describe(x: Any) -> str:
    ts = _tensors(x)
    if not ts:
        return f"of type {type(x).__name__}"
    return ", ".join(f"of shape {tuple(t.shape)} ({str(t.dtype).removeprefix('torch.')})" for t in ts)
