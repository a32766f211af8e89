"""Per-layer profile of an ``nn.Sequential``: time, flops, bytes; the model is left exactly as it was.

    # l: layer, n: layers

Each layer l is run on the output of layer l - 1 (detached, so its backward stops at the layer):

    sample -> layer 0 -> x1 -> layer 1 -> x2 ... -> layer n-1 -> out
              |---------|     |---------|
              timed fwd+bwd   timed fwd+bwd      (warm-up runs first, then medians of `repeat`)

The backward is timed twice: whole, and for the layer's input alone (``autograd.grad`` to the
input computes no parameter gradient); their difference is the weight-gradient part, what a
split-backward schedule such as zb-h1 runs later as W.

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

from partitioner.figures import LayerProfile
from partitioner.graph import layer_graph

__all__ = ["LayerProfile", "Profile", "profile"]  # LayerProfile is defined in partitioner.figures


@dataclass
class Profile:
    """The layers' figures plus ``graph``: a DiGraph with a node per layer and bytes on its edges.

    ``input_bytes`` is the sample's size: what stage 0 keeps per micro-batch when it recomputes.
    """

    layers: list[LayerProfile]
    device: str
    graph: nx.DiGraph = field(repr=False)
    input_bytes: int = 0

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
            _profile_layer(index, names[index], layer, x, dev, warmup, repeat)
            for index, (layer, x) in enumerate(zip(layers, inputs, strict=True))
        ]
    finally:
        _restore(model, state)
    return Profile(found, str(dev), layer_graph(found), input_bytes=_nbytes(sample))


def _chain_inputs(model: nn.Sequential, layers: list[nn.Module], sample: Any) -> list[Any]:
    # One forward pass without autograd, keeping every layer's input; a failure names the layer.
    inputs, x = [], sample
    with torch.no_grad():
        for index, ((name, _), layer) in enumerate(zip(model.named_children(), layers, strict=True)):
            inputs.append(x)
            try:
                x = layer(x)
            except Exception as err:
                raise ValueError(
                    f"layer {index} ({name}: {type(layer).__name__}) rejected its input "
                    f"{_describe(x)}: {err}; "
                    "pass a sample that the model accepts (one micro-batch)"
                ) from err
    return inputs


def _profile_layer(
    index: int, name: str, layer: nn.Module, x: Any, dev: torch.device, warmup: int, repeat: int
) -> LayerProfile:
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    fwd, bwd, bwd_input = [], [], []
    out: Any = None
    for run in range(warmup + repeat):
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
        input_only = _input_backward_time(layer, x, dev)
        if run >= warmup:  # first calls (allocation, kernel selection, CUDA start-up) do not count
            fwd.append(t1 - t0)
            bwd.append(t2 - t1 if outs else 0.0)
            bwd_input.append(input_only)

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
    backward = statistics.median(bwd)
    has_params = any(p.requires_grad for p in layer.parameters())
    # The two medians are separate measurements: clamp their difference into [0, backward].
    weight = min(backward, max(0.0, backward - statistics.median(bwd_input))) if has_params else 0.0
    return LayerProfile(
        index=index,
        name=name,
        kind=type(layer).__name__,
        forward_time=statistics.median(fwd),
        backward_time=backward,
        flops=int(counter.get_total_flops()),
        param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
        activation_bytes=_nbytes(out),
        saved_bytes=sum(saved.values()),
        output_shape=tuple(first.shape) if first is not None else (),
        output_dtype=str(first.dtype).removeprefix("torch.") if first is not None else "",
        weight_time=weight,
    )


def _input_backward_time(layer: nn.Module, x: Any, dev: torch.device) -> float:
    """Seconds of the backward to the layer's input alone (0 when no input takes a gradient)."""
    xin = _detached(x)
    wanted = [t for t in _tensors(xin) if t.requires_grad]
    outs = [t for t in _tensors(layer(xin)) if t.requires_grad]
    if not wanted or not outs:
        return 0.0
    _sync(dev)
    t0 = time.perf_counter()
    torch.autograd.grad(outs, wanted, [torch.ones_like(t) for t in outs], allow_unused=True)
    _sync(dev)
    return time.perf_counter() - t0


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


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def _describe(x: Any) -> str:
    ts = _tensors(x)
    if not ts:
        return f"of type {type(x).__name__}"
    return ", ".join(f"of shape {tuple(t.shape)} ({str(t.dtype).removeprefix('torch.')})" for t in ts)
