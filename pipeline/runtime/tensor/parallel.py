"""A stage split over its "tp" ranks by the user's ``parallelize_fn(stage_module, tp_mesh)``.

    # t: a tp rank, T: tp, the "tp" dim's size

torchtitan's pattern: the function calls ``torch.distributed.tensor.parallel.parallelize_module``
(or sets DTensor placements itself) on the stage's own submodules, whose forwards then run as
DTensor programs across the T ranks (llama.py ships one for Llama-family blocks). What crosses a
stage boundary stays a plain tensor, the same on every tp rank::

    stage s, tp rank t:  plain x --[layers: DTensor weights, collectives inside]--> plain y
                                                                          |  each tp rank's pipeline
    stage s+1, tp rank t: plain y <-------------------------------------- p2p (its own pair)

Why plain: the point-to-point path, its buffers, shapes and the memory walk are those of any
pipeline; every tp rank's pipeline is a whole one (mesh.py: each (replica, shard, tp) cell has its
own), sending the same activations over its own pair of ranks, which on GPUs are different links,
so the bytes double but no link waits longer. A stage's output that is still a DTensor (a style
with ``use_local_output=False``) is made replicated and local here; its gradient flows back through
that conversion.

Before the function runs, every tensor of the stage takes tp rank 0's values (a broadcast over
the "tp" ranks), so that ``distribute_tensor``'s split and the replicated norms agree. Tensor
parallelism needs layers called as modules (an ``nn.Sequential`` of blocks): a traced stage is one
aten graph that reads its weights by name, whose ops would see DTensor weights beside plain
activations with no style's hook to mediate; it is refused with the way out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from pipeline.runtime.comm.state import broadcast_state, module_state

__all__ = ["ParallelizeFn", "parallelize_stages"]

ParallelizeFn = Callable[[nn.Module, Any], Any]


def parallelize_stages(
    modules: Mapping[int, nn.Module], tp_mesh: Any, parallelize_fn: ParallelizeFn | None, traced: bool
) -> None:
    """Each local stage split over ``tp_mesh`` by ``parallelize_fn``, in place; ValueError when that
    cannot be (no function, a traced model). A stage the function leaves whole (an embedding alone)
    runs whole on each tp rank."""
    if parallelize_fn is None:
        raise ValueError(
            "this plan has tp > 1 but no parallelize_fn was given: pass Pipeline(..., parallelize_fn=f) "
            "with f(stage_module, tp_mesh) calling torch.distributed.tensor.parallel.parallelize_module "
            "on the stage's layers (pipeline.parallelize_llama for Llama-family blocks), or make the plan "
            "with tp=1"
        )
    if traced:
        raise ValueError(
            "tensor parallelism needs stages whose layers are called as modules, but this plan cuts a "
            "traced model (its stages are aten graphs that read the weights by name, so no parallel "
            "style's hook runs); build the model as an nn.Sequential of its blocks (for a transformers "
            "Llama: pipeline.reference.hf.llama_layers(model)), or make the plan with tp=1"
        )
    group = tp_mesh.get_group()
    for module in modules.values():
        _same_on_every_tp_rank(module, group)
        parallelize_fn(module, tp_mesh)
        # on the last layer: a split backward calls a Sequential stage's layers, not the stage
        last = module[len(module) - 1] if isinstance(module, nn.Sequential) and len(module) else module
        last.register_forward_hook(_plain_outputs)


def _same_on_every_tp_rank(module: nn.Module, group: Any) -> None:
    """Every parameter and buffer from tp rank 0 (global rank ``src`` of ``group``)."""
    src = dist.get_global_rank(group, 0)
    broadcast_state(module_state([module]), lambda flat: dist.broadcast(flat, src, group=group))


def _plain(x: Any) -> Any:
    if isinstance(x, DTensor):
        return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local()
    if isinstance(x, tuple):
        return tuple(_plain(y) for y in x)
    return x


def _plain_outputs(module: nn.Module, args: Any, out: Any) -> Any:
    return _plain(out)
