"""Size computations in a traced graph: never sent across a cut, made again where they are needed.

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

A cut after which some layer needs a symbol that no tensor crossing the cut carries cannot be
made; ``readers`` gives each symbol's last reader for ``layers.cut_blocks`` to check.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

__all__ = ["is_size", "readers", "rebuild", "symbol_of"]

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
    """A call that computes a size (or sizes) from tensors' shapes and other sizes only."""
    if node.op not in ("call_function", "call_method") or not _scalar(node.meta.get("val")):
        return False
    target = node.target
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


def _leaves(node: fx.Node) -> list[fx.Node]:
    """The ``sym_size`` calls a symbolic size node is computed from."""
    if node.target is _SYM_SIZE:
        return [node]
    return [leaf for a in node.all_input_nodes if is_size(a) for leaf in _leaves(a)]


def readers(graph: fx.Graph, layer_of: dict[str, int]) -> dict[str, int]:
    """Symbol -> the last layer whose calls read a size computed from it."""
    last: dict[str, int] = {}
    for node in graph.nodes:
        if node.name not in layer_of:
            continue
        for arg in node.all_input_nodes:
            if is_size(arg) and not _static(arg.meta.get("val")):
                for leaf in _leaves(arg):
                    name = symbol_of(leaf)
                    if name is not None:
                        last[name] = max(last.get(name, -1), layer_of[node.name])
    return last


def rebuild(
    node: fx.Node,
    env: dict[str, Any],
    have: dict[str, fx.Node],
    g: fx.Graph,
    copy_arg: Callable[[fx.Node], Any],
    label: str,
) -> Any:
    """The size ``node`` in the new graph ``g`` (see the module docstring); ``have``: the original
    tensors the stage holds so far, by name; ``env``: the original names -> what stands for them."""
    if node.name in env:
        return env[node.name]
    val = node.meta.get("val")
    if _static(val):
        out: Any = tuple(int(v) for v in val) if isinstance(val, (torch.Size, tuple, list)) else int(val)  # type: ignore[arg-type]
    elif node.target is _SYM_SIZE and isinstance(node.args[0], fx.Node) and node.args[0].name not in env:
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
                f"{label} needs the size {want} ({node.name}) but none of its inputs has a dimension of "
                "that size; make the plan with partition() (which never cuts there)"
            )
        out = g.call_function(_SYM_SIZE, (env[found[0]], found[1]))
        out.meta["val"] = val
    else:
        out = g.node_copy(node, copy_arg)
    env[node.name] = out
    return out
