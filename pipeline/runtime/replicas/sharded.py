"""FSDP2 under the pipeline: each stage's parameters, gradients and optimizer state in ``shard`` parts.

    # s: stage, i: micro-batch, m: micro-batches, S: shard (the "dp_shard" dim's size)

Built on torch's own engine, ``torch.distributed.fsdp.fully_shard``, on the mesh's "dp_shard" dim
(or HSDP's ("dp_replicate", "dp_shard") when the plan has replicas too: FSDP then all-reduces the
reduced shards over the replicas itself, and the replicated reducer of dp.py is not made).

FSDP units. Under ZeRO-2 a stage is one unit: its parameters are gathered for the whole step
anyway, so one all-gather and one reduce-scatter per stage and step move them, the fewest
collectives (per-layer units would gather the same bytes in as many calls). Under ZeRO-3 an
``nn.Sequential`` stage gets one unit per layer that holds parameters, then the stage itself, so
that only one layer is gathered at a time; a traced stage (one graph that reads its parameters by
name) stays one unit, since its inner modules are never called and their hooks would never run.

One step of stage s, as the executor runs it::

    begin_step      ZeRO-2: the stage all-gathered once (unshard); no unit syncs gradients
    F_i, B_i, W_i   ZeRO-2: the gathered parameters, every micro-batch; gradients accumulate,
                    unsharded, in each unit (set_requires_gradient_sync(False))
                    ZeRO-3: FSDP's hooks gather each unit before its forward and backward and
                    free it after; under a split backward (zb-h1, the V schedules) as ZeRO-2, since
                    W_i needs the gathered weights B_i's graph saved and may follow F_(i+1)
    s's last B / W  every unit's gradients reduce-scattered once, then the units resharded
                    (``reduce``, hooked after the action the program's REDUCE names: dp.py)
    end of step     the optimizer sees sharded parameters with sharded, reduced gradients

The reduce-scatter sums: each replica's loss is already weighted by its share of the global batch
(replicas.py), as for the replicated reducer, so FSDP's division is set to 1 (and a SUM, which gloo
has, instead of a pre-multiplied sum, which it lacks). A forward-only pass (evaluate, predict)
gathers through FSDP's own hooks and is resharded at its end (``reshard``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from pipeline.runtime.replicas.dp import Hooked, reduction_points
from pipeline.schedules.schedule import Schedule

__all__ = ["ShardedStages", "shard_stage"]


def shard_stage(module: nn.Module, mesh: Any, reshard: bool, stage: int) -> list[FSDPModule]:
    """``module`` (one stage) wrapped with ``fully_shard`` on ``mesh``; ``reshard``: after each use
    (ZeRO-3), then per layer with parameters when it is an ``nn.Sequential``, and the stage. Its FSDP
    units, the stage (their root) first. A ValueError naming the stage and the fix when FSDP cannot
    wrap it."""
    units: list[nn.Module] = []
    if reshard and isinstance(module, nn.Sequential):
        units += [layer for layer in module if any(True for _ in layer.parameters())]
    if not any(True for _ in module.parameters()):
        raise ValueError(
            f"stage {stage} holds no parameter, so FSDP has nothing to shard on it; give every stage a "
            "layer with parameters (a balance that does not isolate a parameter-free layer) or make the "
            "plan with shard=1"
        )
    try:
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    except (ValueError, RuntimeError, AssertionError, NotImplementedError) as e:
        raise ValueError(
            f"fully_shard cannot wrap stage {stage} ({type(module).__name__}): {e}; every parameter of a "
            "stage must be a plain tensor on the stage's device (not already a DTensor of another mesh, "
            "not shared with another stage on this rank), or make the plan with shard=1"
        ) from e
    out: list[FSDPModule] = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for fsdp in out:
        fsdp.set_gradient_divide_factor(1.0)  # the losses carry the replicas' weights: sum
        fsdp.set_force_sum_reduction_for_comms(True)
    # the stage is its units' root now, whichever of its layers runs first (a split backward calls
    # the layers, not the stage)
    fully_shard.state(module)._lazy_init()  # type: ignore[attr-defined]
    return out


class ShardedStages:
    """One rank's sharded stages: the calls around each step that make FSDP gather once and reduce once."""

    def __init__(
        self,
        modules: Mapping[int, nn.Module],
        mesh: Any,
        zero: int,
        sched: Schedule,
        rank: int,
        executor: Hooked,
    ) -> None:
        # ZeRO-3 frees after each use, but under a split backward W_i needs the weights B_i's graph
        # saved, and may run after F_{i+1}: there the weights stay gathered to the stage's last W
        self.free = zero == 3 and not sched.split_backward
        self.units = {s: shard_stage(mod, mesh, self.free, s) for s, mod in modules.items()}
        self.every = [unit for units in self.units.values() for unit in units]
        for a, s in reduction_points(sched, rank).items():
            executor.hook(a, _nothing, functools.partial(self.reduce, s))

    def begin_step(self) -> None:
        """Before a training step's first compute: nothing syncs until each stage's ``reduce``;
        ZeRO-2 gathers every unit now, once."""
        for unit in self.every:
            unit.set_is_last_backward(False)
            unit.set_requires_gradient_sync(False)
            unit.set_reshard_after_backward(self.free)
        self.begin_forward_only()

    def reduce(self, s: int) -> None:
        """Stage ``s``'s gradients are final: reduce-scatter each unit's once, then reshard them."""
        for unit in self.units[s]:
            unit.set_is_last_backward(True)
            unit.set_requires_gradient_sync(True)
            unit.set_reshard_after_backward(True)
        # FSDP's end-of-backward callback, on the stage (its units' root): each unit's post-backward
        # (now with its reduce-scatter), then the reduce-scatters joined to the compute stream (a
        # device-side wait, no host sync)
        root = self.units[s][0]
        fully_shard.state(root)._root_post_backward_final_callback()  # type: ignore[attr-defined]

    def begin_forward_only(self) -> None:
        """Before a step's or an evaluation's forwards: unless ZeRO-3 frees them, every unit is
        gathered here (a split stage calls its layers, not the stage, so no hook of the stage's would
        gather it)."""
        if not self.free:
            for unit in self.every:
                unit.unshard()

    def reshard(self) -> None:
        """After a forward-only pass: free what was gathered for it."""
        for unit in self.every:
            unit.reshard()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered and kept so while the body runs (a fake forward that infers shapes
        must not all-gather fake tensors), then as before."""
        for unit in self.every:
            unit.set_reshard_after_forward(False)
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.every:
                unit.set_reshard_after_forward(self.free)


def _nothing() -> None:
    return None
