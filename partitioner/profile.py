"""Per-layer profile of a model, one layer at a time; the model is left exactly as it was.

An ``nn.Sequential``'s layers are its children (below); any other module is traced and its layers
are groups of its calls (``partitioner.graph_profile``), profiled the same way.

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

Times are trusted only as far as their samples allow (``partitioner.noise``): on a shared machine
each is the minimum of adaptive repeats, and one whose samples find no clear floor is blended
toward what its flops predict and named in a warning; when such layers hold most of the time,
every time is what its flops predict. A layer of the same structure as an earlier one, on inputs
of the same shapes, is not measured again: it takes that one's figures (``partitioner._reuse``),
so identical layers cost the same. ``budget`` bounds the time spent timing: past it, a layer of a
new structure is measured untimed and its times are what its flops predict.

Length. Each layer (and the loss) is measured once more, untimed, on its input cut to twice the
rows at half the length (the same tokens): its flops and bytes there tell how they grow with a
micro-batch's length at fixed tokens, attention's as rows x length² (``Profile.probe``,
``partitioner.lengths``). A layer that rejects that input ends the probe (no share: all linear).

``peak_bytes`` is the profile's own peak: the most bytes of tensors it held at once on one device
(the working copy, inputs, two held forwards and their gradients), counted by ``LiveBytes``.
``device_memory`` is what each device it ran on holds beyond such tensors (its matrix products'
workspaces, its allocator's rounding of each layer's tensors: ``partitioner.device_memory``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from partitioner._measure import Rejected, Run
from partitioner._placement import layer_device, normalize, versions, working_copy
from partitioner._profiling import (
    AUTOCAST_DTYPES,
    DEFAULT_BUDGET_S,
    LossFn,
    canonical_names,
    check_autocast,
    check_options,
    check_untouched,
    device_of,
    generators_kept,
    held_names,
    profile_loss,
    rank_threads,
    refuse_ambient_autocast,
    trust,
    uses_cuda,
)
from partitioner._reuse import Layers
from partitioner._trees import describe, nbytes, tree_map
from partitioner.device_memory import Meter
from partitioner.figures import LayerProfile, Profile, ShapeProbe
from partitioner.graph import layer_graph
from partitioner.graph_profile import profile_graph
from partitioner.lengths import probe_layer, probe_loss, probe_shape, sample_shape
from pipeline.runtime.step.live import LiveBytes
from pipeline.runtime.trace.tracing import trace

__all__ = [  # LayerProfile and Profile are figures.py's, the rest _profiling's
    "AUTOCAST_DTYPES",
    "LayerProfile",
    "LossFn",
    "Profile",
    "check_autocast",
    "check_model",
    "profile",
]


def profile(
    model: nn.Module,
    sample: Any,
    *,
    device: torch.device | str | None = None,
    autocast: torch.dtype | None = None,
    loss_fn: LossFn | None = None,
    target: Any = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    warmup: int = 2,
    repeat: int = 10,
    budget: float | None = DEFAULT_BUDGET_S,
    threads: int | None = None,
) -> Profile:
    """Profile every layer of ``model`` on ``sample`` (one micro-batch); see the module docstring.

    Each layer runs ``warmup`` times untimed, then at least ``repeat`` timed samples and more until
    its time settles; its times are the samples' minimum, their spread and floor gap are recorded,
    a time too noisy to trust leans on what its flops predict, and a ``NoisyProfileWarning`` names
    such layers (``Profile.noisy_layers``, ``Profile.trusted``); see ``partitioner.noise``. When the
    noisy layers hold most of the time, every time is what its flops predict (``Profile.from_flops``).

    A layer of the same structure as an earlier one, on inputs of the same shapes, takes that one's
    figures (``LayerProfile.same_as``, ``partitioner._reuse``). ``budget``: seconds after which no
    layer of a new structure is timed (its times are what its flops predict; its bytes and flops are
    still measured); None: no limit. ``threads``: intra-op threads while profiling on CPU (default:
    a launched rank's, ``pipeline.launch.CPU_THREADS``; restored after).

    ``device``: where to profile every layer (default: where each lives); ``loss_fn(output,
    target)``: also profile the loss on the last layer's output (``target``: one micro-batch of
    targets); ``init_fn``: run on each materialised layer of a meta-device model. Raises
    ``ValueError`` for bad arguments and for a layer that rejects its input, naming it.

    Any other module is traced (``pipeline.runtime.trace.tracing``) and profiled one layer group at a
    time on its graph (``partitioner.graph_profile``).
    """
    check_options(autocast, warmup, repeat, loss_fn, budget, threads)  # before a trace: refused at once
    if isinstance(model, nn.Module) and not isinstance(model, nn.Sequential):
        return profile_graph(
            trace(model, sample), sample, device=device, autocast=autocast, loss_fn=loss_fn,
            target=target, init_fn=init_fn, warmup=warmup, repeat=repeat, budget=budget, threads=threads,
        )  # fmt: skip
    check_model(model)
    dev = None if device is None else normalize(device)
    names = canonical_names(model)
    refuse_ambient_autocast()
    start = time.perf_counter()
    deadline = None if budget is None else start + budget
    same = Layers()  # layers profiled once per structure (partitioner._reuse)
    live = LiveBytes()
    meter = Meter(live)
    layers: list[LayerProfile] = []
    devices: list[str] = []
    loss = None
    shape = sample_shape(sample)
    half = probe_shape(shape)  # the length probe's shape (Profile.probe, partitioner.lengths)
    probed: list[LayerProfile] | None = [] if half is not None else None
    cuda = uses_cuda(model, sample, dev)
    with generators_kept(cuda), rank_threads(threads, cuda):
        x = sample
        # every entry, a module that appears twice included (named_children() would skip it)
        for index, (name, layer) in enumerate(model._modules.items()):
            label = f"layer {index} ({name}: {type(layer).__name__})"
            here = layer_device(label, layer, dev, device_of(x))
            meter.on(here)
            with meter.layer():  # what the allocator's rounding adds to this layer's tensors
                with live:
                    x = tree_map(x, lambda t, at=here: t.to(at))  # type: ignore[misc]
                    work = working_copy(layer, here, init_fn)
                before = versions(layer)
                run = Run(here, autocast, warmup, repeat, live, deadline)
                given = x
                try:
                    last = index == len(model._modules) - 1
                    figures, x = same.figures(
                        index, name, type(layer).__name__, work, x, run, first=index == 0, closing=last
                    )
                except Rejected as err:
                    raise ValueError(
                        f"{label} rejected its input {describe(x)}: {err}; "
                        "pass a sample that the model accepts (one micro-batch)"
                    ) from err.__cause__
                if probed is not None and shape is not None:  # the same layer at half the length, if it runs
                    seen = (
                        dataclasses.replace(
                            probed[figures.same_as], index=index, name=name, kind=figures.kind
                        )
                        if figures.same_as is not None and not last  # its structure's: the same there too
                        else probe_layer(
                            index, name, figures.kind, work, given, run, shape, first=index == 0, closing=last
                        )
                    )
                    if seen is None:
                        probed = None
                    else:
                        probed.append(seen)
            del work, given
            check_untouched(label, layer, before)
            layers.append(dataclasses.replace(figures, params=held_names(layer, names)))
            devices.append(str(here))
        probed_loss = None
        if loss_fn is not None:
            run = Run(device_of(x), autocast, warmup, repeat, live, deadline)
            with meter.layer():
                loss = profile_loss(loss_fn, target, x, run)
                if probed is not None and shape is not None:
                    probed_loss = probe_loss(loss_fn, target, x, run, shape)
                    probed = None if probed_loss is None else probed
    layers, loss, noisy, rates, from_flops = trust(layers, loss, repeat, budget)
    return Profile(
        layers,
        ",".join(dict.fromkeys(devices)),
        layer_graph(layers),
        input_bytes=nbytes(sample),
        loss=loss,
        autocast=None if autocast is None else str(autocast).removeprefix("torch."),
        peak_bytes=live.most(),
        seconds=time.perf_counter() - start,
        noisy_layers=noisy,
        seconds_per_flop=rates,
        from_flops=from_flops,
        shape=shape,
        probe=None if probed is None or half is None else ShapeProbe(half, probed, probed_loss),
        device_memory=meter.result(),
    )


def check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model must be an nn.Module (an nn.Sequential, or any module torch.export can trace), got "
            f"{type(model).__name__}"
        )
    if isinstance(model, nn.Sequential) and len(model) == 0:
        raise ValueError("model is an empty nn.Sequential: there are no layers; add layers")
