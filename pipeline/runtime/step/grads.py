"""Whole-pipeline gradient operations: the global norm, clipping by it, and the all-finite check.

    # r: rank, p: ranks

Each rank holds the gradients of its own stages only, so a norm or a finiteness
check over "the model" needs one small collective. Nothing large moves: each
rank reduces its gradients to one number on its own device, and only that
number travels, through ``Comm.all_reduce`` (the pipeline's timeout and failure
watch)::

    rank r: per-tensor norms n_j (one fused kernel per device and dtype)
            finite q-norm: part_r = sum_j n_j ** q      inf-norm: part_r = max_j n_j
    all ranks: all_reduce(part, SUM / MAX)  ->  total = part ** (1/q)  /  part

This is ``torch.nn.utils.clip_grad_norm_``'s total, (sum over all tensors of
n_j ** q) ** (1/q), grouped by rank; the clipping factor
``clamp(max_norm / (total + 1e-6), max=1)`` is then the same on every rank.
Norms are computed in fp32 at least (bf16 gradients accumulate in fp32), and
no gradient is copied.

With replicas of the pipeline (a mesh, runtime/dp.py), each parameter has a
copy on every replica, with the same (reduced) gradient: the pipeline's part
is then all-reduced over the replicas too, summed and divided by their number
(MAX for the inf-norm and the flag), so that each parameter counts once and
every rank of the world gets the same number.

Sharded gradients (DTensors: FSDP's shards over "dp_shard", tensor parallelism's over "tp") are
summed the same way per (mesh, placements), with one extra all-reduce of that part over each mesh
dim they are split on (a Replicate dim holds copies, counted once): the part is then the whole
tensors' on every rank that holds a piece, and joins the plain gradients' part above.

The finite check is GradScaler's fused kernel with a scale of exactly 1.0:
it sets a flag for any inf or NaN (multiplying by 1.0 leaves every value as it
was), then one all-reduce (MAX) of the flag gives every rank the same answer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipeline.runtime.comm.p2p import Comm

__all__ = ["all_finite", "any_flag", "check_norm_type", "clip_", "total_norm"]


def check_norm_type(norm_type: float) -> float:
    q = float(norm_type)
    if not (q > 0 or q == math.inf):  # also refuses NaN
        raise ValueError(f"norm_type ({norm_type!r}) must be > 0 or inf (float('inf')), e.g. 2.0")
    return q


def _groups(grads: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Gradients by (device, dtype): a fused (foreach) kernel takes one of each."""
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        out.setdefault((g.device, g.dtype), []).append(g)
    return out


def total_norm(
    grads: list[torch.Tensor],
    norm_type: float,
    comm: Comm | None,
    device: torch.device,
    replicas: Comm | None = None,
) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients of every rank: a 0-dim fp32 tensor on ``device``
    (the communication device), the same on every rank. ``replicas``: the "dp" group's Comm, whose
    ranks hold the same parameters. Call on every rank."""
    q = check_norm_type(norm_type)
    part = torch.zeros((), dtype=torch.float32, device=device)
    plain = [g for g in grads if not isinstance(g, DTensor)]
    by_layout: dict[tuple[Any, tuple[Any, ...]], list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            by_layout.setdefault((g.device_mesh, tuple(g.placements)), []).append(g.to_local())
    for (mesh, placements), local in by_layout.items():
        mine = total_norm(local, q, None, device)
        mine = mine if q == math.inf else mine.pow(q)
        op = dist.ReduceOp.MAX if q == math.inf else dist.ReduceOp.SUM
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():  # Shard, or FSDP-over-tp's _StridedShard (no Shard)
                dist.all_reduce(mine, op, group=mesh.get_group(dim))
        part = torch.maximum(part, mine) if q == math.inf else part + mine
    for (_, dtype), group in _groups(plain).items():
        acc = torch.promote_types(dtype, torch.float32)
        norms = torch.stack(torch._foreach_norm(group, q, dtype=acc))
        mine = norms.max() if q == math.inf else norms.pow(q).sum()
        part = torch.maximum(part, mine.to(device)) if q == math.inf else part + mine.to(device)
    if comm is not None and comm.world_size > 1:
        op = dist.ReduceOp.MAX if q == math.inf else dist.ReduceOp.SUM
        comm.all_reduce(part, op, "the gradient norm's all-reduce (clip_grad_norm_)")
    if replicas is not None and replicas.world_size > 1:
        op = dist.ReduceOp.MAX if q == math.inf else dist.ReduceOp.SUM
        replicas.all_reduce(part, op, "the gradient norm's all-reduce over the replicas (clip_grad_norm_)")
        if q != math.inf:
            part = part / replicas.world_size
    return part if q == math.inf else part.pow(1.0 / q)


def clip_(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale ``grads`` by ``clamp(max_norm / (total + 1e-6), max=1)``, as torch's clip_grad_norm_ does."""
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]  # a shard scales alone
    for (dev, _), group in _groups(local).items():
        torch._foreach_mul_(group, coef.to(dev))


def all_finite(
    grads: list[torch.Tensor], comm: Comm | None, device: torch.device, replicas: Comm | None = None
) -> bool:
    """True when no gradient of any rank holds an inf or NaN; the same answer on every rank."""
    flag = torch.zeros((), dtype=torch.float32, device=device)
    meshes = {id(g.device_mesh): g.device_mesh for g in grads if isinstance(g, DTensor)}
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    for (dev, _), group in _groups(local).items():
        found = torch.zeros(1, dtype=torch.float32, device=dev)
        one = torch.ones(1, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)  # x * 1.0 == x
        flag = torch.maximum(flag, found.to(device).reshape(()))
    for mesh in meshes.values():  # a shard's overflow is every holder's (their answers must agree)
        for dim in range(mesh.ndim):
            dist.all_reduce(flag, dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return bool(any_flag(flag, comm, replicas, "the all-finite flag", "grads_finite") == 0)


def any_flag(
    flag: torch.Tensor, comm: Comm | None, replicas: Comm | None, name: str, call: str
) -> torch.Tensor:
    """``flag`` (a 0-dim float32 on the communication device, > 0: raised) over every rank of the
    pipeline and its replicas: the largest, in place, on every rank (errors name ``name`` and the
    API ``call``)."""
    if comm is not None and comm.world_size > 1:
        comm.all_reduce(flag, dist.ReduceOp.MAX, f"{name}'s all-reduce ({call})")
    if replicas is not None and replicas.world_size > 1:
        replicas.all_reduce(flag, dist.ReduceOp.MAX, f"{name}'s all-reduce over the replicas")
    return flag
