"""The whole model's state dict on one rank, from every rank's stages: for export or sampling.

    # s: stage, r: rank, q: a rank that sends

Each rank holds the state (parameters and persistent buffers, under the model's
own names, e.g. ``"3.weight"``) of its stages only. ``gather_state_dict``
brings it all to rank ``dst`` in two moves, both with the pipeline's timeout
and failure watch::

    every q != dst: store key  <- [(s, name, shape, dtype), ...]   (small: the layout)
                    post sends of its tensors to dst, in that order
    dst:            wait for each q's layout, post one receive per tensor, wait for all

then lays the entries out in stage order, so the keys come in the order of
``model.state_dict()``. Every value is a CPU copy: later steps do not change it.

Sharded and split stages (``plan.shard`` > 1: FSDP's DTensors over "dp_shard"; ``plan.tp`` > 1:
the parallelize_fn's over "tp"). Each (replica, shard h, tp t) cell runs a pipeline of its own,
and a stage's DTensor is whole only across its cells::

    every rank:     each local DTensor made whole, stage by stage in state-dict order
                    (``full_tensor()``: a collective of its shard / tp group, whose ranks hold the
                    same stages, so they call it in the same order)
    cell h=0, t=0:  the moves above, to its pipeline rank dst; its tensors are plain now
    other cells:    nothing more (None): every replica's state is gathered once, by its first cell
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pipeline.runtime.comm.p2p import Comm
from pipeline.runtime.replicas.mesh import COMPOSED

__all__ = ["gather_state_dict"]

# one entry of a rank's layout: stage, name, shape, dtype name ("float32")
Entry = tuple[int, str, list[int], str]


def gather_state_dict(
    local: dict[int, dict[str, torch.Tensor]],
    comm: Comm | None,
    dst: int,
    key: str,
    device: torch.device,
    mesh: Any = None,
) -> dict[str, torch.Tensor] | None:
    """``local``: this rank's ``{stage: module.state_dict()}``. The full state dict on ``dst``, None
    elsewhere. ``key`` must be unique to this call and the same on every rank; ``device`` is the
    communication device; ``mesh``: the pipeline's (a composed one's cells other than the first of
    each replica only join the collectives that make DTensors whole). Call on every rank."""
    local = {s: {name: _whole(t) for name, t in state.items()} for s, state in sorted(local.items())}
    if not _first_cell(mesh):
        return None
    mine: list[tuple[Entry, torch.Tensor]] = [
        ((s, name, list(t.shape), str(t.dtype).removeprefix("torch.")), t)
        for s, state in sorted(local.items())
        for name, t in state.items()
    ]
    if comm is None or comm.world_size == 1:
        return _ordered([(e, t.detach().to("cpu", copy=True)) for e, t in mine])
    # between non-neighbours the messages go on the group itself, whose NCCL communicator Comm made
    # at construction with every rank (a first operation of two ranks alone would hang)
    if comm.rank != dst:
        comm.set_key(f"{key}/{comm.rank}", json.dumps([e for e, _ in mine]).encode())
        tensors = [t.detach().to(device).contiguous() for e, t in mine if t.numel() > 0]
        what = f"rank {comm.name(dst)}'s receive of rank {comm.me}'s state (gather_state_dict)"
        (works,) = comm.post([(tensors, dst)], [], what)
        comm.wait(works, what)
        return None
    entries: list[tuple[Entry, torch.Tensor]] = [(e, t.detach().to("cpu", copy=True)) for e, t in mine]
    received: list[tuple[int, list[tuple[Entry, torch.Tensor]]]] = []
    for q in range(comm.world_size):
        if q != dst:
            layout = comm.wait_key(f"{key}/{q}", f"rank {comm.name(q)}'s state layout (gather_state_dict)")
            theirs = [_entry(e) for e in json.loads(layout)]
            received.append(
                (q, [(e, torch.empty(e[2], dtype=getattr(torch, e[3]), device=device)) for e in theirs])
            )
    recvs = [([t for e, t in part if t.numel() > 0], q) for q, part in received]
    works = comm.post([], recvs, "the state of every rank (gather_state_dict)")
    for (q, _), w in zip(received, works, strict=True):
        comm.wait(w, f"rank {comm.name(q)}'s state (gather_state_dict)")
    for _, part in received:
        entries += [(e, t.to("cpu")) for e, t in part]
    return _ordered(entries)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a DTensor's full tensor (a collective of its mesh's ranks)."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            whole: torch.Tensor = t.full_tensor().detach()
        return whole
    return t


def _first_cell(mesh: Any) -> bool:
    """Whether this rank's pipeline gathers: any pipeline but a composed mesh's, whose replica's
    first cell (shard 0, tp 0) alone does (its stages' DTensors are whole on every cell by now)."""
    if mesh is None or tuple(getattr(mesh, "mesh_dim_names", None) or ()) != COMPOSED:
        return True
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: the Pipeline's mesh spans the world, so never here
        return True
    _, h, _, t = coordinate
    return bool(h == 0 and t == 0)


def _entry(raw: Any) -> Entry:
    s, name, shape, dtype = raw
    return int(s), str(name), [int(n) for n in shape], str(dtype)


def _ordered(entries: list[tuple[Entry, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stage order, and each stage's own order within it (a stable sort)."""
    return {e[1]: t for e, t in sorted(entries, key=lambda et: et[0][0])}
