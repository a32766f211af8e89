"""Sizes, and tensors made from sizes alone, in a traced graph: never sent across a cut, made again
where they are needed.

    # l: layer, s: stage

``b, t, c = x.shape`` in a block becomes size nodes: ``sym_size(x, 0)`` (export, with the batch
dimension free, gives a symbol such as ``s0``), ``x.size(0)`` (fx, an int), and arithmetic on them
(``c // n_heads``). They belong to no layer and never cross a cut (the pipeline sends tensors).
A stage that reads one makes it again (``rebuild``)::

    a static size (an int, a torch.Size)     the number itself, as a constant
    sym_size(x, d) whose x the stage has     the same call
    sym_size(x, d) of a tensor it has not    sym_size(y, e) of a tensor y the stage has whose
                                             dimension e is the same symbol (every activation
                                             carries the batch size)
    arithmetic on sizes                      the same call, on its rebuilt arguments

Tensors made from sizes (``mark_derived``): models build position ids, attention masks, rotary
tables and cache positions with ``arange``, ``ones``, ``full`` and friends from their input's sizes
and their own buffers. Such a call reads only sizes, constants, buffers that nothing writes, and
other such calls; it draws no random numbers and writes into nothing. It is *derived*: it belongs to
no layer either, never crosses a cut, and every stage that reads it computes it again from its own
inputs' sizes, the same way::

    arange(sym_size(x, 1)) --> unsqueeze --> cos/sin(inv_freq * ...) --> every decoder layer
    (x: the model's input ids; a later stage reads the sequence length off the hidden states)

Each layer's parameter list includes the buffers its derived values read (``inv_freq``), so a
stage holds what it needs to make them.

A cut after which some layer needs a symbol that no tensor crossing the cut carries cannot be
made; ``readers`` gives each symbol's last reader (through derived values too) for
``layers.cut_blocks`` to check.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

__all__ = [
    "is_derived",
    "is_size",
    "is_tensor",
    "mark_derived",
    "readers",
    "rebuild",
    "recomputed",
    "symbol_of",
    "symbols_read",
    "writes_input",
]

_SYM_SIZE = torch.ops.aten.sym_size.int
_ARITHMETIC = {
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod,
    operator.neg, operator.pow, math.ceil, math.floor, math.prod,
    torch.sym_int, torch.sym_max, torch.sym_min, torch.sym_sqrt,
}  # fmt: skip
_METHODS = {"size", "dim", "numel"}


def _scalar(val: Any) -> bool:
    if isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool):
        return True
    return isinstance(val, (torch.Size, tuple, list)) and all(_scalar(v) for v in val)


def is_size(node: fx.Node) -> bool:
    """A call that computes a size (or sizes) from tensors' shapes and other sizes only, or reads a
    tensor's device or dtype (``x.device`` in an fx trace: a constant of the trace, moved by traced.py)."""
    target = node.target
    if _attribute(node):
        return True
    if node.op not in ("call_function", "call_method") or not _scalar(node.meta.get("val")):
        return False
    if target in (_SYM_SIZE, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int):
        return True
    if node.op == "call_method":
        return target in _METHODS
    if target is getattr:
        return len(node.args) > 1 and node.args[1] == "shape"
    if target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and is_size(src)
    return target in _ARITHMETIC and all(is_size(a) for a in node.all_input_nodes)


def _attribute(node: fx.Node) -> bool:
    """``x.device`` or ``x.dtype`` of a traced tensor (fx records no value for it)."""
    if node.op != "call_function" or node.target is not getattr or len(node.args) < 2:
        return False
    src = node.args[0]
    return node.args[1] in ("device", "dtype") and isinstance(src, fx.Node) and is_tensor(src)


def is_tensor(node: fx.Node) -> bool:
    """The node's traced value is a tensor."""
    return isinstance(node.meta.get("val"), torch.Tensor)


_DERIVED = "stagewise_derived"  # node.meta key set by mark_derived
# random calls outside aten (the fx tracer's torch functions): a second draw would differ
_RANDOM = {
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.bernoulli, torch.normal, torch.multinomial, torch.poisson,
    torch.nn.functional.dropout,
}  # fmt: skip
# calls that only check what tracing assumed and give nothing: a stage may skip them
_CHECKS = {
    torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default,
    torch.ops.aten._assert_async.msg, torch.ops.aten.sym_constrain_range_for_size.default,
}  # fmt: skip
# fx's tensor methods that return a view of their tensor (aten ops say so in their schema)
_VIEW_METHODS = {
    "view", "view_as", "reshape", "reshape_as", "expand", "expand_as", "transpose", "permute", "t",
    "squeeze", "unsqueeze", "flatten", "unflatten", "narrow", "select", "diagonal", "unfold", "chunk",
    "split", "unbind", "as_strided", "__getitem__", "T", "mT", "detach",
}  # fmt: skip


def mark_derived(graph: fx.Graph) -> None:
    """Mark the graph's derived calls (see the module docstring); idempotent."""
    written = _written_aliases(graph)
    for node in graph.nodes:  # topological: a call's inputs are decided before it
        node.meta[_DERIVED] = _derivable(node, written)


def _derivable(node: fx.Node, written: set[str]) -> bool:
    if node.op not in ("call_function", "call_method") or is_size(node) or node.name in written:
        return False
    if writes_input(node) is not None or _random(node.target):
        return False
    val = node.meta.get("val")
    tensors = val if isinstance(val, (tuple, list)) else (val,)
    if not all(isinstance(t, torch.Tensor) for t in tensors) and node.target not in _CHECKS:
        return False
    for arg in node.all_input_nodes:
        if is_size(arg) or arg.meta.get(_DERIVED):
            continue
        held = arg.meta.get("val")
        if arg.op != "get_attr" or arg.name in written:
            return False
        # a tensor that requires grad (a trainable parameter): its gradient must flow to one owner
        if not isinstance(held, torch.Tensor) or held.requires_grad:
            return False
    return True


def _written_aliases(graph: fx.Graph) -> set[str]:
    """Every node whose storage some call writes into: the written value, the tensor it is a view
    of, and every other view of that tensor (a write through ``m[:, :2].copy_`` changes ``m``)."""
    base: dict[str, str] = {}  # node -> the node whose storage it is (views chained to their root)
    for node in graph.nodes:
        src = _viewed(node)
        base[node.name] = base.get(src.name, src.name) if src is not None else node.name
    roots = set()
    for node in graph.nodes:
        target = writes_input(node)
        if target is not None:
            roots.add(base.get(target.name, target.name))
    return {name for name, root in base.items() if root in roots}


def _viewed(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` returns a view of, if it does."""
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        returns = schema.returns[0].alias_info if schema.returns else None
        return first if returns is not None and not returns.is_write else None
    if node.op == "call_method" or node.target is getattr:
        name = node.args[1] if node.target is getattr else node.target
        return first if name in _VIEW_METHODS else None
    return first if node.target is operator.getitem and is_tensor(first) else None


def writes_input(node: fx.Node, module: torch.nn.Module | None = None) -> fx.Node | None:
    """The argument ``node`` writes into: an in-place op (by its schema, keyword arguments such as
    ``out=`` included), a method or function named with a trailing ``_``, ``inplace=True``, or a
    module called with ``inplace=True`` (given the model), ``x[i] = v``; None if it writes nothing."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        for j, argument in enumerate(schema.arguments):
            given = node.args[j] if j < len(node.args) else node.kwargs.get(argument.name)
            info = argument.alias_info
            if info is not None and info.is_write and isinstance(given, fx.Node):
                return given
        return None
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if node.op in ("call_method", "call_function") and name.endswith("_") and not name.endswith("__"):
        return first
    if node.op == "call_function" and (node.kwargs.get("inplace") is True or target is operator.setitem):
        return first
    held = module.get_submodule(str(target)) if node.op == "call_module" and module is not None else None
    return first if getattr(held, "inplace", False) is True else None


def _random(target: Any) -> bool:
    tags = getattr(target, "tags", None)
    if tags is not None:
        return torch.Tag.nondeterministic_seeded in tags
    if isinstance(target, str):  # a method: x.uniform_(), x.bernoulli()
        return target.rstrip("_") in ("uniform", "normal", "bernoulli", "random", "exponential", "geometric")
    return target in _RANDOM


def is_derived(node: fx.Node) -> bool:
    """A tensor call made from sizes, constants and unwritten buffers alone (``mark_derived``)."""
    return bool(node.meta.get(_DERIVED))


def recomputed(node: fx.Node) -> bool:
    """Made again by each stage that reads it, never a layer's: a size or a derived tensor."""
    return is_size(node) or is_derived(node)


def _static(val: Any) -> bool:
    if isinstance(val, (torch.Size, tuple, list)):
        return all(_static(v) for v in val)
    return isinstance(val, int)


def symbol_of(node: fx.Node) -> str | None:
    """The symbol a ``sym_size`` call gives (e.g. "s0"), None for anything else."""
    val = node.meta.get("val")
    if node.target is _SYM_SIZE and isinstance(val, torch.SymInt):
        return str(val)
    return None


def _line(node: fx.Node) -> str:
    """ ", made at <file>, line <n>" of the model's code that made ``node`` (or, for a size that
    torch's own passes made, the code that reads it), if the trace recorded it."""
    for made in (node, *node.users):
        frames = [f.strip() for f in str(made.meta.get("stack_trace") or "").splitlines()]
        mine = [f for f in frames if f.startswith("File ") and "/torch/" not in f and '"torch/' not in f]
        if mine:
            return f", made at {mine[-1]}"
    return ""


def symbols_read(node: fx.Node) -> set[str]:
    """The symbols of the sizes that ``node`` reads, directly or through derived tensors."""
    out: set[str] = set()
    todo = [a for a in node.all_input_nodes if recomputed(a)]
    seen = {a.name for a in todo}
    while todo:
        arg = todo.pop()
        name = symbol_of(arg)
        if name is not None:
            out.add(name)
            continue
        for a in arg.all_input_nodes:
            if recomputed(a) and a.name not in seen:
                seen.add(a.name)
                todo.append(a)
    return out


def readers(graph: fx.Graph, layer_of: dict[str, int]) -> dict[str, int]:
    """Symbol -> the last layer whose calls read a size (or a derived tensor) computed from it; the
    model's output counts as read by the last layer (the last stage makes a derived output again)."""
    final = max(layer_of.values(), default=-1)
    last: dict[str, int] = {}
    for node in graph.nodes:
        if node.name in layer_of or node.op == "output":
            for name in symbols_read(node):
                last[name] = max(last.get(name, -1), layer_of.get(node.name, final))
    return last


def rebuild(
    node: fx.Node,
    env: dict[str, Any],
    have: dict[str, fx.Node],
    g: fx.Graph,
    copy_arg: Callable[[fx.Node], Any],
    label: str,
) -> Any:
    """The size or derived tensor ``node`` in the new graph ``g`` (see the module docstring); ``have``:
    the original tensors the stage holds so far, by name; ``env``: the original names -> what stands
    for them."""
    if node.name in env:
        return env[node.name]
    val = node.meta.get("val")
    if _attribute(node):  # where and in what it was traced: traced.py moves the device
        out: Any = getattr(node.args[0].meta["val"], str(node.args[1]))  # type: ignore[union-attr]
    elif _static(val):
        out = tuple(int(v) for v in val) if isinstance(val, (torch.Size, tuple, list)) else int(val)  # type: ignore[arg-type]
    elif (
        node.target is _SYM_SIZE
        and isinstance(node.args[0], fx.Node)
        and node.args[0].name not in env
        and not recomputed(node.args[0])  # a derived tensor's size: that tensor is made again
    ):
        want = str(val)
        found = next(
            (
                (name, d)
                for name, src in have.items()
                if isinstance(src.meta.get("val"), torch.Tensor)
                for d, size in enumerate(src.meta["val"].shape)
                if str(size) == want
            ),
            None,
        )
        if found is None:
            raise ValueError(
                f"{label} needs the size {want} ({node.name}{_line(node)}) but no tensor it receives has a "
                "dimension of that size: a cut before it must carry one; keep the balance partition() "
                "chose (it never cuts there), or make a tensor with that dimension cross the cut"
            )
        out = g.call_function(_SYM_SIZE, (env[found[0]], found[1]))
        out.meta["val"] = val
    else:
        out = g.node_copy(node, copy_arg)
    env[node.name] = out
    return out
