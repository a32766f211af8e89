"""Memory under a schedule: weights, gradients, optimizer state and held activations.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, s: stage, l: layer, r: rank

ONE model decides whether a plan fits: the per-rank walk (``stage_bytes`` then ``rank_peaks``).
It follows the runtime's holders one by one, so it equals what ``pipe.memory_stats()`` measures
(``pipeline.runtime.step.memory``), each storage once. The solver's rows are derived from it:

    walk  rank r's peak = static_r + max over moments t of  sum over r's stages s, figures f of
                          count[t, s, f] * bytes[s, f]            (linear in the bytes: the order of
                                                                   actions does not depend on them)
    coefficients(sched, modes)[s][f] = max over t of count[t, s, f]   (one walk, unit bytes per slot)
    rows  row s, entry l = static_l + sum over f of coef[s][f] * bound_f[l]      (``layer_bounds``)
          offset_s       = (coef[s][input] + coef[s][output]) * largest cut activation

          walked peak of r  <=  sum over its stages of (row sum over the stage + offset_s)

    exact      per figure: one figure alone peaks at coef[s][f] (v = 1: equal to the walk)
    bounds     figures peaking at different moments (a buffer's peak is not the graphs' peak:
               up to ~30 % on random figures), a stage's first saved input and sent output
               (counted beside its output), chain and grads charging the last layer, the input
               and output at the largest cut; for v >= 2 each chunk at its own max (summed)

So a balance that fits the rows fits the walk: what a run holds never exceeds the limit.

Static bytes (weights, gradients, optimizer state, buffers) have one rule, ``Composition.static``
(``partitioner.composition``): one rank's share under FSDP (``shard``) and tensor parallelism
(``tp``), read by the walk's figures (``stage_bytes``) and the rows' bounds (``layer_bounds``) alike.

Beyond the walk. The walk counts tensor storages (what ``memory_stats`` counts on CPU); a device
holds more, measured once by the profile (``Profile.device_memory``, ``partitioner.device_memory``):
its matrix products' workspaces (cuBLAS/cuBLASLt, two per rank: the forward's thread and autograd's),
its allocator's rounding of each tensor (a fraction of the walk, the worst layer's), and a headroom
left free so that a rank at its limit never makes a failed cudaMalloc flush the allocator's cache
mid-step (10 % on CUDA, ``memory_headroom=``). A rank fits when (``DeviceMemory.usable``)::

    walked peak * (1 + rounding) + workspaces  <=  limit * (1 - headroom)

so the rows are fitted to the usable bytes, not the limit; ``Plan.rank_peaks`` stays the walk
(comparable with ``memory_stats``) and ``Plan.rank_needs`` adds the rest. On CPU all three are 0.

``in_flight`` (peak micro-batches held per stage), ``held`` and ``layer_memory`` are the earlier
count model, kept for their closed forms (``held``: sets and kept inputs per recompute mode).

Per-rank walk. ``stage_bytes`` turns the profile into per-micro-batch figures of each stage
(``StageBytes``: its graph beyond input and output, input, output, a split chain's unsaved
outputs and output gradients, static bytes, and what each kind of compute holds while it runs:
F, a recomputing F, B, a split B, W), counting a storage adjacent layers share once when
given ``saved_io`` (what each layer saves of its input and output). ``rank_peaks`` then runs each
rank's program (``Schedule.program``: compute and comm blocks, receives posted one block ahead,
sends held until the free that a receive proves, the very order the executor runs) and returns, per
rank, static bytes plus the most activation bytes held at once. The walk (``rank_peaks``,
``coefficients``, ``StageBytes``, ``PARTS``) is ``pipeline.schedules.peaks``'s, re-exported here:
the runtime walks it too (a variable-length step's order), and may not import the partitioner.
Recomputation is per stage. The step's data (stage 0's input, the last stage's targets) is not
counted: the caller holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from partitioner.composition import Composition, composition_of
from partitioner.figures import LayerProfile, Profile
from pipeline.runtime.step.recompute import check_mode
from pipeline.schedules.actions import Kind
from pipeline.schedules.peaks import PARTS, StageBytes, coefficients, rank_peaks
from pipeline.schedules.schedule import Schedule

__all__ = [
    "PARTS",
    "StageBytes",
    "coefficients",
    "held",
    "in_flight",
    "layer_bounds",
    "layer_memory",
    "least_bytes",
    "rank_peaks",
    "saved_io",
    "stage_bytes",
]


def in_flight(sched: Schedule) -> list[int]:
    """Peak number of micro-batches whose activations stage s holds, for every stage (k = p * v)."""
    last = Kind.W if sched.split_backward else Kind.B
    live, peak = [0] * sched.n_stages, [0] * sched.n_stages
    for actions in sched.compute:
        for a in actions:
            if a.kind is Kind.F:
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind is last:
                live[a.stage] -= 1
    return peak


def held(recompute: str, n_microbatches: int, in_flight_counts: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per stage, (activation sets, stage inputs) kept at the peak under ``recompute``; see above."""
    check_mode(recompute)
    if recompute == "never" or (recompute == "except_last" and n_microbatches < 2):
        return list(in_flight_counts), [0] * len(in_flight_counts)
    most = 1 if recompute == "always" else 2
    return [min(most, n) for n in in_flight_counts], list(in_flight_counts)


def layer_memory(
    param_bytes: Sequence[int],
    saved_bytes: Sequence[int],
    sets: Sequence[int],
    optimizer_state_factor: float,
    *,
    buffer_bytes: Sequence[int] | None = None,
    cache_bytes: Sequence[int] | None = None,
) -> list[list[float]]:
    """Row s, entry l: bytes layer l costs when it sits on stage s, which keeps ``sets[s]``
    activation sets (the rows ``solve`` takes; a recomputing stage's inputs come on top)."""
    if not optimizer_state_factor >= 0:
        raise ValueError(
            f"optimizer_state_factor ({optimizer_state_factor!r}) must be >= 0: bytes of optimizer state "
            "per parameter byte (2.0 for Adam, 1.0 for SGD with momentum, 0.0 for plain SGD)"
        )
    zeros = [0] * len(param_bytes)
    other = np.asarray(buffer_bytes or zeros, np.float64) + np.asarray(cache_bytes or zeros, np.float64)
    rule = Composition(optimizer_state_factor=optimizer_state_factor)  # one rank holding it all
    static = rule.static(np.asarray(param_bytes, np.float64), 0.0, other)
    saved = np.asarray(saved_bytes, np.float64)
    if saved.shape != static.shape:
        raise ValueError(f"saved_bytes has {len(saved)} entries, param_bytes {len(static)}; one per layer")
    rows: dict[int, list[float]] = {n: (static + saved * float(n)).tolist() for n in set(sets)}
    return [rows[n] for n in sets]


# ---- the figures the per-rank walk holds (the walk: ``pipeline.schedules.peaks``)


def stage_bytes(
    profile: Profile,
    balance: Sequence[int],
    optimizer_state_factor: float | Composition = 2.0,
    saved_io: Sequence[tuple[int, int]] | None = None,
) -> list[StageBytes]:
    """Per stage of ``balance``: the figures ``rank_peaks`` walks, from the profile's layers (and loss).

    ``optimizer_state_factor``: the optimizer's bytes per parameter byte, or a ``Composition`` (with
    FSDP and tensor parallelism: its ``static`` is every layer's static bytes on one rank).

    ``saved_io[l]``: bytes of layer l's input and of its output that layer l saves (the loss's
    entry, after the layers': its input and its target); with them a storage two adjacent layers
    save (a ReLU's output, the next Linear's input) counts once, and the step's data not at all.
    Without them (None) they are read from the profile when it records them (``LayerProfile``
    fields ``saved_input_bytes`` and ``saved_output_bytes``; the loss's ``saved_input_bytes`` and
    ``saved_target_bytes``), else every layer's saved bytes are taken as its own: an upper bound.

    A layer whose output is its input's storage (``output_aliases_input``: ``nn.Flatten``, a
    reshape, an in-place op) makes the tensors before and after it one storage: counted once, at
    the most any holder (the stage's input or output buffer, a layer saving it, the split chain)
    has of it; likewise the gradients where a layer's backward returns a view of its output's
    gradient (``input_grad_aliases``), the sent input gradient then held until W.
    """
    layers = list(profile.layers)
    rule = composition_of(optimizer_state_factor)
    io = list(saved_io) if saved_io is not None else _recorded_io(profile)
    if len(io) == len(layers):
        io.append((0, 0))
    loss = profile.loss
    out: list[StageBytes] = []
    start, k = 0, len(balance)
    for s, size in enumerate(balance):
        stop, last = start + size, s == k - 1
        lps = layers[start:stop]
        inp = 0.0 if s == 0 else float(layers[start - 1].activation_bytes)
        output = 0.0 if last else float(lps[-1].activation_bytes)
        saved = float(sum(lp.saved_bytes for lp in lps))
        if last and loss is not None:  # the loss: its input once (below), its target (the step's data) never
            saved += loss.saved_bytes - io[-1][1]
        chain = 0.0
        storages = _storages(layers, start, stop)
        for group in storages:
            # per layer, what it saves of this storage: an aliasing layer's input and output are it
            savers = [float(io[j - 1][1]) for j in group if j > start and j - 1 not in group]
            savers += [float(max(io[j]) if j + 1 in group else io[j][0]) for j in group if j < stop]
            if last and loss is not None and group[-1] == stop:
                savers.append(float(io[-1][0]))
            # what the stage holds of this storage anyway: its input (stage 0: the step's data,
            # never counted) or the output it sends
            held = max(float("inf") if s == 0 and start in group else inp if start in group else 0.0,
                       output if stop in group else 0.0)  # fmt: skip
            saved -= sum(savers) - max(max(savers, default=0.0) - held, 0.0)
            inner = [j for j in group if start < j < stop]
            if inner and not held and max(savers) == 0:  # a split chain keeps what no layer saves
                chain += max(float(layers[j - 1].activation_bytes) for j in inner)
        view = not last and storages[0][-1] == stop  # it sends a view of its input: that storage
        # split backward: one gradient per storage of its layers' outputs, held from B to W; the
        # one that is the input's gradient (a view's backward) is the sent one, kept until W
        grads, kept = 0.0, False
        for group in _storages(layers, start, stop, "input_grad_aliases"):
            inner = [j for j in group if start < j < stop]
            if not inner or (stop in group and not last):  # the input's gradient, the received one
                continue
            most = max(float(layers[j - 1].activation_bytes) for j in inner)
            if start in group and s > 0 and most >= inp:  # (held longer: never more than before)
                kept = True
                continue
            grads += most
        static = sum(rule.static_of(lp) for lp in lps)
        moments = _transients(layers, loss if last else None, io, start, stop)
        scalar = float(loss.activation_bytes) if last and loss is not None else 0.0
        # the last stage holds its loss as its graph's root (F to B, W when split), the loss's gradient
        # from B (to W when split), and a copy of each loss to the step's end (``StageBytes.kept``)
        figures = (max(saved, 0.0) + scalar, inp, output, chain, grads + scalar, static, kept, view, scalar)
        out.append(StageBytes(*figures, *moments))
        start = stop
    return out


def _transients(
    layers: Sequence[LayerProfile],
    loss: LayerProfile | None,
    io: Sequence[tuple[int, int]],
    start: int,
    stop: int,
) -> tuple[float, float, float, float, float]:
    """Stage [start, stop)'s momentary bytes on top of what the walk holds: (forward, backward,
    a split backward's B, its W, a recomputing F).

    While layer j runs, the walk holds all the stage saves, but what the layers after j save is not
    there yet (forward) or already freed (backward): only layer j's excess over that counts. In
    backward, layer j also reads its output's gradient (the last layer's is the received one,
    counted by the walk). Each layer's own saved bytes leave out what it shares with the layer
    before (one storage: still held by that layer's graph when this one's is freed).

    Under a loss the last layer's output is held by its graph alone and its gradient is the loss's
    (freed once read, the output once the op saving it has run): its ``closing_*`` figures, no
    read added; the loss's own gradient (ones, made by the stage) is held through the whole B. A
    split B frees nothing (its graphs are retained for W) and keeps each output gradient it makes:
    layer j runs beside its own and every later layer's (no excess over the later layers' saved
    bytes, none being freed). W runs layer by layer with every output gradient held (``grads``, the received
    one) and each graph still whole when its layer's turn comes: a layer's W figure alone. A
    recomputing F keeps no graph: layer j's input (the previous layer's output), transient and
    output at once."""
    figures = [*layers[start:stop], *([loss] if loss is not None else [])]
    closing = stop - 1 - start if loss is not None else -1  # the loss's layer, within figures
    own = []
    for k, lp in enumerate(figures):
        g = start + k  # the loss: io's last entry
        shared = min(io[g - 1][1], io[g][0]) if g > start else 0
        own.append(float(lp.saved_bytes - shared - (io[g][1] if lp is loss else 0)))
    later = [sum(own[k + 1 :]) for k in range(len(figures))]
    reads = [float(lp.activation_bytes) for lp in figures[:-1]] + [0.0]
    if closing >= 0:
        reads[closing] = 0.0  # the loss's gradient: inside the closing figures
    # a split B keeps every output gradient it has made for W and frees no graph (retain_graph):
    # layer j runs beside the gradients of its own output and of every later inner output
    kept = [sum(reads[k:]) for k in range(len(figures))]
    # under a loss, the gradient it starts from (ones, the loss's size) lives through all of B
    ones = float(loss.activation_bytes) if loss is not None else 0.0

    def part(field: str) -> list[float]:
        # the loss's node runs in B and again in W: its whole backward is its figure in both
        mine = [float(getattr(lp, ("closing_" if k == closing else "") + field))
                for k, lp in enumerate(figures)]  # fmt: skip
        if loss is not None and field != "backward_transient_bytes":
            mine[-1] = float(max(loss.backward_transient_bytes, loss.input_transient_bytes))
        return mine

    pairs = zip(figures, later, strict=True)
    forward = max(max(lp.forward_transient_bytes - after, 0.0) for lp, after in pairs)
    each = [max(b + g - after, 0.0) + ones
            for b, g, after in zip(part("backward_transient_bytes"), reads, later, strict=True)]  # fmt: skip
    inputs = [b + g + ones for b, g in zip(part("input_transient_bytes"), kept, strict=True)]
    # a split B on stage 0 runs no backward for its first layer (no gradient for the step's data)
    input_grad = max(inputs[1:], default=0.0) if start == 0 else max(inputs)
    weight = max(part("weight_transient_bytes"))
    outs = [0.0 if lp.output_aliases_input else float(lp.activation_bytes) for lp in figures]
    before = [0.0, *(float(lp.activation_bytes) for lp in figures[:-1])]  # the stage's input: held
    recompute = max(b + _no_grad(lp, o) for lp, b, o in zip(figures, before, outs, strict=True))
    return forward, max(each), input_grad, weight, recompute


def _no_grad(lp: LayerProfile, output: float) -> float:
    """The most layer ``lp``'s forward holds at once under no_grad (a recomputing F), its output
    included: measured (``no_grad_forward_bytes``: what Python still refers to, which a graph would
    have saved), and never below its transient and ``output`` (a profile without that figure)."""
    return max(float(lp.forward_transient_bytes) + output, float(lp.no_grad_forward_bytes))


def _storages(
    layers: Sequence[Any], start: int, stop: int, joins: str = "output_aliases_input"
) -> list[list[int]]:
    """The tensors between the layers of stage [start, stop) grouped by storage: tensor j is layer
    j's input (j = start: the stage's input, j = stop: its output); a layer whose output is its
    input's storage (``output_aliases_input``: a view, an in-place op) joins j and j + 1. With
    ``joins="input_grad_aliases"``: their gradients, joined where a layer's backward is a view."""
    groups = [[start]]
    for j in range(start, stop):
        if getattr(layers[j], joins, False):
            groups[-1].append(j + 1)
        else:
            groups.append([j + 1])
    return groups


def layer_bounds(profile: Profile, optimizer_state_factor: float | Composition) -> dict[str, list[float]]:
    """Per layer l (the loss's figures on the last), what it adds to each figure of ``stage_bytes``
    at most, whichever stage holds it: ``static``, ``saved`` (its saved bytes less the storage it
    shares with layer l - 1, never below 0), ``chain``, ``grads``; and ``least``, what it adds at
    least to the walked peak (its static bytes). A stage [a, b) then has, per micro-batch::

        saved(a, b) <= sum of saved_l     chain(a, b) <= sum of chain_l     grads(a, b) <= sum of act_l

    (stage_bytes subtracts its first layer's whole saved input, and the output it sends, where this
    subtracts only the share with the previous layer; chain and grads leave out its last layer).
    The transients (``transient_forward``, ``_backward``, ``_input_grad``, ``_weight``,
    ``_recompute``): a stage's are the most of its layers', so at most their sum; per layer its
    figure plus the output gradient it may read (backward, B), its input and output beside (a
    recomputing F), on the last layer the most of that, its closing figure and the loss's."""
    layers = list(profile.layers)
    n, loss, rule = len(layers), profile.loss, composition_of(optimizer_state_factor)
    io = np.asarray(_recorded_io(profile), np.float64).reshape(-1, 2)
    ins, outs = io[:n, 0], io[:n, 1]

    def column(name: str) -> np.ndarray:
        return np.asarray([getattr(lp, name) for lp in layers], np.float64)

    act = column("activation_bytes")
    shared = np.minimum(np.concatenate([[np.inf], outs[:-1]]), ins)  # with layer l - 1; all of layer 0's
    own = column("saved_bytes") - shared
    least = _least(layers, rule)
    static = least.copy()
    if loss is not None:  # the loss's figures on the last layer: its input once, its target never
        own[-1] += loss.saved_bytes - min(outs[-1], io[-1, 0]) - io[-1, 1]
        static[-1] += rule.static_of(loss)
    unsaved = np.zeros(n, bool)
    unsaved[:-1] = (outs[:-1] == 0) & (ins[1:] == 0)  # a split chain keeps this output itself
    forward = column("forward_transient_bytes")
    backward = column("backward_transient_bytes") + act  # the most: it reads its output's gradient
    input_grad = column("input_transient_bytes") + act
    weight = column("weight_transient_bytes")
    outs = np.where(column("output_aliases_input") > 0, 0.0, act)
    no_grad = np.asarray([_no_grad(lp, o) for lp, o in zip(layers, outs, strict=True)], np.float64)
    recompute = np.concatenate([[0.0], act[:-1]]) + no_grad  # its input beside its forward's most
    root = np.zeros(n)  # the loss, on the last layer
    if loss is not None:  # the last layer's closing figures (under the loss) and the loss's own
        last, scalar = layers[-1], float(loss.activation_bytes)
        root[-1] = scalar  # held as the graph's root; its gradient through B (and to W: grads)
        lossb = max(loss.backward_transient_bytes, loss.input_transient_bytes)
        forward[-1] = max(forward[-1], loss.forward_transient_bytes)
        backward[-1] = max(backward[-1], last.closing_backward_transient_bytes, loss.backward_transient_bytes)
        backward[-1] += scalar
        input_grad[-1] = max(input_grad[-1], last.closing_input_transient_bytes, lossb) + scalar
        weight[-1] = max(weight[-1], last.closing_weight_transient_bytes, lossb)
        recompute[-1] = max(recompute[-1], act[-1] + _no_grad(loss, float(loss.activation_bytes)))
    return {
        "static": static.tolist(),
        "transient_forward": forward.tolist(),
        "transient_backward": backward.tolist(),
        "transient_input_grad": input_grad.tolist(),
        "transient_weight": weight.tolist(),
        "transient_recompute": recompute.tolist(),
        "saved": (np.maximum(own, 0.0) + root).tolist(),
        "chain": np.where(unsaved, act, 0.0).tolist(),
        "grads": (act + root).tolist(),
        "least": least.tolist(),
    }


def least_bytes(profile: Profile, optimizer_state_factor: float | Composition) -> list[float]:
    """``layer_bounds``' "least" alone (what every static check reads), without its other bounds."""
    least: list[float] = _least(list(profile.layers), composition_of(optimizer_state_factor)).tolist()
    return least


def _least(layers: list[LayerProfile], rule: Composition) -> np.ndarray:
    """Per layer, its static bytes (``Composition.static_of``: what the walk's figures charge it)."""
    return np.asarray([rule.static_of(lp) for lp in layers], np.float64)


def _recorded_io(profile: Profile) -> list[tuple[int, int]]:
    """``saved_io`` as the profile records it, or zeros (nothing known to be shared)."""
    layers = profile.layers
    io = [(getattr(lp, "saved_input_bytes", 0), getattr(lp, "saved_output_bytes", 0)) for lp in layers]
    loss = profile.loss
    io.append((getattr(loss, "saved_input_bytes", 0), getattr(loss, "saved_target_bytes", 0)))
    return io


def saved_io(
    model: nn.Sequential, sample: Any, loss_fn: Any = None, target: Any = None
) -> list[tuple[int, int]]:
    """Per layer of ``model`` (then the loss, when given): bytes of its input and of its output
    that it saves for backward, from one forward of ``sample`` (what ``stage_bytes`` takes)."""
    found: list[tuple[int, int]] = []

    def ptrs(x: Any) -> dict[int, int]:
        ts = [x] if isinstance(x, torch.Tensor) else [t for t in x if isinstance(t, torch.Tensor)]
        return {t.untyped_storage().data_ptr(): t.nelement() * t.element_size() for t in ts}

    def run(fn: Any, x: Any, y: Any = None) -> Any:
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(x) if y is None else fn(x, y)
        ins, outs = ptrs(x), ptrs(out) if y is None else ptrs(y)
        found.append(tuple(sum(n for key, n in d.items() if key in seen) for d in (ins, outs)))  # type: ignore[arg-type]
        return out

    with torch.enable_grad():
        x = sample.clone() if isinstance(sample, torch.Tensor) else sample
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x.requires_grad_(True)
        for layer in model:
            x = run(layer, x)
        if loss_fn is not None:
            run(loss_fn, x, target)
    return found
