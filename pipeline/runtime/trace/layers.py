"""A traced graph's layers (its calls grouped by the submodule that owns them) and the values between them.

    # n: layers, l: layer, s: stage, [a, b): the layers of one stage

Grouping. Every call node carries the stack of modules it was called in (``nn_module_stack``,
outermost first). A node belongs to the outermost module of its stack that is not *opened*. The
layers are grouped for k stages (``stages``: partition's p x v), and a stage of a balanced split
holds 1/k of the model; a module holding more than that can only be balanced once it is split, so
every module holding more than 1/k of the model's calls is opened (replaced by its children),
again inside it until each module left is small enough::

    T5, 6 + 6 blocks, 745 calls          k = 2 (> 372)          k = 4 (> 186)
      model.encoder     262 calls        one layer              opened: embed, block.0 .. block.5, norm
      model.decoder     470 calls        opened: block.0 ..     opened
      each block        ~77 calls        one layer each         one layer each

The calls are the measure because grouping comes before any profile (and every rank groups its
trace again, as the plan records: ``TracedGraph.stages``); k = 2 opens the wrappers that hold most
of the model (``self.encoder``, an ``nn.Sequential`` of every block).

Calls of the root itself, or of an opened module outside any child (a residual ``x + block(x)``
written in the loop, a logits slice, a final softcap or scale), are *loose*. A layer is a run of
consecutive calls with the same owner; a loose run that reads a parameter is a layer of its own,
named after its first call, and one that reads none joins a neighbour, losing one of the two
cuts around it: the one that cannot be made anyway (``cut_blocks``: a reduction that drops the
batch dimension joins the layer after it), else the cut before it when it reads a value made
there, else the cut after it. A layer holding no parameter could otherwise be given a rank of
its own (a 0.07 ms multiply), where an optimizer over the rank's parameters finds none::

    tok | pos + add | blocks.0 | blocks.1 | ... | ln | head + scale
    one layer per transformer block; a module called in one go is one contiguous run
    (the positions' ``arange`` is no layer: it is made from sizes alone, see sizes.py)

An ``operator.getitem`` on a call that returns several values joins that call's layer, so a tuple
never has to cross a cut. The layers, in the order their first calls run, are a topological order
of the layer DAG, and a stage is a contiguous range of them.

Values. For every placeholder and call: the layer that makes it (-1 for an input), the layers
that read it (n for the model's output), its bytes, and why it could not cross a cut (a Python
int or list, a tensor whose shape depends on the data), if so. The value is live across the cut
after layer l when it is made at or before l and read after l: ``crossing(values, l)``.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from pipeline.runtime.trace.sizes import is_tensor, mark_derived, readers, recomputed, writes_input

__all__ = [
    "Layer",
    "Value",
    "crossing",
    "cut_blocks",
    "group_layers",
    "live_values",
    "opened_modules",
    "reads",
    "size_hint",
    "writes_input",
]

_CALLS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class Layer:
    """Layer l: a module's calls (``name`` its path, ``kind`` its class) or a run of loose calls
    (``name`` its first call's node, ``kind`` that call's op). ``nodes``: fx node names, in order."""

    name: str
    kind: str
    nodes: tuple[str, ...]
    params: tuple[str, ...]  # the parameters and buffers it reads (get_attr targets, module paths)


@dataclass(frozen=True)
class Value:
    """A placeholder's or call's value: made by ``layer`` (-1: an input), read by ``uses`` (n: output)."""

    name: str
    layer: int
    uses: tuple[int, ...]
    nbytes: int
    why: str  # "" if a cut can carry it, else what it is ("a Python int", ...)
    symbols: frozenset[str] = frozenset()  # its free dimensions (the batch size's symbol), by name

    @property
    def last(self) -> int:
        return max(self.uses, default=self.layer)


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """(path, class name) of the modules the node was called in, outermost first, without the root."""
    raw = node.meta.get("nn_module_stack") or {}
    out = []
    for path, kind in raw.values():
        name = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
        if path and not str(path).startswith("_empty_nn_module_stack"):  # export's placeholder entry
            out.append((str(path), name.rsplit(".", 1)[-1]))
    if node.op == "call_module" and (not out or out[-1][0] != node.target):
        out.append((str(node.target), "module"))
    return out


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", str(target))
    return str(name).replace(".default", "")


def group_layers(graph: fx.Graph, module: nn.Module, stages: int = 2) -> list[Layer]:
    """The layers of ``graph``, traced from ``module`` (see the module docstring), in the order their
    first calls run; ``stages``: how many stages they are grouped for (``opened_modules``)."""
    mark_derived(graph)
    calls = [n for n in graph.nodes if n.op in _CALLS and not recomputed(n)]  # no layer's (sizes.py)
    opened = opened_modules(calls, stages)
    owner: dict[str, int] = {}
    runs: list[_Run] = []
    for node in calls:
        producer = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(producer, fx.Node) and producer.name in owner and not is_tensor(producer):
            runs[owner[producer.name]].nodes.append(node)  # a part of a multi-value result stays with it
            owner[node.name] = owner[producer.name]
            continue
        key = next(((p, k) for p, k in _stack(node) if p not in opened), None)
        path = None if key is None else key[0]
        if not runs or runs[-1].path != path or (path is None and runs[-1].path is not None):
            kind = key[1] if key is not None else _op_name(node)
            runs.append(_Run(path, kind, []))
        runs[-1].nodes.append(node)
        owner[node.name] = len(runs) - 1
    each = _layers(runs)
    inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
    blocked = cut_blocks(graph, each, live_values(graph, each, inputs), module)
    parameters = {name for name, _ in module.named_parameters()}  # the names get_attr reads them by
    return _layers(_join_loose(runs, parameters, blocked))


def opened_modules(calls: list[fx.Node], stages: int) -> set[str]:
    """The modules replaced by their children: each holding more than 1 / ``stages`` of the calls."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(
            f"stages ({stages!r}) must be an integer >= 1: the stages the layers are grouped for"
        )
    counts: Counter[str] = Counter(path for node in calls for path, _ in _stack(node))
    return {path for path, count in counts.items() if stages * count > len(calls)}


@dataclass
class _Run:
    """Consecutive calls with one owner: a module's path, or None for loose calls."""

    path: str | None
    kind: str
    nodes: list[fx.Node]


def _layers(runs: list[_Run]) -> list[Layer]:
    names: Counter[str] = Counter()
    layers = []
    for run in runs:
        base = run.path if run.path is not None else run.nodes[0].name
        names[base] += 1
        name = base if names[base] == 1 else f"{base}#{names[base]}"  # a module called again later
        layers.append(
            Layer(name, run.kind, tuple(n.name for n in run.nodes), tuple(sorted(reads(run.nodes))))
        )
    return layers


def _join_loose(runs: list[_Run], parameters: set[str], blocked: list[str]) -> list[_Run]:
    """``runs`` with every loose run that reads no parameter joined to a neighbour (the docstring):
    across a cut that cannot be made anyway (``blocked[l]``: the cut after run l), else the run
    before it if it reads a value made there, else the run after it."""
    n = len(runs)
    joins = [n > 1 and run.path is None and not reads(run.nodes) & parameters for run in runs]
    after = [False] * n  # run j joins the run after it (else the run before it)
    for j, run in enumerate(runs):
        if not joins[j]:
            continue
        if j == 0 or j == n - 1:
            after[j] = j == 0
        elif blocked[j - 1] or blocked[j]:
            after[j] = not blocked[j - 1]
        else:
            made = {node.name for node in runs[j - 1].nodes}
            after[j] = not any(a.name in made for node in run.nodes for a in node.all_input_nodes)
    out: list[_Run] = []
    waiting: list[fx.Node] = []  # calls that join the next run
    for j, run in enumerate(runs):
        if joins[j] and after[j]:
            waiting.extend(run.nodes)
        elif joins[j]:
            out[-1].nodes.extend(run.nodes)
        else:
            out.append(_Run(run.path, run.kind, waiting + run.nodes))
            waiting = []
    return out


def reads(nodes: list[fx.Node]) -> set[str]:
    """The get_attr targets and called module paths of ``nodes`` (what a stage of them must hold),
    those that the derived tensors they read are made from included (sizes.py)."""
    out: set[str] = set()
    todo, seen = list(nodes), set()
    while todo:
        node = todo.pop()
        if node.op == "call_module":
            out.add(str(node.target))
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                out.add(str(arg.target))
            elif recomputed(arg) and arg.name not in seen:
                seen.add(arg.name)
                todo.append(arg)
    return out


def _describe(node: fx.Node) -> tuple[int, str]:
    """(bytes, why it cannot cross a cut or "") of the node's value."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        sizes = [size_hint(d) for d in val.shape]
        if any(d is None for d in sizes):
            return 0, f"a tensor whose shape depends on the data ({list(val.shape)})"
        return math.prod(sizes) * val.element_size(), ""  # type: ignore[arg-type]
    if val is None and "val" not in node.meta:
        return 0, "a value of unknown type"
    return 0, f"a Python {type(val).__name__} ({_short(val)}), not a tensor"


def size_hint(d: Any) -> int | None:
    """A dimension's size in the sample: itself, a free (batch) size's value, None if data decides it."""
    if isinstance(d, int):
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def _short(val: Any) -> str:
    text = repr(val)
    return text if len(text) <= 60 else text[:57] + "..."


def live_values(graph: fx.Graph, layers: list[Layer], inputs: list[str]) -> dict[str, Value]:
    """Every input's and call's value, with the layers that make and read it (see the docstring)."""
    n = len(layers)
    where = {name: at for at, layer in enumerate(layers) for name in layer.nodes}
    for name in inputs:
        where[name] = -1
    out: dict[str, Value] = {}
    for node in graph.nodes:
        if node.name not in where:
            continue
        uses = sorted(
            {
                n if u.op == "output" else where[u.name]
                for u in node.users
                if u.name in where or u.op == "output"
            }
        )
        nbytes, why = _describe(node)
        free = frozenset(str(d) for d in getattr(node.meta.get("val"), "shape", ()) if not isinstance(d, int))
        out[node.name] = Value(node.name, where[node.name], tuple(uses), nbytes, why, free)
    return out


def crossing(values: dict[str, Value], cut: int) -> list[Value]:
    """The values live across the cut after layer ``cut``, in graph order (inputs first)."""
    return [v for v in values.values() if v.layer <= cut < v.last]


def cut_blocks(
    graph: fx.Graph, layers: list[Layer], values: dict[str, Value], module: nn.Module
) -> list[str]:
    """Per cut l (after layer l, l < n - 1): why no stage boundary may fall there ("" if one may).

    A cut carries tensors only, of shapes known before the step; and a stage's inputs are leaves of
    autograd, which refuse an in-place write, so no cut may separate a value from a later layer
    that writes into it.
    """
    n = len(layers)
    reasons = [""] * max(0, n - 1)
    for v in values.values():
        if v.why:
            for cut in range(max(v.layer, 0), min(v.last, n - 1)):
                maker = "the model's input" if v.layer < 0 else f"layer {v.layer} ({layers[v.layer].name})"
                reasons[cut] = reasons[cut] or f"{v.name}, made by {maker}, is {v.why}"
    where = {name: at for at, layer in enumerate(layers) for name in layer.nodes}
    for symbol, last in readers(graph, where).items():  # a size a later layer reads: carried by a tensor
        for cut in range(min(last, n - 1)):
            if not reasons[cut] and not any(symbol in v.symbols for v in crossing(values, cut)):
                data = " (a size that depends on the data)" if symbol.startswith("u") else ""  # unbacked
                reasons[cut] = (
                    f"layer {last} ({layers[last].name}) reads the size {symbol}{data}, which no tensor "
                    "crossing this cut has as a dimension"
                )
    for node in graph.nodes:
        if node.name not in where:
            continue
        target = writes_input(node, module)
        if target is None or target.name not in values:
            continue
        made, at = values[target.name].layer, where[node.name]
        for cut in range(max(made, 0), at):
            reasons[cut] = reasons[cut] or (
                f"layer {at} ({layers[at].name}) writes into {target.name} in place ({node.name}), which "
                f"{'is the model input' if made < 0 else f'layer {made} ({layers[made].name}) made'}"
            )
    return reasons
