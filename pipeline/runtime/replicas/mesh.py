"""The 2-D mesh of a replicated pipeline: ``dp`` replicas of a pipeline of ``p`` ranks.

    # p: ranks per pipeline, r: a rank's place in its pipeline (its "pp" rank), d: its replica

Every rank holds one (replica d, pipeline rank r) cell. The order is pp
innermost: global rank g = d * p + r, so that the ranks of one pipeline are
adjacent::

                       "pp": the pipeline's ranks (point-to-point, every micro-batch) ->
                     r = 0     r = 1     r = 2     r = 3
    "dp"   d = 0    [  0  ] - [  1  ] - [  2  ] - [  3  ]    replica 0: stages s with s % p == r
     |     d = 1    [  4  ] - [  5  ] - [  6  ] - [  7  ]    replica 1: the same stages, other data
     v                 |         |         |         |
                    the "dp" group of pipeline rank r: {r, p + r, ...}, one gradient all-reduce per step

Why this order. Launchers number ranks node by node (torchrun gives node k
the ranks k * P .. k * P + P - 1 for P processes per node), so with pp
innermost a pipeline of p <= P ranks lies on one node. Its traffic is on the
critical path: every forward waits for the previous stage's activations and
every backward for the next stage's gradients, m times per step, so it wants
the node's fastest links (NVLink, or the loopback). The data-parallel
all-reduce moves much more, a whole stage's gradients, but once per step, in
buckets launched as soon as a stage's last weight gradient is done, so that
it overlaps the rest of the schedule (runtime/dp.py): it tolerates the slower
network between nodes.

Composed (``plan.shard`` > 1 or ``plan.tp`` > 1), the mesh has torchtitan's four named dims,
``("dp_replicate", "dp_shard", "pp", "tp")`` (``COMPOSED``), any of them of size 1, innermost last:
global rank g = ((d * shard + h) * p + r) * tp + t. Tensor parallelism all-reduces inside every
layer, so its ranks are adjacent (one node, NVLink); the pipeline's point-to-point traffic comes
next, for the reason above; FSDP's all-gather and reduce-scatter (once per step, overlapped) and
the replicas' all-reduce tolerate the slowest links. Each (replica, shard, tp) cell runs its own
pipeline of p ranks (``Layout.pipelines``); the data the step sees is the same on the tp ranks of a
cell and different across (d, h): the "data" group of a rank is its (dp_replicate x dp_shard)
ranks (``Layout.replicas``, of size dp x shard).

The mesh is a ``torch.distributed.device_mesh.DeviceMesh`` with dims named
``("dp", "pp")``, made with ``init_device_mesh`` (``build_mesh``) or given by
the caller (``check_mesh``). A rank's pipeline rank is its rank in the "pp"
group and its replica its rank in the "dp" group. The mesh must span the whole
world: the runtime's per-pair channels (channels.py) are made with
``dist.new_group``, which every rank of the world calls in the same order.
"""

from __future__ import annotations

import datetime
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "COMPOSED", "DIMS", "Layout", "bound_timeouts", "build_composed", "build_mesh", "check_composed",
    "check_mesh", "check_world", "composed_layout", "layout_of", "layout_table",
]  # fmt: skip

DIMS = ("dp", "pp")
COMPOSED = ("dp_replicate", "dp_shard", "pp", "tp")

# the "dp" and "pp" groups made, by world (the default group), then by (device type, dp, p): every
# rank makes its Pipelines in the same order, so the cache hits (and the collective group creations
# they save) are the same on every rank. Nothing here holds a group: torch's registry keeps them until
# dist.destroy_process_group(), which ends them with the world (a mesh kept here would keep their gloo
# threads until the interpreter finalizes; a mesh whose dim spans the world holds the world itself).
# A world made again gets groups of its own.
_made: weakref.WeakKeyDictionary[Any, dict[tuple[str, int, int], list[weakref.ref[Any]]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True)
class Layout:
    """Where this rank sits in the mesh, and the global ranks of its groups (in group-rank order)."""

    dp: int  # replicas
    p: int  # ranks per pipeline
    replica: int  # d: this rank's place in its "dp" group
    pp_rank: int  # r: this rank's place in its pipeline ("pp" group)
    pipeline: list[int]  # global ranks of this rank's pipeline, by pipeline rank
    replicas: list[int]  # global ranks of this rank's "dp" group, by replica
    pipelines: list[list[int]]  # every pipeline's global ranks, by replica then pipeline rank
    shard: int = 1  # FSDP parts of each stage (the "dp_shard" dim); dp counts replicas x shard
    tp: int = 1  # tensor-parallel ranks of each stage (the "tp" dim)


def check_world(world: int, dp: int, p: int) -> None:
    """The world must be exactly dp pipelines of p ranks; a ValueError naming the numbers otherwise."""
    if world % p != 0:
        raise ValueError(
            f"the world has {world} ranks, not a multiple of the plan's {p} ranks per pipeline; start "
            f"dp x {p} ranks (e.g. {dp * p} for dp={dp}) or make the plan for a divisor of {world}"
        )
    if world != dp * p:
        raise ValueError(
            f"the plan is for dp={dp} replicas of {p} ranks ({dp * p} ranks) but the world has {world}; "
            f"make the plan with dp={world // p} (plan.replace(dp={world // p})) or start {dp * p} ranks"
        )


def build_mesh(dp: int, p: int, device_type: str) -> DeviceMesh:
    """The ("dp", "pp") mesh of dp x p ranks over the world (pp innermost); its groups made once per
    shape and world."""
    check_world(dist.get_world_size(), dp, p)
    made = _made.setdefault(dist.distributed_c10d._get_default_group(), {})
    key = (device_type, dp, p)
    groups = [g for g in (ref() for ref in made.get(key, [])) if g is not None]
    if len(groups) == len(DIMS):
        layout = torch.arange(dp * p, dtype=torch.int).view(dp, p)  # pp innermost, as made below
        return DeviceMesh.from_group(groups, device_type, mesh=layout, mesh_dim_names=DIMS)
    mesh = init_device_mesh(device_type, (dp, p), mesh_dim_names=DIMS)
    made[key] = [weakref.ref(mesh.get_group(name)) for name in DIMS]
    return mesh


def bound_timeouts(mesh: DeviceMesh, seconds: float) -> None:
    """The mesh's groups' own timeout set to ``seconds`` (new groups default to torch's 30 minutes): a
    collective left running on a peer that stopped (SIGSTOP, a hung host) then ends in time, so a rank
    that failed can exit (its exit joins the groups' threads) instead of hanging for half an hour."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # torch >= 2.4
    if set_timeout is None:
        return
    for name in mesh.mesh_dim_names or ():
        set_timeout(datetime.timedelta(seconds=seconds), mesh.get_group(name))


def check_mesh(mesh: Any, dp: int, p: int) -> DeviceMesh:
    """A caller's mesh: a DeviceMesh with dims "dp" and "pp" of the plan's sizes, over the whole world."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh with dims ('dp', 'pp'), got "
            f"{type(mesh).__name__}; make one with init_device_mesh(device_type, (dp, p), "
            "mesh_dim_names=('dp', 'pp')) or pass mesh=None"
        )
    names = tuple(mesh.mesh_dim_names or ())
    if sorted(names) != sorted(DIMS):
        raise ValueError(
            f"mesh has dims {names or '(unnamed)'} of sizes {tuple(mesh.mesh.shape)}, but a Pipeline needs "
            "exactly two named 'dp' (replicas) and 'pp' (the pipeline's ranks); make it with "
            "init_device_mesh(device_type, (dp, p), mesh_dim_names=('dp', 'pp'))"
        )
    world = dist.get_world_size()
    sizes = {n: int(mesh.mesh.shape[names.index(n)]) for n in DIMS}
    if mesh.mesh.numel() != world:
        raise ValueError(
            f"mesh {sizes} has {mesh.mesh.numel()} ranks but the world has {world}; the mesh must span the "
            "world (its pipelines' channels are made by every rank of the world)"
        )
    if sizes["pp"] != p or sizes["dp"] != dp:
        raise ValueError(
            f"mesh has dp={sizes['dp']}, pp={sizes['pp']} but the plan is for dp={dp} replicas of {p} "
            f"ranks; make the plan for this mesh (partition(..., {sizes['pp']} ranks, dp={sizes['dp']}) or "
            f"plan.replace(dp={sizes['dp']})) or pass a mesh of shape ({dp}, {p})"
        )
    return mesh


def layout_of(mesh: DeviceMesh) -> Layout:
    """This rank's place in ``mesh`` and the global ranks of its groups."""
    pp, dpg = mesh.get_group("pp"), mesh.get_group("dp")
    names = tuple(mesh.mesh_dim_names or ())
    grid = mesh.mesh if names == DIMS else mesh.mesh.transpose(0, 1)  # (dp, pp)
    # a group's ranks are ordered by group rank, which is what the runtime's messages use
    rows = sorted((sorted(int(g) for g in row) for row in grid.tolist()), key=lambda r: r[0])
    return Layout(
        dp=int(grid.shape[0]),
        p=int(grid.shape[1]),
        replica=dist.get_rank(dpg),
        pp_rank=dist.get_rank(pp),
        pipeline=[int(g) for g in dist.get_process_group_ranks(pp)],
        replicas=[int(g) for g in dist.get_process_group_ranks(dpg)],
        pipelines=rows,
    )


def layout_table(dp: int, p: int, stages_of: Any = None) -> str:
    """Which global rank holds which (replica, pipeline rank) in the default layout; with
    ``stages_of(r)`` (a Schedule's), the stages too. For logs and documentation."""
    lines = [f"{'rank':>4}  {'replica':>7}  {'pp rank':>7}  stages"]
    for g in range(dp * p):
        d, r = divmod(g, p)
        stages = ",".join(map(str, stages_of(r))) if stages_of is not None else str(r)
        lines.append(f"{g:>4}  {d:>7}  {r:>7}  {stages}")
    return "\n".join(lines)


def build_composed(dp: int, shard: int, p: int, tp: int, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The ("dp_replicate", "dp_shard", "pp", "tp") mesh over the world, tp innermost, and its
    ("dp_replicate", "dp_shard") ranks flattened into one "data" dim (the step's rows, the loss)."""
    world = dist.get_world_size()
    if world != dp * shard * p * tp:
        raise ValueError(
            f"the plan is for dp={dp} x shard={shard} x pp={p} x tp={tp} = {dp * shard * p * tp} ranks but "
            f"the world has {world}; start {dp * shard * p * tp} ranks or make the plan for this world "
            f"(partition(..., n_ranks, dp=..., shard=..., tp=...) with dp x shard x n_ranks x tp = {world})"
        )
    mesh = init_device_mesh(device_type, (dp, shard, p, tp), mesh_dim_names=COMPOSED)
    return mesh, mesh["dp_replicate", "dp_shard"]._flatten("data")


def check_composed(mesh: Any, dp: int, shard: int, p: int, tp: int) -> tuple[DeviceMesh, DeviceMesh]:
    """A caller's composed mesh: a DeviceMesh with the dims ``COMPOSED`` of the plan's sizes over the
    world; and its data dim, flattened here."""
    sizes = (dp, shard, p, tp)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh with dims {COMPOSED}, got "
            f"{type(mesh).__name__}; make one with init_device_mesh(device_type, {sizes}, "
            f"mesh_dim_names={COMPOSED}) or pass mesh=None"
        )
    names = tuple(mesh.mesh_dim_names or ())
    shape = tuple(int(n) for n in mesh.mesh.shape)
    if names != COMPOSED or shape != sizes:
        got = dict(zip(names, shape, strict=False)) if names else f"unnamed dims {shape}"
        raise ValueError(
            f"mesh has {got}, but this plan (dp={dp}, shard={shard}, pp={p}, tp={tp}) needs a mesh "
            f"init_device_mesh(device_type, {sizes}, mesh_dim_names={COMPOSED}) (any of them may be 1); "
            "or make the plan for the mesh's sizes"
        )
    world = dist.get_world_size()
    if mesh.mesh.numel() != world:
        raise ValueError(
            f"mesh {dict(zip(names, shape, strict=True))} has {mesh.mesh.numel()} ranks but the world has "
            f"{world}; the mesh must span the world (its pipelines' channels are made by every rank of it)"
        )
    return mesh, mesh["dp_replicate", "dp_shard"]._flatten("data")


def composed_layout(mesh: DeviceMesh, data: DeviceMesh) -> Layout:
    """This rank's place in a composed mesh: its pipeline (the "pp" dim), its data group (the
    flattened dp_replicate x dp_shard dims) and every pipeline of the world."""
    dp, shard, p, tp = (int(n) for n in mesh.mesh.shape)
    grid = mesh.mesh  # (dp, shard, p, tp)
    pipelines = [
        [int(g) for g in grid[d, h, :, t].tolist()]
        for d in range(dp)
        for h in range(shard)
        for t in range(tp)
    ]
    group = data.get_group()
    pp = mesh.get_group("pp")
    return Layout(
        dp=dp * shard,
        p=p,
        replica=dist.get_rank(group),
        pp_rank=dist.get_rank(pp),
        pipeline=[int(g) for g in dist.get_process_group_ranks(pp)],
        replicas=[int(g) for g in dist.get_process_group_ranks(group)],
        pipelines=sorted(pipelines, key=lambda r: r[0]),
        shard=shard,
        tp=tp,
    )
