"""Trace any module into one flat fx graph of its calls, with a sample: ``torch.export`` first, then fx.

    # n: layers, l: layer (a group of traced calls, see layers.py)

    traced = trace(model, sample)        # sample: one micro-batch (a tensor or a tuple of them)
    traced.graph                         # placeholders = the inputs; get_attr = the model's own names
                                         # (or a constant's, tracing.CONSTANT + its flat name)
    traced.layers, traced.values         # the layer graph and what flows between layers (layers.py)

Two tracers, in this order::

    torch.export.export(model, sample)       aten-level calls; shapes of the sample, the batch
         | fails                             dimension left free where the code allows (a smaller
         |                                   last micro-batch runs too); parameters read by
         |                                   get_attr under their names
         v
    torch.fx.symbolic_trace(model)           module-level calls; shapes found by running the graph
         | fails                             on fake tensors of the sample's
         v
    ValueError naming the line each tracer stopped at, and the two ways out: an nn.Sequential of
    the layers, or code torch.export can trace (torch.cond / torch.where instead of a branch on data)

The graph is made ready for cutting: every get_attr names a parameter or buffer by its *canonical*
name, the first name ``named_parameters()`` / ``named_buffers()`` gives it (a weight tied between
the embedding and the head is ``tok.weight`` wherever it is read), export's guard call is dropped,
and ``device`` (where it was traced) is kept, so that a stage built elsewhere can move the device
arguments that tracing wrote into the graph (``torch.arange(T, device=x.device)``).

``fingerprint`` identifies the graph (layers, their calls, the sample's signature): a plan made for
another model, or for another sample shape, is refused by it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from pipeline.runtime.inputs.microbatch import Signature
from pipeline.runtime.trace.layers import Layer, Value, group_layers, live_values, opened_modules
from pipeline.runtime.trace.untraceable import untraceable

__all__ = ["CONSTANT", "Traced", "first_names", "is_constant", "sample_signature", "trace"]

CONSTANT = "_constant_"  # the prefix of a tensor the graph reads that the model does not hold


def is_constant(name: str) -> bool:
    """A stage's buffer that is a traced graph's constant, not one of the model's (not saved or shown)."""
    return name.startswith(CONSTANT)


@dataclass
class Traced:
    """A module's traced graph, its layers and the values between them (see the module docstring).

    ``inputs``: the placeholders, one per tensor of the sample; ``outputs`` and ``out_spec``: the
    flat outputs (node names; None for a constant) and how they make the module's output
    (``pytree.tree_unflatten``); ``constants``: tensors the graph reads that the module does not hold
    (export lifts tensors made in ``forward`` from Python data).
    """

    root: nn.Module
    graph: fx.Graph
    method: str  # "export" or "symbolic_trace"
    inputs: list[str]
    outputs: list[str | None]
    out_spec: pytree.TreeSpec
    out_constants: dict[int, Any]
    constants: dict[str, torch.Tensor]
    layers: list[Layer]
    values: dict[str, Value]
    signature: Signature
    device: torch.device
    fingerprint: str
    stages: int = 2  # the stages its layers are grouped for (layers.py opens modules above 1 / stages)

    def nodes(self) -> dict[str, fx.Node]:
        return {node.name: node for node in self.graph.nodes}


def sample_signature(sample: Any) -> Signature:
    """The sample's (shape, dtype) per tensor; a TypeError for anything but a tensor or tuple of them."""
    items = sample if isinstance(sample, tuple) else (sample,)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        kinds = ", ".join(type(t).__name__ for t in items) or "an empty tuple"
        raise TypeError(
            f"sample must be one micro-batch: a tensor or a tuple of tensors (the model's positional "
            f"inputs), got {kinds}"
        )
    return tuple((tuple(t.shape), t.dtype) for t in items)


def trace(module: nn.Module, sample: Any, method: str = "auto", stages: int = 2) -> Traced:
    """The traced graph of ``module`` on ``sample`` (see the module docstring); the module is not run.

    ``sample`` may live on the meta device (a meta model is traced with meta inputs). ``method``:
    "auto" (export, then fx), "export" or "symbolic_trace" (that tracer only). ``stages``: the
    number of stages its layers are grouped for (layers.py: a module holding more than 1 / stages
    of the calls is split into its children).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(module).__name__}")
    if method not in ("auto", "export", "symbolic_trace"):
        raise ValueError(f"method ({method!r}) must be 'auto', 'export' or 'symbolic_trace'")
    sig = sample_signature(sample)
    opened_modules([], stages)  # checked before tracing
    args = sample if isinstance(sample, tuple) else (sample,)
    device = args[0].device
    mode = module.training
    module.train()  # the pipeline trains; stages follow their own mode where the graph allows (traced.py)
    export_error: BaseException | None = None
    try:
        if method == "symbolic_trace":
            raise RuntimeError("not tried (method='symbolic_trace')")
        found = _export(module, args)
    except Exception as err:
        export_error = err
    try:
        if export_error is not None:
            if method == "export":
                raise RuntimeError("not tried (method='export')")
            found = _symbolic(module, args)
    except Exception as fx_error:
        raise ValueError(untraceable(module, export_error, fx_error)) from fx_error
    finally:
        module.train(mode)
    graph, method, outputs, spec, out_constants, constants = found
    _canonical_names(graph, module)
    layers = group_layers(graph, module, stages)
    inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
    values = live_values(graph, layers, inputs)
    fingerprint = _fingerprint(method, sig, layers, graph)
    return Traced(
        module, graph, method, inputs, outputs, spec, out_constants, constants, layers, values, sig,
        device, fingerprint, stages,
    )  # fmt: skip


# ---- the tracers

_Found = tuple[fx.Graph, str, list[str | None], pytree.TreeSpec, dict[int, Any], dict[str, torch.Tensor]]


def _export(module: nn.Module, args: tuple[torch.Tensor, ...]) -> _Found:
    """export with the batch dimension free (a step's last micro-batch may be smaller), else static."""
    dims = tuple({0: torch.export.Dim.AUTO} if a.dim() > 0 else None for a in args)
    with _quiet():
        try:
            program = torch.export.export(module, args, dynamic_shapes=dims, strict=False)
        except Exception:
            program = torch.export.export(module, args, strict=False)
    try:
        gm = program.module(check_guards=False)  # type: ignore[call-arg]
    except TypeError:  # older torch: no guard switch
        gm = program.module()
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            graph.erase_node(node)
    out = next(n for n in graph.nodes if n.op == "output")
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    spec = gm._out_spec  # the flat outputs -> the module's output
    assert spec is not None, "torch.export gave no output structure"
    constants = _constants(graph, gm, module)
    outputs, out_constants = _flat_outputs(flat)
    return graph, "export", outputs, spec, out_constants, constants


def _symbolic(module: nn.Module, args: tuple[torch.Tensor, ...]) -> _Found:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = fx.symbolic_trace(module)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    with _quiet():
        FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(a, static_shapes=True) for a in args])
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    flat, spec = pytree.tree_flatten(out.args[0])
    constants = _constants(graph, gm, module)
    outputs, out_constants = _flat_outputs(flat)
    return graph, "symbolic_trace", outputs, spec, out_constants, constants


def _constants(graph: fx.Graph, gm: nn.Module, module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the graph reads that ``module`` does not hold, each renamed to one flat name (export
    lifts ``self.x = torch.tensor(...)`` made in a submodule's forward as ``a.b.lifted_tensor_0``; a
    stage holds it as a buffer of its own, which cannot have a dotted name)."""
    out: dict[str, torch.Tensor] = {}
    flat_of: dict[str, str] = {}  # original target -> its flat name (read twice: one buffer)
    for node in graph.nodes:
        if node.op == "get_attr" and not _held(module, str(node.target)):
            target = str(node.target)
            if target not in flat_of:
                flat = CONSTANT + target.replace(".", "_")
                while flat in out:  # "a_b.x" and "a.b_x" flatten alike
                    flat += "_"
                flat_of[target] = flat
                out[flat] = _lookup(gm, target)
            node.target = flat_of[target]
    return out


def _flat_outputs(flat: list[Any]) -> tuple[list[str | None], dict[int, Any]]:
    names: list[str | None] = []
    constants: dict[int, Any] = {}
    for j, item in enumerate(flat):
        if isinstance(item, fx.Node):
            names.append(item.name)
        else:
            names.append(None)
            constants[j] = item
    return names, constants


def _held(module: nn.Module, target: str) -> bool:
    try:
        module.get_submodule(target)
        return True
    except AttributeError:
        pass
    owner, _, name = target.rpartition(".")
    try:
        sub = module.get_submodule(owner)
    except AttributeError:
        return False
    return (
        name in sub._parameters or name in sub._buffers or isinstance(getattr(sub, name, None), torch.Tensor)
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Tracing logs graphs and warnings of its own on failure; the error we raise says what matters."""
    loggers = [
        logging.getLogger(name) for name in ("torch._export", "torch.export", "torch.fx", "torch._dynamo")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


# ---- names and identity


def first_names(module: nn.Module) -> dict[str, str]:
    """Every name of ``module``'s parameters and buffers -> the first name its tensor has, in
    ``named_parameters`` then ``named_buffers`` order: a tied weight's names -> its one name (the
    name graphs, pipelines and checkpoints give it)."""
    first: dict[int, str] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {name: first.setdefault(id(t), name) for name, t in named}


def _canonical_names(graph: fx.Graph, module: nn.Module) -> None:
    """Every get_attr of a parameter or buffer reads it by the first name the module gives it."""
    first = first_names(module)
    seen: dict[str, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        node.target = first.get(str(node.target), node.target)
        same = seen.get(str(node.target))
        if same is not None:  # one get_attr per tensor: a tied weight read twice is one input
            node.replace_all_uses_with(same)
            graph.erase_node(node)
        else:
            seen[str(node.target)] = node


def _lookup(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


# calls that copy, detach or re-lay out a value and change nothing of the model: torch.export
# places them by the device it traces on (a constant lifted on the CPU, a contiguous() on meta), so
# the fingerprint skips them and a plan made on the CPU fits the same model built on meta
_DEVICE_NOISE = frozenset(
    ("aten.lift_fresh_copy.default", "aten.detach_.default", "aten.detach.default",
     "aten.contiguous.default", "aten.alias.default")
)  # fmt: skip


def _fingerprint(method: str, sig: Signature, layers: list[Layer], graph: fx.Graph) -> str:
    calls = {
        n.name: str(n.target)
        for n in graph.nodes
        if n.op in ("call_function", "call_method", "call_module") and str(n.target) not in _DEVICE_NOISE
    }
    text = [method, repr([(list(s), str(d)) for s, d in sig])]
    text += [f"{layer.name}|{layer.kind}|{sum(name in calls for name in layer.nodes)}" for layer in layers]
    text += list(calls.values())
    return hashlib.sha1("\n".join(text).encode()).hexdigest()[:16]
