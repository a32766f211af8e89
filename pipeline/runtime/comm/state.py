"""Some modules' parameters and buffers as one flat tensor per kind: what a broadcast of them moves.

    modules --module_state--> {(dtype, device): [t_1, t_2, ...]}   each tensor once, module order
            --broadcast_state(send)--> per kind: cat -> send(flat) -> copied back into each t_j

One collective per (dtype, device) instead of one per tensor. A DTensor contributes its local part
(a shard of tensor parallelism's, the same slice on every rank that shares its tp coordinate).
Replicas take replica 0's state this way (replicas.py), tp ranks tp rank 0's (tensor/parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["StateByKind", "broadcast_state", "module_state"]

StateByKind = dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]


def module_state(modules: Iterable[nn.Module]) -> StateByKind:
    """Every non-empty parameter and buffer once, by (dtype, device), in module order."""
    by_kind: StateByKind = {}
    seen: set[int] = set()
    for mod in modules:
        for t in (*mod.parameters(), *mod.buffers()):
            if id(t) not in seen and t.numel() > 0:
                seen.add(id(t))
                local = t.to_local() if isinstance(t, DTensor) else t
                by_kind.setdefault((local.dtype, local.device), []).append(local)
    return by_kind


def broadcast_state(
    by_kind: StateByKind, send: Callable[[torch.Tensor], None], device: torch.device | None = None
) -> None:
    """Each kind's tensors overwritten by the source's: one flat tensor per kind, moved to ``device``
    (None: where the tensors are) for ``send(flat)``, a broadcast in place, then copied back."""
    with torch.no_grad():
        for (_, at), tensors in by_kind.items():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            flat = flat.to(device) if device is not None else flat
            send(flat)
            flat = flat.to(at)
            off = 0
            for t in tensors:
                t.copy_(flat[off : off + t.numel()].view_as(t))
                off += t.numel()
