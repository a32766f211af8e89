"""A profile taken at one batch size, scaled to another: what the auto search prices each m with.

    # l: layer, r: rows of a micro-batch (its batch size), B: rows of one step, m: micro-batches

The auto search profiles one ``sample`` (any number of rows r0) and needs every layer's figures
at r = B / m rows for each candidate m. The model, per layer and figure::

    time(r)  = c + s * r        c >= 0: a fixed per-call overhead (kernel launches, Python)
    bytes(r) = c + s * r        c >= 0: a fixed part (the weights' gradients a backward makes, a
                                tensor made from the weights), s: per row (activations, saved tensors)
    flops(r) = flops(r0) * r / r0        (forward, backward and its input and weight parts)
    timing estimates (spread, prior): kept as measured at r0, describing the measurement
    parameters, buffers and autocast's weight copies: unchanged
    the allocator's rounding, a fraction of the bytes: * r0 / r when r < r0 (a tensor's rounding
    is fixed, its bytes shrink), unchanged when r > r0 (an upper bound)
    the sample's shape (r0, L) and the length probe's (2 r0, L / 2): r0 to r, its figures per row

With one profile, a time's c = 0 (simply linear). Given a second profile of the same model at
r1 != r0 rows, c and s come from the two points (s clamped at >= 0, then c at >= 0), which keeps a
tiny layer's overhead from shrinking with the micro-batch: the reason a small m is not free on a GPU.

Bytes are an upper bound, never under what a run holds (``_bytes_at``). A figure of the walk is the
most held at one moment, a maximum of such lines (which moment peaks may change with r): convex in
r, through c >= 0. So, from the points measured (r_lo < r_hi):

    r <= r_lo            bytes(r_lo)                     (nondecreasing)
    r_lo <= r <= r_hi    the chord through both points    (convex: on or above the figure)
    r >= r_hi            bytes(r_hi) * r / r_hi           (c >= 0: a line through 0 is above)

With one profile the tensors a layer makes per row (``_PER_ROW``: its output, what it saves) are
taken as rows alone (c = 0: their sizes are rows times a shape); its transients (``_TRANSIENT``,
the most a forward or backward allocates at once: the weights' gradients among them, which do not
shrink with the rows) by the rule above with r_lo = r_hi = r0. Without the fixed part a 2048-row
profile put 1F1B at m = 16 at +68 % of the measured peak on an activation-heavy MLP; with the
second profile at the smallest micro-batch it is exact at both and a bound between.
``second_rows`` picks r1: the smallest micro-batch the search considers (B / largest m, 1 row
when every m is), so that c is measured where it weighs most rather than extrapolated to it from
two larger sizes (on the benchmark's GPT, the line through 8 and 4 rows put the whole model's
1-row forward and backward at 1.30 and 2.53 ms where they measured 0.91 and 1.71); when the
sample already has those rows, the largest micro-batch (B / smallest m).

``batch_rows`` reads r0 from a sample: the leading size of its first tensor (a tuple, list or dict
of tensors: all leading sizes must agree).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import networkx as nx

from partitioner._trees import tensors
from partitioner.figures import LayerProfile, Profile, ShapeProbe

__all__ = ["batch_rows", "scale_profile", "second_rows"]

_TIMES = ("forward_time", "backward_time", "input_time", "weight_time")
_FLOPS = ("flops", "backward_flops", "input_flops", "weight_flops")
# bytes of tensors a layer makes per row: its output, what it saves (of its input, output, target)
_PER_ROW = (
    "activation_bytes",
    "saved_bytes",
    "saved_input_bytes",
    "saved_output_bytes",
    "saved_target_bytes",
)
# the most a layer's forward or backward part allocates at once: per-row tensors and fixed ones
_TRANSIENT = (
    "forward_transient_bytes", "backward_transient_bytes", "input_transient_bytes", "weight_transient_bytes",
    "closing_backward_transient_bytes", "closing_input_transient_bytes", "closing_weight_transient_bytes",
    "no_grad_forward_bytes",
)  # fmt: skip


def batch_rows(sample: Any) -> int:
    """The rows (leading size) of ``sample``; a ValueError when it has none or they disagree."""
    leaves = [t for t in tensors(sample) if t.dim() > 0]
    if not leaves:
        raise ValueError(
            "sample has no tensor with a batch dimension; pass an example input whose tensors have the "
            "rows (batch) as their first dimension"
        )
    sizes = {int(t.shape[0]) for t in leaves}
    if len(sizes) > 1:
        raise ValueError(f"sample's tensors disagree on their rows (first dimension): {sorted(sizes)}")
    return sizes.pop()


def second_rows(rows: int, batch_size: int, counts: Sequence[int]) -> int:
    """The rows to profile a second time at (see the module docstring), the sample having ``rows``
    and the search trying the micro-batch counts ``counts`` (each dividing ``batch_size``)."""
    sizes = sorted({batch_size // m for m in counts})
    if not sizes:
        raise ValueError("counts is empty: pass the micro-batch counts the search tries")
    for size in (sizes[0], sizes[-1]):
        if size != rows:
            return size
    return rows // 2 if rows >= 2 else 2  # one size only: any other one gives the slope


def scale_profile(
    profile: Profile, rows: int, to_rows: int, second: tuple[Profile, int] | None = None
) -> Profile:
    """``profile`` (taken at ``rows``) as it would be at ``to_rows`` (see the module docstring);
    ``second``: the same model profiled at other rows, for the per-call overhead."""
    for name, value in (("rows", rows), ("to_rows", to_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be an integer >= 1: rows of a micro-batch")
    if second is not None:
        other, other_rows = second
        if len(other) != len(profile) or other_rows == rows:
            raise ValueError(
                f"second profile has {len(other)} layers at {other_rows} rows; it must profile the same "
                f"{len(profile)} layers at a different number of rows than {rows}"
            )
    if to_rows == rows:
        return profile
    factor = to_rows / rows

    def scaled(lp: LayerProfile, at: LayerProfile | None, at_rows: int) -> LayerProfile:
        changes = _by_rows(lp, factor)
        for f in (*_PER_ROW, *_TRANSIENT):
            points = [(rows, getattr(lp, f))] + ([] if at is None else [(at_rows, getattr(at, f))])
            changes[f] = _bytes_at(points, to_rows, f in _PER_ROW)
        for f in _TIMES:
            t0 = getattr(lp, f)
            if at is None:
                changes[f] = t0 * factor
            else:
                slope = max((getattr(at, f) - t0) / (at_rows - rows), 0.0)
                fixed = max(t0 - slope * rows, 0.0)
                changes[f] = fixed + slope * to_rows
        return dataclasses.replace(lp, **changes)

    others = [None] * len(profile) if second is None else list(second[0].layers)
    at_rows = 0 if second is None else second[1]
    layers = [scaled(lp, at, at_rows) for lp, at in zip(profile.layers, others, strict=True)]
    loss = profile.loss
    if loss is not None:
        loss = scaled(loss, None if second is None else second[0].loss, at_rows)
    shape, probe = profile.shape, profile.probe
    if probe is not None:  # the length probe: untimed, each byte figure scaled as the profile's
        probe = ShapeProbe(
            (_per_row(probe.shape[0], factor), probe.shape[1]),
            [
                _alike(lp, was, now, factor)
                for lp, was, now in zip(probe.layers, profile.layers, layers, strict=True)
            ],
            None
            if probe.loss is None or loss is None or profile.loss is None
            else _alike(probe.loss, profile.loss, loss, factor),
        )
    device = profile.device_memory
    return dataclasses.replace(
        profile,
        device_memory=dataclasses.replace(device, rounding=device.rounding / min(factor, 1.0)),
        layers=layers,
        graph=_scaled_graph(profile.graph, factor),
        input_bytes=_per_row(profile.input_bytes, factor),
        loss=loss,
        shape=None if shape is None else (to_rows, shape[1]),
        probe=probe,
    )


def _per_row(value: int, factor: float) -> int:
    return round(value * factor)


def _bytes_at(points: list[tuple[int, int]], rows: int, per_row: bool) -> int:
    """A byte figure at ``rows`` from its measured (rows, bytes) ``points`` (one or two): the
    module docstring's bound; one point of a ``per_row`` figure: in proportion (c = 0)."""
    (lo, at_lo), (hi, at_hi) = min(points), max(points)
    if len(points) == 1 and per_row:
        return _per_row(at_lo, rows / lo)
    if rows <= lo:
        return at_lo
    if rows >= hi:
        return -(-at_hi * rows // hi)  # in integers: rounded up, never below
    return at_lo - (-(at_hi - at_lo) * (rows - lo) // (hi - lo))


def _alike(lp: LayerProfile, was: LayerProfile, now: LayerProfile, factor: float) -> LayerProfile:
    """The probe's ``lp`` scaled as its profile's figures were (``was`` to ``now``): each byte figure
    by the profile's own ratio (its length-squared share unchanged), flops by the rows."""
    changes = _by_rows(lp, factor)
    for f in (*_PER_ROW, *_TRANSIENT):
        before = getattr(was, f)
        ratio = getattr(now, f) / before if before else factor
        changes[f] = math.ceil(getattr(lp, f) * ratio)
    return dataclasses.replace(lp, **changes)


def _by_rows(lp: LayerProfile, factor: float) -> dict[str, Any]:
    """What grows as the rows alone: the flops, and the output's leading size."""
    changes: dict[str, Any] = {f: _per_row(getattr(lp, f), factor) for f in _FLOPS}
    if lp.output_shape:
        changes["output_shape"] = (round(lp.output_shape[0] * factor), *lp.output_shape[1:])
    return changes


def _scaled_graph(graph: nx.DiGraph, factor: float) -> nx.DiGraph:
    """The layer graph with every edge's bytes (and named tensors') scaled by ``factor``."""
    out = graph.copy()
    for _, _, data in out.edges(data=True):
        data["bytes"] = _per_row(int(data.get("bytes", 0)), factor)
        if "tensors" in data:
            data["tensors"] = {name: _per_row(size, factor) for name, size in data["tensors"].items()}
    return out
