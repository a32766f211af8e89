"""Per-layer profile of an ``nn.Sequential``, one layer at a time; the model is left exactly as it was.

    # l: layer, n: layers

The layers are profiled in order, each on its own working copy (``_placement``), so at most
one layer's worth of memory is added at any time, whatever the model's size::

    sample -> [copy of layer 0] -> x1 -> [copy of layer 1] -> x2 ... -> [copy of layer n-1] -> out
              made, measured,           made, measured,                                     -> [loss]
              dropped                   dropped

and each layer's output (from an untimed forward) is the next one's input, moved to where the
next layer is profiled. A model spread over devices is profiled where each layer lives; a
meta-device model is materialised one layer at a time on ``device``. What is measured for each
layer, and how, is ``_measure``'s: forward, whole backward, input and weight gradients timed
separately, bytes saved per micro-batch and once per step, flops of every op.

``autocast`` (``torch.bfloat16`` or ``torch.float16``; None = fp32) is the run's precision: each
layer runs in one autocast region, as a pipeline step does. Call ``profile`` outside any
``torch.autocast``: it sets the precision itself.

Exactly as it was: the model's modules never run (parameters, buffers, ``.grad``, modes and
``requires_grad`` are untouched; a layer that writes into its own parameters is named in an
error), and the CPU and CUDA generators' states are put back, so dropout draws nothing from them.

``peak_bytes`` is the profile's own peak: the most bytes of tensors it held at once on one device
(the working copy, inputs, two held forwards and their gradients), counted by ``LiveBytes``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import nn

from partitioner._measure import Rejected, Run, WithTarget, measure
from partitioner._placement import changed_parameters, layer_device, normalize, versions, working_copy
from partitioner._trees import describe, nbytes, tensors, tree_map
from partitioner.figures import LayerProfile
from partitioner.graph import layer_graph
from partitioner.live import LiveBytes

__all__ = ["AUTOCAST_DTYPES", "LayerProfile", "Profile", "profile"]  # LayerProfile is figures.py's

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class Profile:
    """The layers' figures plus ``graph``: a DiGraph with a node per layer and bytes on its edges.

    ``input_bytes`` is the sample's size (what stage 0 keeps per micro-batch when it recomputes);
    ``loss`` the loss's figures when profiled with a ``loss_fn`` (the last stage runs it);
    ``autocast`` the dtype name it ran under (None: fp32); ``peak_bytes`` and ``seconds`` what
    profiling itself took.
    """

    layers: list[LayerProfile]
    device: str
    graph: nx.DiGraph = field(repr=False)
    input_bytes: int = 0
    loss: LayerProfile | None = None
    autocast: str | None = None
    peak_bytes: int = 0
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.layers)


def profile(
    model: nn.Sequential,
    sample: Any,
    *,
    device: torch.device | str | None = None,
    autocast: torch.dtype | None = None,
    loss_fn: LossFn | None = None,
    target: Any = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    warmup: int = 2,
    repeat: int = 5,
) -> Profile:
    """Profile every layer of ``model`` on ``sample`` (one micro-batch); see the module docstring.

    ``device``: where to profile every layer (default: where each lives); ``loss_fn(output,
    target)``: also profile the loss on the last layer's output (``target``: one micro-batch of
    targets); ``init_fn``: run on each materialised layer of a meta-device model. Raises
    ``ValueError`` for bad arguments and for a layer that rejects its input, naming it.
    """
    check_model(model)
    check_autocast(autocast)
    for label, count, least in (("warmup", warmup, 0), ("repeat", repeat, 1)):
        if isinstance(count, bool) or not isinstance(count, int) or count < least:
            raise ValueError(f"{label} ({count!r}) must be an integer >= {least}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
    dev = None if device is None else normalize(device)
    _refuse_ambient_autocast()
    start = time.perf_counter()
    live = LiveBytes()
    layers: list[LayerProfile] = []
    devices: list[str] = []
    loss = None
    with _generators_kept(_uses_cuda(model, sample, dev)):
        x = sample
        for index, (name, layer) in enumerate(model.named_children()):
            label = f"layer {index} ({name}: {type(layer).__name__})"
            here = layer_device(label, layer, dev, _device_of(x))
            with live:
                x = tree_map(x, lambda t, at=here: t.to(at))  # type: ignore[misc]
                work = working_copy(layer, here, init_fn)
            before = versions(layer)
            run = Run(here, autocast, warmup, repeat, live)
            try:
                figures, x = measure(index, name, type(layer).__name__, work, work, x, run, first=index == 0)
            except Rejected as err:
                raise ValueError(
                    f"{label} rejected its input {describe(x)}: {err}; "
                    "pass a sample that the model accepts (one micro-batch)"
                ) from err.__cause__
            del work
            _check_untouched(label, layer, before)
            layers.append(figures)
            devices.append(str(here))
        if loss_fn is not None:
            loss = _profile_loss(loss_fn, target, x, Run(_device_of(x), autocast, warmup, repeat, live))
    return Profile(
        layers,
        ",".join(dict.fromkeys(devices)),
        layer_graph(layers),
        input_bytes=nbytes(sample),
        loss=loss,
        autocast=None if autocast is None else str(autocast).removeprefix("torch."),
        peak_bytes=live.most(),
        seconds=time.perf_counter() - start,
    )


def check_model(model: object) -> None:
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"model must be an nn.Sequential, got {type(model).__name__}; wrap the layers in one"
        )
    if len(model) == 0:
        raise ValueError("model is an empty nn.Sequential: there are no layers; add layers")


def check_autocast(autocast: object) -> None:
    if autocast is not None and autocast not in AUTOCAST_DTYPES:
        raise ValueError(
            f"autocast ({autocast!r}) must be torch.bfloat16, torch.float16 or None (fp32): "
            "the dtype the run's torch.autocast uses"
        )


def _profile_loss(loss_fn: LossFn, target: Any, out: Any, run: Run) -> LayerProfile:
    target = tree_map(target, lambda t: t.to(run.device))

    def loss(pair: tuple[Any, Any]) -> torch.Tensor:
        value = loss_fn(*pair)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"loss_fn must return a scalar (0-dim) tensor, got {shape}; reduce it, e.g. with .mean()"
            )
        return value

    module = loss_fn if isinstance(loss_fn, nn.Module) else None
    kind = type(loss_fn).__name__
    try:
        figures, _ = measure(-1, "loss", kind, loss, module, WithTarget(out, target), run, first=False)
    except Rejected as err:
        raise ValueError(
            f"loss_fn rejected the last layer's output {describe(out)} with target {describe(target)}: "
            f"{err}; pass target= (one micro-batch of targets) that loss_fn accepts"
        ) from err.__cause__
    return figures


def _check_untouched(label: str, layer: nn.Module, before: list[int]) -> None:
    changed = changed_parameters(layer, before)
    if changed:
        raise ValueError(
            f"{label} wrote into its own parameters ({', '.join(changed)}) while it was profiled, so "
            "the model is not as it was; a forward must not modify parameters in place"
        )


def _refuse_ambient_autocast() -> None:
    for kind in ("cpu", "cuda"):
        if torch.is_autocast_enabled(kind):
            raise ValueError(
                f"profile() was called inside torch.autocast on {kind}: it sets the run's precision "
                "itself; call it outside the autocast region and pass autocast=<the region's dtype>"
            )


def _device_of(x: Any) -> torch.device:
    found = tensors(x)
    return normalize(found[0].device) if found else torch.device("cpu")


def _uses_cuda(model: nn.Module, sample: Any, dev: torch.device | None) -> bool:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return True
    held = itertools.chain(model.parameters(), model.buffers(), tensors(sample))
    return (dev is not None and dev.type == "cuda") or any(t.is_cuda for t in held)


@contextlib.contextmanager
def _generators_kept(cuda: bool) -> Iterator[None]:
    """The CPU generator's state, and every CUDA device's, are put back on the way out."""
    cpu = torch.get_rng_state()
    gpus = torch.cuda.get_rng_state_all() if cuda else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if gpus is not None:
            torch.cuda.set_rng_state_all(gpus)
