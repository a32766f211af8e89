"""``LayerProfile``: one layer's measured figures, the record that profile.py fills and graph.py reads.

    # l: layer

It lives apart from both so that the profiler may build the layer graph while the graph
module imports nothing of the profiler: imports in partitioner go one way.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerProfile"]


@dataclass(frozen=True)
class LayerProfile:
    """Figures for layer l; times in seconds, sizes in bytes, for one micro-batch (the sample).

    ``backward_time`` is the whole backward; ``weight_time`` the part of it that computes the
    parameters' gradients (what a split-backward schedule runs as W), 0 for a layer without any.
    """

    index: int
    name: str
    kind: str
    forward_time: float
    backward_time: float
    flops: int
    param_bytes: int
    activation_bytes: int  # its output: what crosses a cut right after it
    saved_bytes: int  # what autograd keeps for its backward (parameters excluded)
    output_shape: tuple[int, ...]
    output_dtype: str
    weight_time: float = 0.0
