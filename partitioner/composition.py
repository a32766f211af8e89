"""Composition with FSDP2 and tensor parallelism: what one rank holds, and what its collectives cost.

    # P: a layer's parameter bytes, W: its nn.Linear weights' (``LayerProfile.linear_weight_bytes``),
    # S: shard, T: tp, f: optimizer_state_factor, X: the rest (buffers, autocast's weight copies)

A plan runs dp x shard x p x tp ranks (``pipeline.plan.Plan``); every figure here is one rank's.
``Composition`` holds the one rule of each, read by the memory model (``partitioner.memory``: the
walk's static bytes, the solver's rows, the auto search's floors) and by the step prediction
(``partitioner._planning.predicted``, the auto search through it).

Memory (``Composition.static``), per layer on one rank::

    L      = P - W + W / T                       tensor parallelism splits the Linear weights only
                                                 (Megatron's colwise/rowwise pairs); biases, norms,
                                                 embeddings and buffers stay whole on every tp rank
    S = 1  : static = L + L + f L + X (+ 4 n)    parameters, gradients, optimizer state; with
                                                 state (f > 0), a step count per parameter tensor
                                                 (n of them, ``STEP_BYTES``), as every S has
    S > 1  : static = L / S                      the sharded parameters (FSDP's storage)
                    + L                          gathered once per step and kept through it (ZeRO-2)
                    + L                          the unsharded gradients, accumulated until the
                                                 reduce-scatter after the stage's last backward
                    + f L / S                    the optimizer state, of the shards only
                    + X                          buffers are not sharded
           = 2 L + (1 + f) L / S + X

The reduce-scattered gradients (L / S) never add to that: FSDP's post-backward frees the gathered
copy (L) before the reduce-scatter allocates its input (L, the gradients copied in) and output, so
that phase holds at most what the backward did. Measured (tests/test_composition.py: a 4-layer MLP
of width 64, 2 stages of 2 shards, 1F1B, m = 4, AdamW; the gathered parameters counted, whose
storages FSDP resizes in place, live.py): rank 0's true peak 137240 B, the plan's 137248 B. Every
rank of dp x shard > 1 also holds the replicas' row count and share (``replica_bytes``, 16 B).

ZeRO-3 frees the gathered parameters after each forward and backward (except under a split
backward, where it is ZeRO-2); its memory is bounded here by ZeRO-2's (the gathered copy counted
throughout), its extra all-gathers are charged in full. Assumptions, where the profile cannot
tell: the parallelize_fn splits every nn.Linear weight (``parallelize_llama`` leaves the LM head
whole: that layer's weight is then under-counted by (1 - 1/T)); activations are counted whole on
every tp rank (the split layers' inner activations are 1/T of that: an upper bound).

Time. A layer holding split weights (W > 0) runs in 1/T of its profiled time and flops; one
without (an embedding, a norm) runs whole on each tp rank. Such a layer is taken as a Megatron
block: 2 all-reduces of its output's bytes N in its forward and 2 in its backward (B, under a
split backward: they are the input gradient's), each (a ring, over T ranks)::

    all_reduce(N)     = latency + 2 (T - 1) / T * N / bandwidth
    all_gather(N)     = latency + (S - 1) / S * N / bandwidth      (reduce-scatter: the same)

FSDP, per stage of local parameter bytes L_s: ZeRO-2 all-gathers once before the step and
reduce-scatters once after its last backward, so the step grows by the most any rank spends::

    step += max over ranks r of  sum over r's stages s of  (all_gather(L_s) + reduce_scatter(L_s))

ZeRO-3 (unsplit backward) gathers before each forward and each backward instead: each
micro-batch's F and B of stage s take all_gather(L_s) more, and the step keeps the reduce-scatter.
The collectives' ``bandwidth`` and ``latency`` are the links' (``partition(bandwidth=,
latency=)``): the slowest link's, the ranks of a collective being taken as no better connected;
without a bandwidth every collective is free, as cuts are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from partitioner.figures import LayerProfile, Profile
from pipeline.plan import replica_bytes

__all__ = [
    "STEP_BYTES",
    "Composition",
    "check_composition",
    "check_tensor_parallel",
    "collective_link",
    "composition_of",
    "tensor_parallel",
]


# bytes an optimizer with state keeps per parameter tensor beside its state per byte: torch's Adam,
# AdamW, Adagrad, RMSprop, NAdam, RAdam, Adamax each keep a step count, a 0-dim float32 tensor (of
# every shard alike); SGD's momentum keeps none (counted anyway: 4 bytes a tensor over, a bound)
STEP_BYTES = 4.0


@dataclass(frozen=True)
class Composition:
    """FSDP parts per stage (``shard``), tensor-parallel ranks (``tp``), the ZeRO stage (2 or 3), the
    optimizer's state per parameter byte, and the collectives' link (see the module docstring)."""

    shard: int = 1
    tp: int = 1
    zero: int = 2
    optimizer_state_factor: float = 2.0
    bandwidth: float | None = None  # bytes/s of a collective's link; None: collectives are free
    latency: float = 0.0  # seconds per collective
    dp: int = 1  # pipeline replicas

    # ---- memory

    @property
    def replica_bytes(self) -> float:
        """``pipeline.plan.replica_bytes`` of this composition: what each rank holds beside its stages."""
        return replica_bytes(self.dp, self.shard)

    def local(self, param_bytes: Any, linear_bytes: Any) -> Any:
        """A layer's parameter bytes on one tp rank: its Linear weights split, the rest whole
        (numbers or numpy arrays)."""
        return param_bytes - linear_bytes + linear_bytes / self.tp

    def static(self, param_bytes: Any, linear_bytes: Any, other_bytes: Any, tensors: Any = 0) -> Any:
        """A layer's static bytes on one rank: parameters, gradients, optimizer state (sharded or
        not, see the module docstring) plus ``other_bytes`` (buffers, weight copies); ``tensors``:
        its parameter tensors, each with a step count when the optimizer keeps state (``STEP_BYTES``)."""
        mine = self.local(param_bytes, linear_bytes)
        f = self.optimizer_state_factor
        steps = STEP_BYTES * tensors if f > 0 else 0.0
        if self.shard == 1:
            return mine * (2.0 + f) + other_bytes + steps
        return 2.0 * mine + mine * (1.0 + f) / self.shard + other_bytes + steps

    def static_of(self, lp: LayerProfile) -> float:
        """``static`` of a profiled layer (or loss)."""
        other = lp.buffer_bytes + lp.cache_bytes
        return float(self.static(lp.param_bytes, lp.linear_weight_bytes, other, len(lp.params)))

    # ---- time

    def all_reduce(self, nbytes: float) -> float:
        """Seconds of one all-reduce of ``nbytes`` over the tp ranks (0 with tp = 1 or no bandwidth)."""
        if self.tp == 1 or self.bandwidth is None:
            return 0.0
        return self.latency + 2.0 * (self.tp - 1) / self.tp * nbytes / self.bandwidth

    def all_gather(self, nbytes: float) -> float:
        """Seconds of one all-gather (or reduce-scatter) of ``nbytes`` whole over the shard ranks."""
        if self.shard == 1 or self.bandwidth is None:
            return 0.0
        return self.latency + (self.shard - 1) / self.shard * nbytes / self.bandwidth

    def gathers_each_use(self, split_backward: bool) -> bool:
        """ZeRO-3 that is one: parameters gathered before every F and B (a split backward keeps them)."""
        return self.shard > 1 and self.zero == 3 and not split_backward

    def per_microbatch(self, stage_local: float, split_backward: bool) -> float:
        """Seconds each F and each B of a stage with ``stage_local`` parameter bytes spends gathering."""
        return self.all_gather(stage_local) if self.gathers_each_use(split_backward) else 0.0

    def per_step(
        self, stage_local: Sequence[float], rank_of: Any, n_ranks: int, split_backward: bool
    ) -> float:
        """Seconds FSDP adds to a step: per rank its stages' once-per-step all-gathers (ZeRO-2; none
        under ZeRO-3, which gathers per use) and reduce-scatters, the most of any rank."""
        once = 1.0 if self.gathers_each_use(split_backward) else 2.0  # reduce-scatter (+ all-gather)
        ranks = [0.0] * n_ranks
        for s, nbytes in enumerate(stage_local):
            ranks[rank_of(s)] += once * self.all_gather(nbytes)
        return max(ranks, default=0.0)


def composition_of(rule: float | Composition) -> Composition:
    """``rule`` as a ``Composition``: a plain ``optimizer_state_factor`` is one rank holding it all."""
    return rule if isinstance(rule, Composition) else Composition(optimizer_state_factor=float(rule))


def collective_link(
    bandwidth: float | Sequence[float] | None, latency: float | Sequence[float] | None
) -> tuple[float | None, float]:
    """The collectives' (bandwidth, latency): the slowest link's of those given (see the docstring)."""
    bw = None if bandwidth is None else min(_numbers(bandwidth))
    return bw, 0.0 if latency is None else max(_numbers(latency))


def _numbers(value: float | Sequence[float]) -> list[float]:
    return [float(value)] if isinstance(value, int | float) else [float(x) for x in value]


def check_composition(shard: object, tp: object, zero: object, world_size: object = None) -> None:
    """ValueError naming the value, what is expected and the fix, for ``partition``'s shard, tp, zero
    (and the auto search's ``"auto"`` for shard and tp, which needs ``world_size``)."""
    for name, value, what in (
        ("shard", shard, "FSDP parts of each stage (1: no sharding)"),
        ("tp", tp, "tensor-parallel ranks of each stage (1: none)"),
    ):
        if value == "auto" and world_size is not None:
            continue
        if value == "auto":
            raise ValueError(
                f"{name}='auto' searches the {what.split(' (')[0]} within a world: pass world_size= (all "
                f"ranks, dp x shard x n_ranks x tp) with schedule='auto', or give {name} as an integer"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{name} ({value!r}) must be an integer >= 1: the number of {what}; pass e.g. {name}=2, "
                f"or {name}='auto' with world_size= and schedule='auto' to search it"
            )
    if isinstance(zero, bool) or zero not in (2, 3):
        raise ValueError(
            f"zero ({zero!r}) must be 2 (parameters gathered once per step and kept through it) or 3 "
            "(resharded after each forward and backward: less memory, more all-gathers); pass zero=2 or 3"
        )
    if zero == 3 and shard == 1:
        raise ValueError(
            "zero=3 reshards FSDP's parameters, but shard=1 shards nothing; pass shard >= 2 (or "
            "shard='auto' with world_size=), or leave zero at 2"
        )


def check_tensor_parallel(model: object, profile: Profile | None, tp: int) -> None:
    """ValueError when tensor parallelism cannot split this model: the runtime splits the layers of
    an ``nn.Sequential`` called as modules (not a traced graph), and only their Linear weights."""
    if tp == 1:
        return
    if not isinstance(model, nn.Sequential) or (profile is not None and profile.traced is not None):
        raise ValueError(
            f"tp={tp} splits the layers of an nn.Sequential, called as modules, but this model is a "
            f"{type(model).__name__} the partitioner traces (its stages would be aten graphs no parallel "
            "style reaches); build it as an nn.Sequential of its blocks (pipeline.reference.hf.llama_layers "
            "for a transformers Llama), or pass tp=1"
        )
    if profile is not None and not any(lp.linear_weight_bytes > 0 for lp in profile.layers):
        raise ValueError(
            f"tp={tp} splits nn.Linear weights, but no layer of the profile holds one "
            "(LayerProfile.linear_weight_bytes is 0 everywhere: a model without Linear layers, or a profile "
            "made before it was recorded); profile the model again, or pass tp=1"
        )


def tensor_parallel(profile: Profile, rule: Composition) -> Profile:
    """``profile`` as one tp rank runs it (see the module docstring): each layer holding split
    weights in 1/T of its times and flops, plus its all-reduces; the same profile when T = 1."""
    if rule.tp == 1:
        return profile
    t = rule.tp

    def split(lp: LayerProfile, timed: bool) -> LayerProfile:
        if lp.linear_weight_bytes <= 0:
            return lp
        two = 2.0 * rule.all_reduce(lp.activation_bytes) if timed else 0.0  # Megatron: 2 each way
        return dataclasses.replace(
            lp,
            forward_time=lp.forward_time / t + two,
            backward_time=lp.backward_time / t + two,
            input_time=lp.input_time / t + two,  # a split backward's B carries the input gradient's
            weight_time=lp.weight_time / t,
            flops=math.ceil(lp.flops / t),
            backward_flops=math.ceil(lp.backward_flops / t),
            input_flops=math.ceil(lp.input_flops / t),
            weight_flops=math.ceil(lp.weight_flops / t),
        )

    probe = profile.probe  # the length probe's flops alike, so that their ratios stay the profile's
    if probe is not None:
        probe = dataclasses.replace(probe, layers=[split(lp, False) for lp in probe.layers])
    return dataclasses.replace(profile, layers=[split(lp, True) for lp in profile.layers], probe=probe)
