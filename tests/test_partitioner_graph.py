"""``partitioner.graph``: node figures, and cut bytes for chains and DAGs."""

from __future__ import annotations

import pytest

from partitioner.graph import cut_bytes, layer_graph
from partitioner.profile import LayerProfile


def _layer(i: int, out: int) -> LayerProfile:
    return LayerProfile(i, str(i), "Linear", 1.0, 2.0, 10, 4, out, 0, (1,), "float32")


def test_chain_cut_bytes_are_the_outputs() -> None:
    g = layer_graph([_layer(0, 100), _layer(1, 20), _layer(2, 7)])
    assert cut_bytes(g) == [100, 20, 0]
    assert g.nodes[1]["backward_time"] == 2.0


def test_dag_cut_counts_every_crossing_edge() -> None:
    # 0 -> 1 -> 2 -> 3 plus a skip 0 -> 3: the cuts after 1 and 2 also carry layer 0's output.
    layers = [_layer(0, 100), _layer(1, 20), _layer(2, 7), _layer(3, 1)]
    g = layer_graph(layers, edges=[(0, 1), (1, 2), (2, 3), (0, 3)])
    assert cut_bytes(g) == [200, 120, 107, 0]


def test_backward_edge_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"edge \(2, 1\)"):
        layer_graph([_layer(0, 1), _layer(1, 1), _layer(2, 1)], edges=[(2, 1)])
