"""One stage's runtime: forward, backward, weight-gradient and the state saved per micro-batch.

    # i: micro-batch, m: micro-batches, l: layer of the stage, L: layers

A stage is a slice of the model's ``nn.Sequential``, or one traced graph
(traced.py), which counts as one layer here. Its input arrives detached
(a graph boundary: gradients stop here and travel back as tensors). The state
of micro-batch i lives from its F to its last backward action and is then
dropped, so ``live`` counts the micro-batches whose activations are held.

Unsplit backward (gpipe, 1f1b, interleaved): F saves input and output, B runs one
``autograd.backward`` that fills parameter grads and the input's grad.

Split backward (zb-h1): F runs layer by layer, each layer's input detached, so
that the stage is a chain of small graphs::

    a_0 -> [layer 0] -> o_0 ~> a_1 -> [layer 1] -> o_1 ~> ... -> o_L (or the loss)
                  (~> : detach, a graph boundary)

B walks the chain backwards with ``autograd.grad(o_l, a_l, g_l, retain_graph=True)``,
which computes only input gradients, and keeps every g_l (grad of o_l). W then
runs ``autograd.backward(o_l, g_l, inputs=params_l)`` per layer: the weight
gradients, from the same graphs, after which everything is freed. The sums are
those of one whole backward, so the gradients equal the unsplit ones.

The last stage's loss for micro-batch i is scaled by its weight, rows_i / B
(``set_rows``; 1/m when m divides B), so that the backward leaves the gradient
of the batch's mean loss. In a forward-only pass the last stage may also keep
its outputs (``keep_outputs``, for ``predict``) and skip the loss (``want_loss``).

Compiled (``compile=``, compiled.py): each layer runs through its class's compiled caller, in F
and in a recomputed micro-batch's replay alike. A split stage then computes the input and the
weight gradients together in B, freeing the layer's graph there, and W only adds the kept weight
gradients into ``.grad`` (AOTAutograd's backward returns both at once: run per action it would
run twice).

Recomputed micro-batches (see recompute.py) run F under ``no_grad`` keeping
only the input and the RNG state, and rebuild the graphs at the start of B with
that state restored, so dropout draws the same masks as in F.

What a micro-batch keeps is counted by the rank's ``ActivationMeter`` (memory.py): autograd's
saved tensors while its forward or replay runs, and the input, outputs (or layer chain) and
kept output gradients as tokens in its ``_Saved``, released with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeline.runtime.inputs.microbatch import Batch, Signature, as_tuple, from_tuple, weights
from pipeline.runtime.step.compiled import LayerCall, compiled_calls
from pipeline.runtime.step.memory import ActivationMeter
from pipeline.runtime.step.recompute import RNGState, recomputes
from pipeline.runtime.trace.shape_memo import memoised

__all__ = ["Grads", "StageRuntime"]

# a gradient per tensor of a batch; None where the tensor takes none (integers)
Grads = tuple[torch.Tensor | None, ...]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class _Saved:
    inputs: Batch  # the stage's input leaves
    rng: RNGState | None = None  # set when this micro-batch recomputes
    target: Any = None
    outputs: Batch | None = None  # unsplit: the graph's roots (the scaled loss on the last stage)
    chain: list[tuple[Batch, Batch]] = field(default_factory=list)  # split: (a_l, o_l)
    # split, for W: per layer its roots and their grads; compiled, its parameters and their gradients
    grads: list[tuple[list[torch.Tensor], list[torch.Tensor | None]]] = field(default_factory=list)
    held: list[Any] = field(default_factory=list)  # the meter's tokens for what this keeps (memory.py)
    chain_held: list[Any] = field(default_factory=list)  # tokens of the chain's tensors (compiled B frees)


def _leaves(x: Batch) -> Batch:
    """Detached copies (no data copy) that start a new graph; floats require grad."""
    tensors = [t.detach().requires_grad_(t.is_floating_point()) for t in as_tuple(x)]
    return from_tuple(tensors, isinstance(x, tuple))


def _roots(outputs: Batch, grads: Grads | None) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The (tensor, grad) pairs that backward starts from: tensors in the graph only."""
    outs = as_tuple(outputs)
    gs: Grads = grads if grads is not None else (None,) * len(outs)
    keep = [(t, g) for t, g in zip(outs, gs, strict=True) if t.requires_grad]
    pairs = [(t, g) for t, g in keep if g is not None or grads is None]
    return [t for t, _ in pairs], [g for _, g in pairs]


class StageRuntime:
    """Stage ``index`` of ``n_stages``: runs F, B and W for micro-batches of one step."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        *,
        n_stages: int,
        n_microbatches: int,
        split_backward: bool,
        recompute: str,
        loss_fn: LossFn | None,
        device: torch.device,
        compile: dict[str, Any] | None = None,
    ) -> None:
        self.index, self.module, self.device = index, module, device
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.n_microbatches, self.split, self.recompute = n_microbatches, split_backward, recompute
        self.loss_fn = loss_fn
        self.layers = list(module) if isinstance(module, nn.Sequential) else [module]  # traced: one graph
        # each layer's forward: the layer itself, or its class's compiled caller (compiled.py)
        self.compiled = compile is not None
        self.calls: list[LayerCall] = compiled_calls(self.layers, compile) if compile is not None else []
        self.layer_params = [[p for p in layer.parameters() if p.requires_grad] for layer in self.layers]
        self.recomputes = [recomputes(recompute, i, n_microbatches) for i in range(n_microbatches)]
        self.weights = [1.0 / n_microbatches] * n_microbatches  # each micro-batch loss's (set_rows)
        self.share: Callable[[], torch.Tensor] | None = None  # with replicas: B_d / B (set_rows)
        self.scale: Callable[[torch.Tensor], torch.Tensor] | None = None  # a GradScaler's scale()
        self._saved: dict[int, _Saved] = {}
        self.losses: list[torch.Tensor] = []  # last stage: unscaled micro-batch losses of this step
        # last stage, forward-only passes: keep each micro-batch's output (predict), compute the loss
        self.keep_outputs, self.want_loss = False, True
        self.outputs: dict[int, Batch] = {}
        self.live = 0  # micro-batches whose state is held
        self.peak = 0  # the most held at once since reset_peak()
        self.meter = ActivationMeter()  # bytes held for backward; the executor shares its rank's
        # sharded (FSDP): the module's parameters are swapped for their gathered copies while they are
        # in use, so W reads them when it runs; ``gathered()`` keeps them gathered for a fake forward
        self.sharded = False
        self.gathered: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext

    def reset_peak(self) -> None:
        self.peak = self.live

    def set_rows(self, sizes: list[int], share: Callable[[], torch.Tensor] | None = None) -> None:
        """The rows of this step's micro-batches: micro-batch i's loss weighs rows_i / B; with
        replicas also ``share()``, this replica's B_d / B of the global batch (dp.py)."""
        self.weights, self.share = weights(sizes), share

    # ---- forward

    def _run(
        self, i: int, x: Batch, target: Any, chain: list[tuple[Batch, Batch]] | None, record: bool = True
    ) -> Batch:
        """The stage's layers for micro-batch ``i`` (and its weighted loss on the last stage);
        ``chain`` collects (a_l, o_l)."""
        with self.meter.saving():
            if chain is None and not self.compiled:
                out: Batch = self.module(x)
            elif chain is None:  # compiled: the Sequential's forward, layer by layer
                out = x
                for call in self.calls:
                    out = call(out)
            else:
                out = x
                for k, layer in enumerate(self.layers):
                    a = out if k == 0 else _leaves(out)
                    out = self.calls[k](a) if self.compiled else layer(a)
                    chain.append((a, out))
        if self.is_last and self.keep_outputs:
            self.outputs[i] = _detached(out)
        if self.is_last and self.want_loss:
            with self.meter.saving():
                out = self._loss(out, target, record, self.weights[i])
            if chain is not None:  # the loss closes the last layer's graph
                chain[-1] = (chain[-1][0], out)
        return out

    def _loss(self, out: Batch, target: Any, record: bool, weight: float) -> torch.Tensor:
        assert self.loss_fn is not None
        loss = self.loss_fn(out, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return a scalar (0-dim) tensor, got {shape}; reduce it, e.g. with .mean()"
            )
        if record:  # a copy: a loss can be a view of a buffer as large as its input (mse_loss's is)
            self.losses.append(loss.detach().clone())
        if self.share is not None:
            loss = loss * (self.share() * weight).to(loss.device, loss.dtype)
        else:
            loss = loss * weight
        return self.scale(loss) if self.scale is not None else loss  # a device multiply: no sync

    def forward(self, i: int, x: Batch, target: Any = None) -> Batch | None:
        """F of micro-batch ``i``: the output for the next stage (None on the last stage)."""
        x = x if self.is_first else _leaves(x)
        saved = _Saved(inputs=x, target=target)
        if self.recomputes[i]:
            saved.rng = RNGState.capture(self.device)
            with torch.no_grad():
                out = self._run(i, x, target, None)
        else:
            chain = saved.chain if self.split else None
            out = self._run(i, x, target, chain)
            saved.outputs = out if not self.split else None
        saved.held = self.meter.hold(as_tuple(x))
        self._hold_graph(saved)
        self._saved[i] = saved
        self.live += 1
        self.peak = max(self.peak, self.live)
        return None if self.is_last else out

    def _replay(self, i: int, saved: _Saved) -> None:
        """Rebuild a recomputed micro-batch's graph with the RNG state of its F.

        The buffers are put back afterwards: F updated them already (BatchNorm's
        running statistics, ``num_batches_tracked``), and a second update would
        count the micro-batch twice.
        """
        assert saved.rng is not None
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            saved.rng.restore()
            with torch.enable_grad():
                chain = saved.chain if self.split else None
                out = self._run(i, saved.inputs, saved.target, chain, record=False)
        # through .data: the graph holds the buffers as inputs (BatchNorm's running statistics),
        # so a tracked write would fail its backward's version check, although a training-mode
        # backward never reads them (and in eval mode their values are unchanged)
        for b, before in buffers:
            b.data.copy_(before)
        saved.outputs = None if self.split else out
        self._hold_graph(saved)

    def _hold_graph(self, saved: _Saved) -> None:
        """Count the graph's roots (unsplit) or every layer's input and output (split) as held."""
        if saved.outputs is not None:
            saved.held += self.meter.hold(as_tuple(saved.outputs))
        for a, o in saved.chain:
            saved.chain_held += self.meter.hold([*as_tuple(a), *as_tuple(o)])

    # ---- backward

    def backward(self, i: int, grads: Grads | None) -> Grads | None:
        """B of micro-batch ``i`` given the grads of its outputs (None on the last stage).

        Returns the grads of the stage's inputs (None on the first stage). Unsplit,
        it also accumulates the weight gradients and frees the micro-batch.
        """
        saved = self._saved[i]
        if saved.rng is not None:
            self._replay(i, saved)
        if self.split:
            return self._input_grads(saved, grads)
        assert saved.outputs is not None
        outs, gs = _roots(saved.outputs, grads)
        torch.autograd.backward(outs, gs)
        result = None if self.is_first else self._grads_of(saved.inputs)
        self._free(i)
        return result

    @staticmethod
    def _grads_of(inputs: Batch) -> Grads:
        return tuple(
            (t.grad if t.grad is not None else torch.zeros_like(t)) if t.requires_grad else None
            for t in as_tuple(inputs)
        )

    def _input_grads(self, saved: _Saved, grads: Grads | None) -> Grads | None:
        if self.compiled:
            return self._all_grads(saved, grads)
        g: Grads | None = grads
        saved.grads = [([], [])] * len(saved.chain)
        for k in range(len(saved.chain) - 1, -1, -1):
            a, o = saved.chain[k]
            outs, gs = _roots(o, g)
            saved.grads[k] = (outs, gs)
            saved.held += self.meter.hold(gs)  # kept for W
            if k == 0 and self.is_first:
                return None
            wanted = [t for t in as_tuple(a) if t.requires_grad]
            got = torch.autograd.grad(outs, wanted, gs, retain_graph=True, allow_unused=True) if outs else ()
            it = iter(got)
            g = tuple(
                (_or_zeros(next(it, None), t) if outs else torch.zeros_like(t)) if t.requires_grad else None
                for t in as_tuple(a)
            )
        return g

    def _all_grads(self, saved: _Saved, grads: Grads | None) -> Grads | None:
        """Compiled B: each layer's input and weight gradients in one backward call that frees its
        graph; the weight gradients are kept for W (``saved.grads``: (parameters, gradients))."""
        g: Grads | None = grads
        saved.grads = [([], [])] * len(saved.chain)
        for k in range(len(saved.chain) - 1, -1, -1):
            a, o = saved.chain[k]
            outs, gs = _roots(o, g)
            first = k == 0 and self.is_first  # the model's input: no gradient wanted
            wanted = [] if first else [t for t in as_tuple(a) if t.requires_grad]
            params = self.layer_params[k]
            # no root in the graph (the layer's outputs need no gradient): no gradient for anything
            none: tuple[torch.Tensor | None, ...] = (None,) * (len(wanted) + len(params))
            got = torch.autograd.grad(outs, [*wanted, *params], gs, allow_unused=True) if outs else none
            kept = [(p, d) for p, d in zip(params, got[len(wanted) :], strict=True) if d is not None]
            saved.grads[k] = ([p for p, _ in kept], [d for _, d in kept])
            saved.held += self.meter.hold(d for _, d in kept)  # kept for W
            if not first:
                it = iter(got[: len(wanted)])
                g = tuple(_or_zeros(next(it), t) if t.requires_grad else None for t in as_tuple(a))
        saved.chain, saved.chain_held = [], []  # the graphs are freed: only the gradients stay
        return None if self.is_first else g

    def weight(self, i: int) -> None:
        """W of micro-batch ``i`` (split backward only): weight gradients, then free it."""
        saved = self._saved[i]
        if self.compiled:  # B computed them: accumulated as autograd would (hooks run)
            for leaves, dws in saved.grads:
                if leaves:
                    torch.autograd.backward(leaves, dws)
            self._free(i)
            return
        every = self.layer_params
        if self.sharded:
            every = [[p for p in layer.parameters() if p.requires_grad] for layer in self.layers]
        for (outs, gs), params in zip(saved.grads, every, strict=True):
            if outs and params:
                torch.autograd.backward(outs, gs, inputs=params)
        self._free(i)

    def discard(self) -> None:
        """Drop every held micro-batch and kept output: after a forward-only (evaluation) pass."""
        self._saved.clear()
        self.outputs = {}
        self.live = 0

    def _free(self, i: int) -> None:
        del self._saved[i]
        self.live -= 1

    # ---- shapes

    def infer(self, sig: Signature) -> Signature:
        """The output signature for an input signature, without computing (fake tensors); once per
        process for the same stage structure, signature and autocast state (shape_memo.py)."""

        def fake() -> Signature:
            with self.gathered():
                return self._fake_forward(sig)

        return memoised(self.module, sig, self.device, fake)

    def _fake_forward(self, sig: Signature) -> Signature:
        """The output signature for an input signature, without computing (fake tensors).

        Runs under the caller's autocast, so the signature has autocast's dtypes,
        but with autocast's cast cache off: the cache keeps a parameter's low
        precision copy until the outermost autocast exits, and a copy made here
        would be fake, so the real forwards after it would silently run on fake
        weights (fake outputs: no data sent, fake grads). Buffers are restored
        afterwards: a fake forward still bumps counters such as BatchNorm's
        ``num_batches_tracked``.
        """
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        # a shape environment lets a call whose output size depends on the data (nonzero, a boolean
        # mask) run inside the stage, with a symbolic size; only the stage's outputs must be known
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        try:
            with mode, torch.no_grad():
                empty = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in sig]
                fake = [mode.from_tensor(t, static_shapes=True) for t in empty]
                out = self.module(from_tuple(fake, len(fake) > 1))
        finally:
            torch.set_autocast_cache_enabled(cache)
            with torch.no_grad():
                for b, copy in buffers:
                    b.copy_(copy)
        for j, t in enumerate(as_tuple(out)):
            if not all(isinstance(d, int) for d in t.shape):
                raise ValueError(
                    f"stage {self.index}'s output {j} has a shape that depends on the data "
                    f"({list(t.shape)}): the pipeline sends tensors whose shapes follow from the input's; "
                    "keep such a result inside one stage (partition() never cuts a traced model there) or "
                    "give it a fixed size"
                )
        return tuple((tuple(t.shape), t.dtype) for t in as_tuple(out))


def _detached(out: Any) -> Batch:
    """The last stage's output, kept for ``predict``: a tensor or a tuple of tensors, detached."""
    tensors = out if isinstance(out, tuple) else (out,)
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tensors):
        kinds = ", ".join(
            "a 0-dim tensor" if isinstance(t, torch.Tensor) else type(t).__name__ for t in tensors
        )
        raise TypeError(
            f"predict() and evaluate(return_outputs=True) concatenate the model's outputs along dim 0, "
            f"so the last stage must return a tensor or a tuple of tensors with a batch dimension, "
            f"got {kinds or 'an empty tuple'}; return the per-row outputs (e.g. logits), not a reduction"
        )
    return from_tuple([t.detach() for t in tensors], isinstance(out, tuple))


def _or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return g if g is not None else torch.zeros_like(like)
