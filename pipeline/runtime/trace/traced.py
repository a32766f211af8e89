"""Stages of a traced model: one fx ``GraphModule`` per stage, passing the tensors live across its cuts.

    # n: layers, k: stages, s: stage, l: layer, [a, b): the layers of stage s

Stage s runs the calls of layers [a, b) of the traced graph (tracing.py, layers.py). What it takes
and gives are the values live across its cuts, each in graph order (the model's inputs first)::

    layers   0     1     2     3     4          a skip from layer 0 to layer 4 crosses every cut
    stage  [  0  ]|[    1    ]|[  2  ]           in between: stage 1 takes it and hands it on
    values   x0 ---------------------> (skip)
             x0 -> x1 -> x2 -> x3 -> x4
    stage 1 takes (x0, x1), gives (x0, x3); stage 2 takes (x0, x3) and returns the model's output

A stage takes one argument, the batch as the pipeline passes it (a tensor when one value crosses,
else a tuple), checks its shapes against the traced ones (the sample's: a step whose micro-batches
differ is refused, naming the stage), and returns a tensor or a tuple the same way; the last stage
returns the model's own output structure. A value that is not a tensor (a Python int, a list) or
whose shape depends on the data cannot cross a cut: building such a stage raises, naming the value,
the layer that makes it and the stage.

Parameters and buffers keep the model's names (``blocks.3.attn.qkv.weight``): a stage holds the
model's own submodules that own what it reads, at their paths, under plain containers
(``holder``). ``init_fn`` and ``reset_parameters`` therefore see the model's real module classes,
optimizers and checkpoints see the model's names, and a parameter read by two stages (a tied
weight) is the same object in both until they are placed on different ranks (ties.py).

``device``: tracing writes its device into calls that make tensors (``arange(..., device=meta)``);
a stage built for another device has those arguments moved to it. Dropout and batch norm read
the stage's own ``training`` flag (modes.py), so ``stage.eval()`` evaluates as the model does.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from pipeline.runtime.trace.layers import crossing
from pipeline.runtime.trace.modes import follow_mode
from pipeline.runtime.trace.sizes import rebuild, recomputed, symbols_read
from pipeline.runtime.trace.tracing import Traced

__all__ = [
    "StageSpec",
    "build",
    "build_stages",
    "check_batch",
    "holder",
    "layer_spec",
    "stage_specs",
]


@dataclass(frozen=True)
class StageSpec:
    """What one stage (or one layer, when profiling) computes: its layers, the values it takes
    (batch order) and gives (None: the model's output)."""

    label: str
    layers: range
    inputs: tuple[str, ...]
    outputs: tuple[str, ...] | None


def stage_specs(traced: Traced, balance: Sequence[int]) -> list[StageSpec]:
    """One spec per stage of ``balance`` (layers per stage); raises for a value no cut can carry."""
    n = len(traced.layers)
    if sum(balance) != n or any(b < 1 for b in balance):
        raise ValueError(f"balance {list(balance)} must be positive layer counts adding up to the {n} layers")
    specs, start = [], 0
    k = len(balance)
    for s, size in enumerate(balance):
        stop = start + size
        inputs = tuple(traced.inputs) if s == 0 else _live(traced, start - 1, s)
        outputs = None if s == k - 1 else _live(traced, stop - 1, s)
        specs.append(StageSpec(f"stage {s}", range(start, stop), inputs, outputs))
        start = stop
    return specs


def layer_spec(traced: Traced, layer: int) -> StageSpec:
    """Layer l alone: the values its calls read from outside it (and a tensor live there that carries
    each size its derived tensors read), and those it makes that are read later."""
    members = set(traced.layers[layer].nodes)
    nodes = traced.nodes()
    wanted: dict[str, None] = {}
    for name in traced.layers[layer].nodes:
        for arg in nodes[name].all_input_nodes:
            if arg.name not in members and arg.name in traced.values:  # not a parameter, not a size
                wanted[arg.name] = None
    needs = {symbol for name in traced.layers[layer].nodes for symbol in symbols_read(nodes[name])}
    carried = {symbol for name in wanted for symbol in traced.values[name].symbols}
    if needs - carried:  # a size its derived tensors read, off a tensor that is live there (sizes.py)
        live = [*crossing(traced.values, layer - 1), *(traced.values[name] for name in traced.inputs)]
        for symbol in sorted(needs - carried):
            carrier = next((v.name for v in live if symbol in v.symbols), None)
            if carrier is not None:
                wanted[carrier] = None
    order = {name: j for j, name in enumerate(traced.values)}
    inputs = tuple(sorted(wanted, key=order.__getitem__))
    outputs = tuple(v.name for v in traced.values.values() if v.layer == layer and v.last > layer)
    label = f"layer {layer} ({traced.layers[layer].name})"
    return StageSpec(label, range(layer, layer + 1), inputs, outputs)


def _live(traced: Traced, cut: int, s: int) -> tuple[str, ...]:
    live = crossing(traced.values, cut)
    for v in live:
        if v.why:
            made = "the model's input" if v.layer < 0 else f"layer {v.layer} ({traced.layers[v.layer].name})"
            raise ValueError(
                f"the cut after layer {cut} ({traced.layers[cut].name}), between stages {s} and "
                f"{s + 1}, would carry {v.name} from {made}, which is {v.why}: a cut carries tensors of "
                "known shape only; make the plan with partition() (which never cuts there) or change "
                "the layer to return tensors"
            )
    return tuple(v.name for v in live)


# ---- the modules


def holder(root: nn.Module, targets: Iterable[str], constants: dict[str, torch.Tensor]) -> nn.Module:
    """A plain module holding, at their paths in ``root``, root's own submodules that own ``targets``
    (get_attr names and called module paths), and the parameters and buffers they name.

    A tensor's owner is held whole, as the model's own module (its class's ``reset_parameters``
    and an ``init_fn`` see it), unless that would bring tensors of its children that ``targets``
    do not name: BART's ``final_logits_bias`` belongs to the whole model, and a layer adding it
    must not hold (nor tie across stages) every weight. Such a tensor is held alone, at its path
    under plain containers, as root's own tensors are."""
    out = nn.Module()
    targets = list(targets)
    wanted = _tensor_ids(root, [t for t in targets if t not in constants])
    owners: set[str] = set()
    alone: list[str] = []
    for target in targets:
        if target in constants:
            out.register_buffer(target, constants[target], persistent=False)
            continue
        path = target.rpartition(".")[0]
        if isinstance(_get(root, target), nn.Module):
            owners.add(target)
        elif path and _only(root.get_submodule(path), wanted):
            owners.add(path)
        else:
            alone.append(target)
    # in root's module order: a parameter held under two paths (BERT's decoder.weight, the word
    # embedding) then has in the holder the first name it has in root, the name the graph reads
    order = {path: j for j, (path, _) in enumerate(root.named_modules(remove_duplicate=False))}
    attached: list[str] = []
    for path in sorted(owners, key=lambda p: (order.get(p, len(order)), p)):
        if any(path == a or path.startswith(a + ".") for a in attached):
            continue  # inside a module held already
        _attach(out, path, root.get_submodule(path))
        attached.append(path)
    for target in sorted(alone):
        if not any(target.startswith(a + ".") for a in attached):
            _hold(out, root, target)
    return out


def _tensor_ids(root: nn.Module, targets: list[str]) -> set[int]:
    """The tensors ``targets`` name, those of the modules they name included, by identity."""
    out: set[int] = set()
    for target in targets:
        obj = _get(root, target)
        if isinstance(obj, nn.Module):
            out.update(id(t) for t in itertools.chain(obj.parameters(), obj.buffers()))
        else:
            out.add(id(obj))
    return out


def _only(owner: nn.Module, wanted: set[int]) -> bool:
    """Whether every tensor that ``owner``'s children hold is one of ``wanted``."""
    return all(
        id(t) in wanted
        for child in owner.children()
        for t in itertools.chain(child.parameters(), child.buffers())
    )


def _hold(out: nn.Module, root: nn.Module, target: str) -> None:
    """Root's tensor ``target`` (a parameter or buffer), itself, at its path in ``out``."""
    path, _, name = target.rpartition(".")
    owner = root.get_submodule(path)
    at = out
    for part in path.split(".") if path else ():
        nxt = at._modules.get(part)
        if nxt is None:
            nxt = nn.Module()
            at.add_module(part, nxt)
        at = nxt
    if name in owner._parameters:
        at.register_parameter(name, owner._parameters[name])
    else:  # a buffer, or a plain tensor attribute (in no state dict: not persistent)
        persistent = name in owner._buffers and name not in owner._non_persistent_buffers_set
        at.register_buffer(name, getattr(owner, name), persistent=persistent)


def _get(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _attach(out: nn.Module, path: str, module: nn.Module) -> None:
    *parents, last = path.split(".")
    at = out
    for part in parents:
        nxt = at._modules.get(part)
        if nxt is None:
            nxt = nn.Module()
            at.add_module(part, nxt)
        at = nxt
    at.add_module(last, module)


def build(
    traced: Traced, spec: StageSpec, held: nn.Module, device: torch.device | None = None
) -> fx.GraphModule:
    """The ``GraphModule`` of ``spec`` over the modules of ``held`` (see ``holder``)."""
    nodes = traced.nodes()
    members = [name for at in spec.layers for name in traced.layers[at].nodes]
    member_set = set(members)
    g = fx.Graph()
    batch = g.placeholder("batch")
    expected = tuple(_shape(nodes[name]) for name in spec.inputs)
    g.call_function(check_batch, (batch, expected, spec.label))
    env: dict[str, Any] = {}
    have: dict[str, fx.Node] = {}  # the original tensors the stage holds so far (sizes are read off them)
    for j, name in enumerate(spec.inputs):
        env[name] = batch if len(spec.inputs) == 1 else g.call_function(operator.getitem, (batch, j))
        have[name] = nodes[name]
    attrs: dict[str, fx.Node] = {}

    def arg(node: fx.Node) -> Any:
        if node.op == "get_attr":
            if node.target not in attrs:
                attrs[str(node.target)] = g.get_attr(str(node.target))
            return attrs[str(node.target)]
        if node.name not in env and recomputed(node):
            return rebuild(node, env, have, g, arg, spec.label)
        return env[node.name]

    for node in traced.graph.nodes:
        if node.name in member_set:
            env[node.name] = g.node_copy(node, arg)
            have[node.name] = node
    if spec.outputs is None:
        flat = [
            arg(nodes[name]) if name is not None else traced.out_constants[j]
            for j, name in enumerate(traced.outputs)
        ]
        g.output(pytree.tree_unflatten(flat, traced.out_spec))
    else:
        outs = [env[name] for name in spec.outputs]
        g.output(outs[0] if len(outs) == 1 else tuple(outs))
    if device is not None:
        _retarget(g, traced.device, torch.device(device))
    follow_mode(g)
    gm = fx.GraphModule(held, g, class_name="Stage")
    for name, child in held._modules.items():  # the model's own modules, not GraphModule's copies
        gm._modules[name] = child
    gm._non_persistent_buffers_set = set(held._non_persistent_buffers_set)
    return gm


def build_stages(
    traced: Traced,
    balance: Sequence[int],
    stages: Iterable[int] | None = None,
    device: torch.device | None = None,
) -> dict[int, fx.GraphModule]:
    """The stage modules of ``balance`` (only ``stages``, if given), holding the model's own modules."""
    specs = stage_specs(traced, balance)
    wanted = range(len(specs)) if stages is None else stages
    out = {}
    for s in wanted:
        spec = specs[s]
        targets = {t for at in spec.layers for t in traced.layers[at].params}
        out[s] = build(traced, spec, holder(traced.root, targets, traced.constants), device)
    return out


def _shape(node: fx.Node) -> tuple[int | str, ...]:
    """The traced shape; a free (batch) dimension is its symbol's name, and matches any size."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return ()
    return tuple(d if isinstance(d, int) else str(d) for d in val.shape)


def check_batch(batch: Any, expected: tuple[tuple[int | str, ...], ...], label: str) -> None:
    """Raise unless ``batch``'s tensors have the traced shapes (called first in every stage)."""
    got = batch if isinstance(batch, tuple) else (batch,)
    shapes = tuple(tuple(int(d) for d in t.shape) if isinstance(t, torch.Tensor) else () for t in got)
    fits = len(shapes) == len(expected) and all(
        len(have) == len(want) and all(isinstance(w, str) or h == w for h, w in zip(have, want, strict=True))
        for have, want in zip(shapes, expected, strict=True)
    )
    if not fits:
        raise ValueError(
            f"{label} was traced for inputs of shapes {_fmt(expected)} (from the sample given to partition), "
            f"but got {_fmt(shapes)}; a traced stage runs the shapes it was traced with, any batch size "
            "aside: pass partition a sample of one micro-batch shaped like the step's, and plan again"
        )


def _fmt(shapes: tuple[tuple[int | str, ...], ...]) -> str:
    return str([[d if isinstance(d, int) else "any" for d in shape] for shape in shapes]).replace("'", "")


def _retarget(g: fx.Graph, old: torch.device, new: torch.device) -> None:
    """Device arguments of ``old`` (where it was traced), and of the meta device (a meta model traced
    with a real sample: its parameters' device), now ``new``."""
    olds = (old, torch.device("meta"))

    def move(a: Any) -> Any:
        return new if isinstance(a, torch.device) and a in olds else a

    for node in g.nodes:
        node.args = fx.node.map_aggregate(node.args, move)  # type: ignore[assignment]
        node.kwargs = fx.node.map_aggregate(node.kwargs, move)  # type: ignore[assignment]
