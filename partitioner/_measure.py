"""Measuring one layer (or the loss) as the pipeline runs it: times, bytes and flops.

    # l: layer, i: micro-batch

For layer l, on its working copy (see ``_placement``), inside one autocast region when the run
has one (as a pipeline step is: autocast's weight cache is then filled once and shared)::

    untimed, counted by LiveBytes    two forwards held at once, then both backwards:
                                       saved by pass 2 and not by pass 1 -> saved_bytes (per i)
                                       saved by both (weight cache)      -> cache_bytes (once)
                                       pass 1's output -> layer l + 1's input
    untimed, LiveBytes               one forward, one backward -> what each allocates and frees
                                     again: forward_ and backward_transient_bytes; one forward
                                     under no_grad -> no_grad_forward_bytes (its most); the split
                                     backward's parts -> input_ and weight_transient_bytes; the
                                     three backwards closing (the output held by its graph alone,
                                     its gradient made inside, as under the loss) -> closing_*
    untimed, FlopCount               one forward, one whole backward -> flops, backward_flops;
                                     one split backward -> input_flops, weight_flops
    timed (``one_sample``, warm-up,  F; whole backward (B of gpipe/1f1b);
    then adaptive repeats)           F; input gradient alone (zb-h1's B); weight gradient (its W)

How many samples, and what is made of them (minimum, spread, floor gap), is ``partitioner.noise``'s.

The split backward is the pipeline's own: ``autograd.grad(out, input, retain_graph=True)`` then
``autograd.backward(out, inputs=params)``. Layer 0 takes an input without a gradient, as stage 0
does, so it has no input-gradient part. Every run gets a fresh copy of the input (made outside
the timed region), so a layer that writes into its input (``inplace``, found by the copy's
version counter) neither fails on autograd's leaf nor changes the next run's input.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partitioner._trees import nbytes, sendable, tensors, tree_map
from partitioner.figures import LayerProfile, LayerTiming
from partitioner.flops import FlopCount
from partitioner.noise import NOISE_LIMIT, estimate, floor_gap, settled, spread
from pipeline.runtime.step.live import LiveBytes

__all__ = ["Rejected", "Run", "WithTarget", "fresh", "measure", "one_sample", "precision"]


class Rejected(Exception):
    """The layer (or loss) raised on its input; ``profile`` names it and the fix."""


@dataclass(frozen=True)
class WithTarget:
    """The loss's input: the last layer's output and the targets, which take no gradient. Each run
    gets its own copy of both, as each micro-batch brings its own."""

    output: Any
    target: Any


@dataclass(frozen=True)
class Run:
    """How to run one layer: where, under which autocast, how often (``repeat``: the fewest timed
    samples; ``partitioner.noise`` may take more, until ``deadline``, a ``time.perf_counter()``
    reading: the profile's time budget); ``live`` counts the untimed parts."""

    device: torch.device
    autocast: torch.dtype | None
    warmup: int
    repeat: int
    live: LiveBytes
    deadline: float | None = None


@contextlib.contextmanager
def precision(run: Run) -> Iterator[None]:
    """The run's autocast region (or none, explicitly: fp32 however the caller runs)."""
    dtype = run.autocast if run.autocast is not None else torch.float32
    with torch.enable_grad(), torch.autocast(run.device.type, dtype=dtype, enabled=run.autocast is not None):
        yield


def measure(
    index: int,
    name: str,
    kind: str,
    fn: Callable[[Any], Any],
    module: nn.Module | None,
    x: Any,
    run: Run,
    *,
    first: bool,
    closing: bool = False,
    timed: bool = True,
) -> tuple[LayerProfile, Any]:
    """Figures of ``fn`` (a layer's working copy ``module``, or the loss) on ``x``, and its output;
    ``closing``: the model's last layer, which alone runs under the loss (its ``closing_*`` figures
    are measured; elsewhere they repeat the plain ones, never read: three backwards fewer a layer);
    ``timed=False``: flops and bytes only, every time 0 (the length probe's).

    Raises ``Rejected`` when the first forward raises."""
    params = [] if module is None else list(module.parameters())
    buffers = [] if module is None else list(module.buffers())
    owned = {t.untyped_storage().data_ptr() for t in (*params, *buffers)}
    wanted = [p for p in params if p.requires_grad]
    with precision(run):
        with run.live:
            out, saved, cache, inplace, saved_io, aliases = _untimed(fn, x, owned, first)
        transients = _transients(fn, x, first, wanted, closing)
        no_grad_forward = _no_grad_forward(fn, x, first)
        flops, backward_flops = _flops(fn, x, first)
        input_flops, weight_flops = _split_flops(fn, x, wanted, first)
        samples = _timed(fn, x, wanted, first, run) if timed else []
    # untimed (the length probe): every time 0, no samples to judge
    timing = LayerTiming(*(estimate([s[j] for s in samples]) for j in range(4))) if samples else LayerTiming()
    totals = [s[0] + s[1] for s in samples]
    gap = floor_gap(totals) if samples else 0.0
    found = tensors(out)
    head = found[0] if found else None
    figures = LayerProfile(
        index=index,
        name=name,
        kind=kind,
        forward_time=timing.forward.value,
        backward_time=timing.backward.value,
        flops=flops,
        param_bytes=nbytes(params),
        linear_weight_bytes=_linear_weight_bytes(module),
        activation_bytes=nbytes(out),
        saved_bytes=saved,
        output_shape=tuple(head.shape) if head is not None else (),
        output_dtype=str(head.dtype).removeprefix("torch.") if head is not None else "",
        weight_time=timing.weight.value,
        input_time=timing.input.value,
        backward_flops=backward_flops,
        buffer_bytes=nbytes(buffers),
        cache_bytes=cache,
        inplace=inplace,
        saved_input_bytes=saved_io[0],
        saved_output_bytes=saved_io[1],
        output_aliases_input=aliases[0],
        input_grad_aliases=aliases[1],
        forward_transient_bytes=transients[0],
        backward_transient_bytes=transients[1],
        input_transient_bytes=transients[2],
        weight_transient_bytes=transients[3],
        closing_backward_transient_bytes=transients[4],
        closing_input_transient_bytes=transients[5],
        closing_weight_transient_bytes=transients[6],
        no_grad_forward_bytes=no_grad_forward,
        sendable=sendable(out),
        input_flops=input_flops,
        weight_flops=weight_flops,
        samples=len(samples),
        spread=spread(totals) if samples else 0.0,
        error=gap,
        noisy=gap > NOISE_LIMIT,
        timing=timing if samples else None,
    )
    return figures, out


def fresh(x: Any, first: bool) -> tuple[Any, list[torch.Tensor]]:
    """A new copy of ``x`` to run on, and the leaves whose gradient the input-gradient part computes.

    The leaves take a gradient (floating point, and not layer 0's); the copy is a clone of them, so
    a layer may write into it. A ``WithTarget`` becomes (output copy, target copy)."""
    if isinstance(x, WithTarget):
        out, grads = fresh(x.output, first)
        return (out, tree_map(x.target, lambda t: t.detach().clone())), grads
    leaves: list[torch.Tensor] = []

    def leaf(t: torch.Tensor) -> torch.Tensor:
        d = t.detach().requires_grad_(t.is_floating_point() and not first)
        if d.requires_grad:
            leaves.append(d)
        return d.clone()

    return tree_map(x, leaf), leaves


def roots(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The output tensors that backward starts from, and their incoming gradients (ones)."""
    outs = [t for t in tensors(out) if t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


def _untimed(
    fn: Callable[[Any], Any], x: Any, owned: set[int], first: bool
) -> tuple[Any, int, int, bool, tuple[int, int], tuple[bool, bool]]:
    """(pass 1's output, saved bytes per micro-batch, cache bytes, writes into its input, the
    bytes of its input and of its output among what it saves: storages a neighbour saves too, and
    whether its output is its input's storage (a view, an in-place result) and its input's
    gradient its output gradient's (a view's backward): storages a neighbour holds too)."""
    seen: list[dict[int, torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[-1].setdefault(t.untyped_storage().data_ptr(), t)  # views of one storage count once
        return t

    outs, inplace = [], False
    for _ in range(2):  # both graphs held: no storage of pass 1 can be reused by pass 2
        a, _leaves = fresh(x, first)
        before = [t._version for t in tensors(a)]
        seen.append({})
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            try:
                outs.append(fn(a))
            except Exception as err:
                if outs:
                    raise
                raise Rejected(str(err)) from err
        inplace = inplace or [t._version for t in tensors(a)] != before

    def among_saved(y: Any) -> int:
        return sum(
            t.nelement() * t.element_size() for t in tensors(y) if t.untyped_storage().data_ptr() in seen[1]
        )

    saved_io = (among_saved(a), among_saved(outs[1]))
    inputs = {t.untyped_storage().data_ptr() for t in tensors(a)}
    results = [t.untyped_storage().data_ptr() for t in tensors(outs[1])]
    # one storage in, only it out: a chain's tensor (with several, which one a neighbour holds is unknown)
    aliases = len(inputs) == 1 and bool(results) and all(ptr in inputs for ptr in results)
    one, two = ({k: t for k, t in s.items() if k not in owned} for s in seen)
    saved = sum(t.untyped_storage().nbytes() for k, t in two.items() if k not in one)
    cache = sum(t.untyped_storage().nbytes() for k, t in two.items() if k in one)
    seen.clear()  # the saved tensors go with their graphs
    del one, two
    grad_aliases = False
    wanted = [t for t in tensors(a) if t.requires_grad]
    for k, out in enumerate(outs):
        grads = roots(out)
        if not grads[0]:
            continue
        if k == 0 or len(wanted) != 1 or inplace:  # in place: the input is the output, no gradient of its own
            torch.autograd.backward(*grads)
            continue
        # pass 2's input gradient alone (pass 1 filled the parameters' already): its output's gradient?
        got = torch.autograd.grad(grads[0], wanted, grads[1], allow_unused=True)
        given = {g.untyped_storage().data_ptr() for g in grads[1]}
        grad_aliases = all(g is not None and g.untyped_storage().data_ptr() in given for g in got)
        del got
    return tree_map(outs[0], lambda t: t.detach()), saved, cache, inplace, saved_io, (aliases, grad_aliases)


def _transients(
    fn: Callable[[Any], Any], x: Any, first: bool, params: Sequence[torch.Tensor], closing: bool
) -> tuple[int, ...]:
    """Transient bytes of one micro-batch, counted by ``LiveBytes``: (forward, then per backward
    part: whole, input gradient, weight gradient; then those three again as ``closing``).

    Forward: what it allocates and frees again before returning (intermediates nothing saves).
    A backward part: the most it holds at once beyond what was alive when it began (its gradients,
    their accumulation's temporaries, intermediates; less what it has freed of its saved tensors by
    then, never below 0), its output and the output's gradient held by the caller, as a stage holds
    them. What stays (outputs, saved tensors) is counted elsewhere."""
    forward, device = _forward_transient(fn, x, first)
    if device is None:
        return (0,) * 7
    parts = [
        _backward_peak(fn, x, first, params, part, False, device) for part in ("whole", "input", "weight")
    ]
    if closing:
        parts += [
            _backward_peak(fn, x, first, params, part, True, device) for part in ("whole", "input", "weight")
        ]
    return (forward, *parts, *([] if closing else parts))


def _forward_transient(fn: Callable[[Any], Any], x: Any, first: bool) -> tuple[int, str | None]:
    a, _ = fresh(x, first)
    with LiveBytes() as live:
        out = fn(a)  # held: what stays is not a transient
        device = max(live.peak, key=lambda d: live.peak[d], default=None)
        forward = live.peak[device] - live.now[device] if device is not None else 0
    del out
    return max(forward, 0), device


def _no_grad_forward(fn: Callable[[Any], Any], x: Any, first: bool) -> int:
    """The most one forward under ``no_grad`` holds at once beyond its input, its output included:
    what a recomputing F allocates (no graph: an intermediate lives while Python refers to it)."""
    a, _ = fresh(x, first)
    with torch.no_grad(), LiveBytes() as live:
        out = fn(a)
    del out
    return int(live.most())


def _backward_peak(
    fn: Callable[[Any], Any],
    x: Any,
    first: bool,
    params: Sequence[torch.Tensor],
    part: str,
    closing: bool,
    device: str,
) -> int:
    """The most one backward part holds at once beyond what was alive when it began (see
    ``_transients``): ``part`` "whole" (one ``autograd.backward``), "input" (the split B:
    ``autograd.grad`` of the input, graph retained; nothing on layer 0) or "weight" (the split W:
    ``autograd.backward(inputs=params)`` after the input part). ``closing``: as the last layer
    runs under the loss, its output held by nothing but its graph (freed when the op saving it has
    run) and its gradient made by the node after it (freed once read): through a multiply by 1."""
    a, leaves = fresh(x, first)
    with LiveBytes() as live:
        out = fn(a)
        outs, _ = roots(out)
        if closing:  # new roots: the layer's outputs now held by its graph alone
            outs = [t * 1 for t in outs]
        del out
        grads = [torch.ones_like(t) for t in outs]
        if not outs or (part == "input" and not leaves):
            return 0
        if part == "weight":
            if not params:
                return 0
            if leaves:  # the input part first, as B runs before W
                torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
        begin = live.now[device]
        live.reset_peak()
        if part == "whole":
            torch.autograd.backward(outs, grads)
        elif part == "input":
            got = torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
            del got
        else:
            torch.autograd.backward(outs, grads, inputs=list(params))
        return int(max(live.peak[device] - begin, 0))


def _flops(fn: Callable[[Any], Any], x: Any, first: bool) -> tuple[int, int]:
    a, _ = fresh(x, first)
    with FlopCount() as count:
        out = fn(a)
        forward = count.total
        outs, grads = roots(out)
        if outs:
            torch.autograd.backward(outs, grads)
    return forward, count.total - forward


def _split_flops(
    fn: Callable[[Any], Any], x: Any, params: Sequence[torch.Tensor], first: bool
) -> tuple[int, int]:
    """(input-gradient flops, weight-gradient flops): the split backward, as ``one_sample`` runs it."""
    a, leaves = fresh(x, first)
    outs, grads = roots(fn(a))
    with FlopCount() as count:
        if outs and leaves:
            torch.autograd.grad(outs, leaves, grads, retain_graph=bool(params), allow_unused=True)
        input_flops = count.total
        if outs and params:
            torch.autograd.backward(outs, grads, inputs=list(params))
    return input_flops, count.total - input_flops


def _syncer(dev: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work, so that host clocks time it (nothing to wait for on CPU)."""

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    return sync


Sample = tuple[float, float, float, float]  # seconds: forward, whole backward, input grad, weight grad


def one_sample(
    fn: Callable[[Any], Any], x: Any, params: Sequence[torch.Tensor], first: bool, sync: Callable[[], None]
) -> Sample:
    """One timed run of the layer: forward and whole backward, then forward and split backward."""
    a, _ = fresh(x, first)
    sync()
    t0 = time.perf_counter()
    outs, grads = roots(fn(a))
    sync()
    t1 = time.perf_counter()
    if outs:
        torch.autograd.backward(outs, grads)
    sync()
    t2 = time.perf_counter()
    del outs, grads, a
    a, leaves = fresh(x, first)  # the split backward, on a forward of its own
    leaves_given = bool(leaves)
    outs, grads = roots(fn(a))
    sync()
    t3 = time.perf_counter()
    if outs and leaves:
        torch.autograd.grad(outs, leaves, grads, retain_graph=bool(params), allow_unused=True)
    sync()
    t4 = time.perf_counter()
    if outs and params:
        torch.autograd.backward(outs, grads, inputs=list(params))
    sync()
    t5 = time.perf_counter()
    return t1 - t0, t2 - t1, t4 - t3 if leaves_given else 0.0, t5 - t4 if params else 0.0


def _timed(
    fn: Callable[[Any], Any], x: Any, params: Sequence[torch.Tensor], first: bool, run: Run
) -> list[Sample]:
    """Warm-up runs (allocation, kernel selection, CUDA start-up do not count), then samples until
    ``noise.settled`` says the layer's time is found, or ``repeat`` of them once the profile's
    deadline has passed."""
    sync = _syncer(run.device)
    for _ in range(run.warmup):
        one_sample(fn, x, params, first, sync)
    samples: list[Sample] = []
    start = time.perf_counter()
    first_s = 0.0
    while True:
        samples.append(one_sample(fn, x, params, first, sync))
        spent = time.perf_counter() - start
        if len(samples) == run.repeat:
            first_s = spent
        if settled([s[0] + s[1] for s in samples], run.repeat, spent, first_s):
            return samples
        if len(samples) >= run.repeat and run.deadline is not None and time.perf_counter() >= run.deadline:
            return samples  # the profile's time budget is spent: no more samples to settle the floor


def _linear_weight_bytes(module: nn.Module | None) -> int:
    """Bytes of the weights of ``module``'s ``nn.Linear`` modules (itself included), each storage once."""
    if module is None:
        return 0
    weights = {id(m.weight): m.weight for m in module.modules() if isinstance(m, nn.Linear)}
    return sum(w.nelement() * w.element_size() for w in weights.values())
