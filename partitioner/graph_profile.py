"""Per-layer profile of a traced model: each layer (a group of its calls) alone, on a working copy.

    # n: layers, l: layer

A traced model (``pipeline.runtime.trace.tracing``) has layers that read any earlier layer's tensors
and the model's inputs, not just the previous layer's output. Layer l is profiled as its own
small graph (``pipeline.runtime.trace.traced.layer_spec``): it takes the tensors its calls read from
outside it and gives those it makes that are read later; these are kept by name, each until its
last reader is profiled::

    inputs --> [layer 0] --> a ----------------------.
                          \\-> b --> [layer 1] --> c --> [layer 2](a, c) --> out --> [loss]

Each layer runs on a working copy of the modules it reads (``_placement.working_copy``:
parameters share the model's storage, buffers are copied, a meta model is materialised there),
measured as ``profile`` measures an ``nn.Sequential``'s layers (``_measure``; once per structure,
``_reuse``), and the model is left as it was. The layer graph's edges name the tensors
(``partitioner.graph``), so a cut costs every tensor live across it, a long skip once per cut it
crosses. ``cut_reasons`` says where no cut may fall (``pipeline.runtime.trace.layers.cut_blocks``),
and ``traced`` what a plan records.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from partitioner._measure import Rejected, Run
from partitioner._placement import layer_device, normalize, versions, working_copy
from partitioner._profiling import (
    DEFAULT_BUDGET_S,
    LossFn,
    canonical_names,
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
from partitioner._trees import describe, nbytes
from partitioner.device_memory import Meter
from partitioner.figures import LayerProfile, Profile
from partitioner.graph import layer_graph
from partitioner.lengths import sample_shape
from pipeline.runtime.step.live import LiveBytes
from pipeline.runtime.trace.layers import cut_blocks
from pipeline.runtime.trace.traced import build, holder, layer_spec
from pipeline.runtime.trace.tracing import Traced

__all__ = ["profile_graph", "traced_record"]


def profile_graph(
    traced: Traced,
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
    """Profile every layer of ``traced`` on ``sample`` (the one it was traced with); see the docstring.

    The options are ``partitioner.profile``'s.
    """
    check_options(autocast, warmup, repeat, loss_fn, budget, threads)
    dev = None if device is None else normalize(device)
    refuse_ambient_autocast()
    start = time.perf_counter()
    deadline = None if budget is None else start + budget
    same = Layers()  # layers profiled once per structure (partitioner._reuse)
    live = LiveBytes()
    meter = Meter(live)  # the device's workspaces and rounding (partitioner.device_memory)
    names = canonical_names(traced.root)
    env: dict[str, Any] = dict(
        zip(traced.inputs, sample if isinstance(sample, tuple) else (sample,), strict=True)
    )
    layers: list[LayerProfile] = []
    devices: list[str] = []
    loss = None
    cuda = uses_cuda(traced.root, sample, dev)
    with generators_kept(cuda), rank_threads(threads, cuda):
        for index, layer in enumerate(traced.layers):
            spec = layer_spec(traced, index)
            label = f"layer {index} ({layer.name}: {layer.kind})"
            held = holder(traced.root, layer.params, traced.constants)
            given = [env[name] for name in spec.inputs]
            here = layer_device(label, held, dev, device_of(given))
            meter.on(here)
            with meter.layer():
                with live:
                    moved = [t.to(here) for t in given]
                    work = build(traced, spec, working_copy(held, here, init_fn), here)
                x = moved[0] if len(moved) == 1 else tuple(moved)
                before = versions(held)
                run = Run(here, autocast, warmup, repeat, live, deadline)
                first = all(name in traced.inputs for name in spec.inputs)
                try:
                    last = index == len(traced.layers) - 1
                    figures, out = same.figures(
                        index, layer.name, layer.kind, work, x, run, first=first, closing=last
                    )
                except Rejected as err:
                    raise ValueError(
                        f"{label} rejected its input {describe(x)}: {err}; pass the sample the model was "
                        "traced with (one micro-batch)"
                    ) from err.__cause__
            del work
            check_untouched(label, held, before)
            outs = out if isinstance(out, tuple) else (out,)
            env.update(zip(spec.outputs or (), outs, strict=True))
            for name in [n for n in env if traced.values[n].last <= index and n not in traced.inputs]:
                del env[name]  # no later layer reads it (the inputs stay: their sizes may be read)
            layers.append(dataclasses.replace(figures, params=held_names(held, names)))
            devices.append(str(here))
        if loss_fn is not None:
            flat = [
                env[name] if name is not None else traced.out_constants[j]
                for j, name in enumerate(traced.outputs)
            ]
            out = pytree.tree_unflatten(flat, traced.out_spec)
            run = Run(device_of(flat), autocast, warmup, repeat, live, deadline)
            with meter.layer():
                loss = profile_loss(loss_fn, target, out, run)
    tensors = [(v.name, v.layer, v.uses, v.nbytes) for v in traced.values.values()]
    layers, loss, noisy, rates, from_flops = trust(layers, loss, repeat, budget)
    return Profile(
        layers,
        ",".join(dict.fromkeys(devices)),
        layer_graph(layers, tensors=tensors),
        input_bytes=nbytes(sample),
        loss=loss,
        autocast=None if autocast is None else str(autocast).removeprefix("torch."),
        peak_bytes=live.most(),
        seconds=time.perf_counter() - start,
        noisy_layers=noisy,
        seconds_per_flop=rates,
        from_flops=from_flops,
        cut_reasons=cut_blocks(traced.graph, traced.layers, traced.values, traced.root),
        traced=traced_record(traced),
        shape=sample_shape(sample),  # no length probe: a traced graph may hold the sample's sizes
        device_memory=meter.result(),
    )


def traced_record(traced: Traced) -> dict[str, Any]:
    """What a plan keeps of the trace: how, its fingerprint, the sample's signature (JSON-friendly)."""
    return {
        "method": traced.method,
        "fingerprint": traced.fingerprint,
        "sample": [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in traced.signature],
        "stages": traced.stages,  # what its layers were grouped for: each rank groups them so again
    }
