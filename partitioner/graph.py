"""The layer graph: one node per layer, edges carrying the bytes that flow between layers.

    # l: layer (node, in execution order), n: layers; "the cut after layer l" is cut l

An ``nn.Sequential`` gives a chain, but nothing here assumes one: with skip connections the graph
is a DAG, and the cut after layer l costs every edge that crosses it::

    0 --> 1 --> 2 --> 3         cut 1 (|):  edges 1->2 and 0->3 cross it
     \\    |          ^          cut_bytes[1] = bytes(1->2) + bytes(0->3)
      `---|----------'

``cut_bytes`` is what ``partition`` turns into cut costs, so a DAG front end (``torch.fx``) only has
to build the graph.
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


def layer_graph(layers: Sequence[LayerProfile], edges: Sequence[tuple[int, int]] | None = None) -> nx.DiGraph:
    """A DiGraph with node l carrying layer l's figures; ``edges`` (default: the chain l -> l + 1)
    each carry ``bytes``, the producing layer's ``activation_bytes``."""
    graph = nx.DiGraph()
    for lp in layers:
        graph.add_node(lp.index, **{key: getattr(lp, key) for key in _FIGURES})
    pairs = edges if edges is not None else [(layer, layer + 1) for layer in range(len(layers) - 1)]
    for u, v in pairs:
        if not 0 <= u < v < len(layers):
            raise ValueError(f"edge ({u}, {v}) must go forward between layers 0..{len(layers) - 1}")
        graph.add_edge(u, v, bytes=layers[u].activation_bytes)
    return graph


def cut_bytes(graph: nx.DiGraph) -> list[int]:
    """Bytes crossing the cut after each layer, in node (execution) order; the last entry is 0.

    Edge u -> v crosses every cut l with u <= l < v; a difference array adds each edge once.
    """
    order = sorted(graph.nodes)
    pos = {node: at for at, node in enumerate(order)}
    delta = [0] * (len(order) + 1)
    for u, v, data in graph.edges(data=True):
        if pos[u] >= pos[v]:
            raise ValueError(
                f"edge {u} -> {v} goes backwards in execution order; the graph must be a DAG in order"
            )
        delta[pos[u]] += int(data.get("bytes", 0))
        delta[pos[v]] -= int(data.get("bytes", 0))
    out, run = [], 0
    for cut in range(len(order)):
        run += delta[cut]
        out.append(run)
    return out
