"""``Pipeline(..., compile=...)``: each layer of a stage runs through ``torch.compile`` (opt-in).

    Pipeline(model, plan, loss_fn=f, compile=True)              torch.compile's defaults (inductor)
    Pipeline(..., compile="aot_eager")                          a backend by name
    Pipeline(..., compile={"backend": "inductor", "mode": "max-autotune-no-cudagraphs"})
                                                                torch.compile's own keywords

What is compiled. Each layer of a stage (an entry of its ``nn.Sequential`` slice; a traced stage is
one graph, so one layer), as torchtitan compiles each transformer block, never the stage whole: a
split backward walks the stage layer by layer (stage.py), and the layers' graphs are those
boundaries. The modules themselves are not touched: the pipeline calls ``compiled(layer, x)``, a
function of ours that calls ``layer(x)`` (its hooks included), so parameter and buffer names stay
the model's (no ``_orig_mod.``: checkpoints and ``load_pretrained`` see the same keys), and the model
runs eagerly wherever else it is called::

    layer kind   -->  one torch.compile'd function (its own code object, named stagewise_<class>)
    Block x 12   -->  one graph: dynamo lifts the parameters to graph inputs, so the second block
                      reuses the first one's compiled code (no compile per block, none per step)

A layer's kind is its structure: its modules' names and classes, its parameters' and buffers'
names, shapes and dtypes. Dynamo keeps its compiled entries per code object, at most
``recompile_limit`` (8) of them, after which it silently runs the frame eagerly.
``torch.compile(module)`` traces every module through one shared wrapper, so a stage of nine
kinds of layer would run its ninth eagerly; here each kind has its own code object and so its own
budget (the entries of one kind: training or evaluation, autograd on or off, which inputs need a
gradient, a second micro-batch size).

The split backward under compile. AOTAutograd compiles a layer's backward as one function that
returns the input and the weight gradients together. Run per action as in eager (B: input
gradients only, W: weight gradients from the same graph), it would run whole twice. So a compiled
split stage computes both in B, in one call that also frees the layer's graph, keeps the weight
gradients, and W adds them into ``.grad`` through autograd's own accumulation (gradient hooks run,
as in eager)::

    eager     B_i: dI (graph kept)            W_i: dW (graph freed)      held until W: activations
    compiled  B_i: dI and dW (graph freed)    W_i: .grad += dW           held until W: dW

The gradients are the same; what changes is where the work is: W keeps its place in the schedule
but holds only the accumulation, so a zero-bubble schedule (zb-h1, zb-v, ...) does not fill its
bubble with weight gradients under compile, and its B costs a full backward.

When. Dynamo compiles a kind of layer at its first call, inside the first step (and again for a
new autograd mode: the first evaluation, the first recomputed micro-batch), while the other ranks
wait for that rank's messages: the Pipeline's ``timeout`` must cover the compile time (tens of
seconds per kind of layer with inductor on a busy CPU host, BENCHMARKS.md).

Randomness. A recomputed micro-batch's replay must draw dropout's masks as its F did (recompute.py
restores the generator's state). aot_eager and eager draw from torch's generator op by op; inductor
generates its own numbers from seeds it draws there, in an order that its inference graph (F under
``no_grad``) and its training graph (the replay) need not share. So with inductor and a stage that
recomputes, ``options={"fallback_random": True}`` is set unless given: random ops then run as in
eager, and their masks equal eager's. Not supported yet: stages sharded (FSDP) or split (tensor
parallelism), and CUDA graphs (a layer's graph replays into the same output memory, which the
pipeline still holds for other micro-batches): refused, with the fix.
"""

from __future__ import annotations

import inspect
import itertools
import re
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "CompileSpec",
    "LayerCall",
    "check_compile",
    "check_compile_plan",
    "compiled_calls",
    "for_recompute",
]

CompileSpec = bool | str | dict[str, Any] | None  # what Pipeline(compile=...) takes
LayerCall = Callable[[Any], Any]  # one layer's forward: batch -> batch

# torch.compile's keywords (its first argument, the function, is ours to give)
_KEYWORDS = tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")

_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile's modes that capture CUDA graphs

# per layer class, then per (structure, keywords): a compiled caller shared by every Pipeline of
# the process (a second Pipeline of the same model, or the next test, reuses the compiled code); a
# class that goes (a traced stage's GraphModule class is its own) takes its callers with it
_callers: weakref.WeakKeyDictionary[type, dict[tuple[str, str], Callable[[nn.Module, Any], Any]]] = (
    weakref.WeakKeyDictionary()
)


def check_compile(value: object) -> dict[str, Any] | None:
    """``Pipeline(compile=value)`` as torch.compile's keywords; None: eager. True: torch.compile's
    defaults; a str: a backend's name; a dict: torch.compile's keywords. A TypeError / ValueError
    naming the value and the fix otherwise."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, str):
        _check_backend(value)
        return {"backend": value}
    if isinstance(value, dict):
        unknown = [k for k in value if k not in _KEYWORDS]
        if unknown:
            raise ValueError(
                f"compile={value!r} has keys {unknown} that torch.compile does not take; the keys are "
                f"torch.compile's keywords: {', '.join(_KEYWORDS)}"
            )
        backend = value.get("backend")
        if isinstance(backend, str):
            _check_backend(backend)
        _check_no_cuda_graphs(value)
        return dict(value)
    raise TypeError(
        f"compile must be True (torch.compile's defaults), a backend's name (e.g. 'aot_eager'), a dict of "
        f"torch.compile's keywords, or False; got {type(value).__name__} {value!r}"
    )


def _check_backend(name: str) -> None:
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ValueError(
            f"compile backend {name!r} is not one torch.compile knows; pass one of {', '.join(known)} "
            "(or a backend callable in compile={'backend': fn})"
        )


def _check_no_cuda_graphs(kwargs: dict[str, Any]) -> None:
    """CUDA graphs replay a layer into the same output memory each call, but a pipeline holds several
    micro-batches' outputs of a layer at once (until their backward): refused, with the fix."""
    options = kwargs.get("options") or {}
    if kwargs.get("mode") in _CUDA_GRAPH_MODES or (
        isinstance(options, dict) and options.get("triton.cudagraphs")
    ):
        raise ValueError(
            f"compile={kwargs!r} uses CUDA graphs, which overwrite a layer's outputs at its next call while "
            "the pipeline still holds them for other micro-batches' backward; use mode='default' or "
            "'max-autotune-no-cudagraphs', without options={'triton.cudagraphs': True}"
        )


def for_recompute(kwargs: dict[str, Any] | None, recomputes: bool) -> dict[str, Any] | None:
    """``kwargs`` for stages of which some recompute: inductor's random ops as eager's (see the module
    docstring), unless the caller chose ``fallback_random``."""
    if kwargs is None or not recomputes or kwargs.get("backend", "inductor") != "inductor":
        return kwargs
    options = kwargs.get("options") or {}
    return {**kwargs, "options": {"fallback_random": True, **options}}


def check_compile_plan(kwargs: dict[str, Any] | None, shard: int, tp: int) -> None:
    """Compile runs the layers of plain and replicated stages; a ValueError for sharded or split ones,
    whose layers FSDP's and tensor parallelism's hooks gather and re-lay out (not proven here)."""
    if kwargs is not None and (shard > 1 or tp > 1):
        raise ValueError(
            f"compile= is not supported yet with shard={shard} or tp={tp}: FSDP's and tensor parallelism's "
            "module hooks inside the compiled layers are not proven equal to eager here; make the plan "
            "with shard=1 and tp=1 (replicas, dp > 1, are fine), or leave compile out"
        )


def compiled_calls(layers: list[nn.Module], kwargs: dict[str, Any]) -> list[LayerCall]:
    """Per layer: its forward through its class's compiled caller (see the module docstring)."""
    return [_bind(_caller(layer, kwargs), layer) for layer in layers]


def _bind(caller: Callable[[nn.Module, Any], Any], layer: nn.Module) -> LayerCall:
    def call(x: Any) -> Any:
        return caller(layer, x)

    return call


def _caller(layer: nn.Module, kwargs: dict[str, Any]) -> Callable[[nn.Module, Any], Any]:
    """``torch.compile`` of a function of our own that calls a layer, one per kind of layer (its own
    code object, so that its recompilations count against its own limit) and keywords."""
    per_class = _callers.setdefault(type(layer), {})
    key = (_structure(layer), repr(sorted(kwargs.items())))
    if key not in per_class:
        suffix = f"_{len(per_class)}" if per_class else ""
        name = "stagewise_" + re.sub(r"\W", "_", type(layer).__name__) + suffix
        code = _call_layer.__code__.replace(co_name=name)
        if sys.version_info >= (3, 11):  # the name dynamo's logs print
            code = code.replace(co_qualname=name)
        fn = types.FunctionType(code, _call_layer.__globals__, name)
        per_class[key] = torch.compile(fn, **kwargs)
    return per_class[key]


def _call_layer(layer: nn.Module, x: Any) -> Any:
    return layer(x)


def _structure(layer: nn.Module) -> str:
    """What tells a kind of layer: its modules (names, classes), parameters and buffers (names,
    shapes, dtypes). Equal for the blocks of a transformer, which share their compiled code."""
    modules = [(name, type(m).__module__, type(m).__qualname__) for name, m in layer.named_modules()]
    tensors = [
        (name, tuple(t.shape), str(t.dtype))
        for name, t in itertools.chain(layer.named_parameters(), layer.named_buffers())
    ]
    return repr((modules, tensors))
