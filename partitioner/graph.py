"""The layer graph: one node per layer, edges carrying the tensors that flow between layers.

    # l: layer (node, in execution order), n: layers; "the cut after layer l" is cut l

An ``nn.Sequential`` gives a chain; a traced model (``pipeline.runtime.trace.layers``) gives a DAG, and
the cut after layer l costs every tensor live across it::

    0 --> 1 --> 2 --> 3         cut 1 (|):  tensors 1->2 and 0->3 cross it
     \\    |          ^          cut_bytes[1] = bytes(1->2) + bytes(0->3)
      `---|----------'

An edge carries ``bytes``; a traced graph's edges also name their tensors (``tensors``: name ->
bytes), and a tensor read by several later layers (0 -> 2 and 0 -> 3) is live until its last
reader and counts once per cut, not once per reader. A model input read after layer 0 is live
from the start (an edge from layer 0); a tensor the model returns is live until the end (an edge
to layer n - 1). ``cut_bytes`` is what ``partition`` turns into cut costs.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from partitioner.figures import LayerProfile

__all__ = ["cut_bytes", "layer_graph"]

_FIGURES = (
    "name",
    "kind",
    "forward_time",
    "backward_time",
    "flops",
    "param_bytes",
    "activation_bytes",
    "saved_bytes",
    "output_shape",
    "output_dtype",
    "weight_time",
)


def layer_graph(
    layers: Sequence[LayerProfile],
    edges: Sequence[tuple[int, int]] | None = None,
    *,
    tensors: Sequence[tuple[str, int, Sequence[int], int]] | None = None,
) -> nx.DiGraph:
    """A DiGraph with node l carrying layer l's figures, and its edges.

    ``tensors``: per tensor (name, layer that makes it or -1 for an input, layers that read it
    with n for the model's output, bytes): an edge to each reader naming it. Otherwise ``edges``
    (default: the chain l -> l + 1), each carrying the producing layer's ``activation_bytes``.
    """
    graph = nx.DiGraph()
    for lp in layers:
        graph.add_node(lp.index, **{key: getattr(lp, key) for key in _FIGURES})
    n = len(layers)
    if tensors is not None:
        for name, made, readers, size in tensors:
            u = max(made, 0)
            for w in sorted({min(r, n - 1) for r in readers if min(r, n - 1) > u}):
                if not graph.has_edge(u, w):
                    graph.add_edge(u, w, bytes=0, tensors={})
                graph.edges[u, w]["tensors"][name] = int(size)
                graph.edges[u, w]["bytes"] += int(size)
        return graph
    pairs = edges if edges is not None else [(layer, layer + 1) for layer in range(n - 1)]
    for u, v in pairs:
        if not 0 <= u < v < n:
            raise ValueError(f"edge ({u}, {v}) must go forward between layers 0..{n - 1}")
        graph.add_edge(u, v, bytes=layers[u].activation_bytes)
    return graph


def cut_bytes(graph: nx.DiGraph) -> list[int]:
    """Bytes crossing the cut after each layer, in node (execution) order; the last entry is 0.

    A tensor made by u and last read by v crosses every cut l with u <= l < v; a difference array
    adds each tensor once (an edge without ``tensors`` is one tensor of its ``bytes``).
    """
    order = sorted(graph.nodes)
    pos = {node: at for at, node in enumerate(order)}
    delta = [0] * (len(order) + 1)
    spans: dict[tuple[int, str], tuple[int, int]] = {}  # (maker, tensor) -> (last reader, bytes)
    for u, v, data in graph.edges(data=True):
        if pos[u] >= pos[v]:
            raise ValueError(
                f"edge {u} -> {v} goes backwards in execution order; the graph must be a DAG in order"
            )
        named = data.get("tensors")
        if named is None:
            delta[pos[u]] += int(data.get("bytes", 0))
            delta[pos[v]] -= int(data.get("bytes", 0))
            continue
        for name, size in named.items():
            last, _ = spans.get((pos[u], name), (pos[v], 0))
            spans[(pos[u], name)] = (max(last, pos[v]), int(size))
    for (start, _), (stop, size) in spans.items():
        delta[start] += size
        delta[stop] -= size
    out, run = [], 0
    for cut in range(len(order)):
        run += delta[cut]
        out.append(run)
    return out
