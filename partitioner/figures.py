"""``LayerProfile``: one layer's measured figures, the record that profile.py fills and graph.py reads;
``Profile``: a model's, all layers' figures and the layer graph; ``TimeEstimate`` and ``LayerTiming``:
how each of a layer's times was estimated from its samples (``partitioner.noise``).

    # l: layer

It lives apart from both so that the profiler may build the layer graph while the graph
module imports nothing of the profiler: imports in partitioner go one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from pipeline.plan import DeviceMemory

__all__ = ["LayerProfile", "LayerTiming", "Profile", "ShapeProbe", "TimeEstimate"]


@dataclass(frozen=True)
class TimeEstimate:
    """One of a layer's times (seconds), from its samples; see ``partitioner.noise``.

    ``measured``: the samples' minimum; ``spread``: their interquartile range over their median;
    ``error``: the floor gap, (median - minimum) / minimum, how far the minimum may still
    overstate the time; ``predicted``: seconds per flop (fitted on the profile's stable layers)
    times this time's flops, 0 when there is no prior; ``value``: what the profile uses, the
    measurement blended toward the prediction by their precisions (= ``measured`` when exact).
    """

    measured: float = 0.0
    spread: float = 0.0
    error: float = 0.0
    predicted: float = 0.0
    value: float = 0.0


@dataclass(frozen=True)
class LayerTiming:
    """How a layer's four times were estimated: one ``TimeEstimate`` each (same ``samples``)."""

    forward: TimeEstimate = TimeEstimate()
    backward: TimeEstimate = TimeEstimate()
    input: TimeEstimate = TimeEstimate()
    weight: TimeEstimate = TimeEstimate()


@dataclass(frozen=True)
class LayerProfile:
    """Figures for layer l; times in seconds, sizes in bytes, for one micro-batch (the sample).

    Times, as the pipeline runs the layer (under the profile's autocast, if any):

    - ``forward_time``: its forward;
    - ``backward_time``: its whole backward in one pass (what gpipe, 1f1b and interleaved run as B);
    - ``input_time`` and ``weight_time``: the split backward of zb-h1, measured each on its own:
      the gradient of the layer's input (B) and then of its parameters (W). Layer 0 computes no
      input gradient, as stage 0 never does: its ``input_time`` is 0.

    Bytes: ``saved_bytes`` is what autograd keeps for the backward of one micro-batch (parameters,
    buffers and ``cache_bytes`` excluded); ``cache_bytes`` what it keeps once however many
    micro-batches run (autocast's low-precision copies of the weights, shared by every micro-batch
    of a step); ``activation_bytes`` the output, in the dtype the pipeline sends.

    ``inplace``: the layer writes into its input (``nn.ReLU(inplace=True)``), so no stage may start
    with it (a stage's input is a leaf of autograd, which refuses that); ``sendable``: its output
    is a tensor or a tuple of tensors, what the pipeline can send to the next stage.
    ``output_aliases_input``: its output is its input's storage (``nn.Flatten``, a reshape, an
    in-place op), so what a later layer saves of it, a stage's input buffer already holds;
    ``input_grad_aliases``: its backward returns a view of its output's gradient (a view's does).

    ``linear_weight_bytes``: the bytes of the weights of its ``nn.Linear`` modules (the layer itself
    or any inside it), among ``param_bytes``: what a Megatron-style tensor parallelism splits
    (``partitioner.composition``); biases, norms and embeddings are not counted.

    ``params``: the names of the parameters it holds, each by the first name the model gives it
    (a weight tied between two layers has the same name in both: ties are layers' shared names).

    How far to trust the times (``partitioner.noise``): ``samples`` timed runs after warm-up;
    ``spread`` the interquartile range over the median of its per-run ``forward + backward``;
    ``error`` that series' floor gap, (median - minimum) / minimum; ``noisy``: ``error``
    is above ``noise.NOISE_LIMIT``, so the times lean on the FLOP prior; ``timing`` each time's
    estimate (measured, prior, value). ``input_flops`` and ``weight_flops``: the flops of the
    split backward's two parts (the FLOP prior of ``input_time`` and ``weight_time``).

    ``same_as``: the earlier layer of the same structure on inputs of the same shapes whose figures
    this one's are (profiled once, ``partitioner._reuse``); None when it was measured itself.
    """

    index: int
    name: str
    kind: str
    forward_time: float
    backward_time: float
    flops: int  # forward
    param_bytes: int
    activation_bytes: int  # its output: what crosses a cut right after it
    saved_bytes: int
    output_shape: tuple[int, ...]
    output_dtype: str
    weight_time: float = 0.0
    input_time: float = 0.0
    backward_flops: int = 0
    buffer_bytes: int = 0
    cache_bytes: int = 0
    inplace: bool = False
    saved_input_bytes: int = 0  # of its input, among saved_bytes (the previous layer may save it too)
    saved_output_bytes: int = 0  # of its output, among saved_bytes (the next layer may save it too)
    saved_target_bytes: int = 0  # the loss: of its target (the step's data), among saved_bytes
    output_aliases_input: bool = False  # its output is its input's storage (a view, an in-place op)
    input_grad_aliases: bool = False  # its input's gradient is its output gradient's storage (a view's)
    forward_transient_bytes: int = 0  # allocated and freed again inside its forward (one micro-batch)
    backward_transient_bytes: int = 0  # the most its backward allocates at once: gradients, temporaries
    input_transient_bytes: int = 0  # the same of the split backward's B (its input's gradient; 0 on layer 0)
    weight_transient_bytes: int = 0  # the same of the split backward's W (its weights' gradients, after B)
    # the three again as the last layer runs them under the loss: its output held by its graph
    # alone (freed once the op saving it has run), its gradient made by the loss (freed once read);
    # measured for the model's last layer only (the only one under the loss), elsewhere the three above
    closing_backward_transient_bytes: int = 0
    closing_input_transient_bytes: int = 0
    closing_weight_transient_bytes: int = 0
    # the most its forward holds at once under no_grad (a recomputing F): intermediates that Python
    # still refers to and its output, beyond its input; with a graph they are saved, not transient
    no_grad_forward_bytes: int = 0
    sendable: bool = True
    params: tuple[str, ...] = ()
    linear_weight_bytes: int = 0  # of param_bytes, nn.Linear weights: what tensor parallelism splits
    input_flops: int = 0
    weight_flops: int = 0
    samples: int = 0
    spread: float = 0.0
    error: float = 0.0
    noisy: bool = False
    timing: LayerTiming | None = None
    same_as: int | None = None


@dataclass(frozen=True)
class ShapeProbe:
    """The layers' (and the loss's) untimed figures, flops and bytes, again at ``shape``: twice the
    sample's rows at half its length, the same tokens. Beside the profile's own they tell how each
    figure grows with the length at fixed tokens: attention's matrix products and the scores a
    kernel materialises as rows x length², the rest as the tokens (``partitioner.lengths``)."""

    shape: tuple[int, int]  # (rows, length)
    layers: list[LayerProfile]
    loss: LayerProfile | None = None


@dataclass
class Profile:
    """The layers' figures plus ``graph``: a DiGraph with a node per layer and bytes on its edges.

    ``input_bytes`` is the sample's size (what stage 0 keeps per micro-batch when it recomputes);
    ``loss`` the loss's figures when profiled with a ``loss_fn`` (the last stage runs it);
    ``autocast`` the dtype name it ran under (None: fp32); ``peak_bytes`` and ``seconds`` what
    profiling itself took. A traced model's profile (``partitioner.graph_profile``) also has
    ``cut_reasons`` (per cut after layer l: why no stage boundary may fall there, or "") and
    ``traced`` (how it was traced, its fingerprint and the sample's signature: what a plan records).

    Trust (``partitioner.noise``): ``noisy_layers`` the indices of the layers whose times are too
    noisy to trust (-1: the loss), ``trusted`` whether there are none; ``seconds_per_flop`` the
    FLOP prior fitted on the stable layers, per time ("forward", "backward", "input", "weight");
    ``from_flops`` the layers (-1: the loss) whose times are what their flops predict: every one
    when the noisy layers hold most of the time, those the time budget left untimed otherwise.

    ``device_memory``: what the device holds beyond the tensors the plan counts (workspaces, the
    allocator's rounding) and the share of a limit kept free there (``partitioner.device_memory``);
    ``DeviceMemory()`` (nothing) on CPU.

    Length. ``shape``: the sample's (rows, length), its first tensor's two leading sizes (None when
    it has fewer); ``probe``: every layer's figures again at twice the rows and half the length
    (``ShapeProbe``), None when a layer (or the loss) cannot run at that shape: then every figure
    is taken to grow as the tokens.
    """

    layers: list[LayerProfile]
    device: str
    graph: nx.DiGraph = field(repr=False)
    input_bytes: int = 0
    loss: LayerProfile | None = None
    autocast: str | None = None
    peak_bytes: int = 0
    seconds: float = 0.0
    cut_reasons: list[str] = field(default_factory=list)
    traced: dict[str, Any] | None = None
    noisy_layers: list[int] = field(default_factory=list)
    seconds_per_flop: dict[str, float] = field(default_factory=dict)
    from_flops: list[int] = field(default_factory=list)
    shape: tuple[int, int] | None = None
    probe: ShapeProbe | None = None
    device_memory: DeviceMemory = field(default_factory=DeviceMemory)

    @property
    def trusted(self) -> bool:
        """No layer's (nor the loss's) times were too noisy to trust; see ``noisy_layers``."""
        return not self.noisy_layers

    def __len__(self) -> int:
        return len(self.layers)
