"""A Pipeline's replicas: its place in the ("dp", "pp") mesh and what data parallelism adds to a step.

    # p: ranks per pipeline, r: pipeline rank, d: replica, s: stage, B_d: replica d's rows

``resolve`` picks the groups: with ``dp`` = 1 and no mesh, the pipeline runs on
``group`` as ever (nothing is made); otherwise on the "pp" group of a mesh,
given (``mesh=``) or made from the plan (mesh.py: global rank g = d * p + r).

``Replicas`` holds, on one rank of a replicated pipeline, the "dp" group's
``Comm`` (collectives only; its failure key is the mesh's, shared with the
pipeline's ``Comm``) and the gradient reducer (dp.py), and does, at:

    construction   check that the replicas run the same pipeline (schedule, m,
                   balance, bucket size, sizes of the stages' state), naming two
                   that differ; then broadcast every parameter and buffer of the
                   local stages from replica 0 (one flat tensor per dtype), so
                   that differently seeded or initialised replicas start identical
    every step     all-reduce the replicas' rows once the executor knows them, which
                   weighs the last stage's loss by B_d / B; arm and launch each
                   stage's buckets around its last gradient action (hooks in the
                   executor); wait before ``step`` returns
    the loss       the global mean: sum_d B_d loss_d / sum_d B_d, on every rank
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.runtime.comm.agree import agree, summary
from pipeline.runtime.comm.p2p import Comm
from pipeline.runtime.comm.state import broadcast_state, module_state
from pipeline.runtime.replicas.dp import GradReducer, Hooked, Reduction, assign_parameters, reduction_points
from pipeline.runtime.replicas.mesh import (
    Layout,
    bound_timeouts,
    build_composed,
    build_mesh,
    check_composed,
    check_mesh,
    check_world,
    composed_layout,
    layout_of,
)
from pipeline.runtime.replicas.sharded import ShardedStages
from pipeline.schedules.schedule import Schedule

__all__ = ["Groups", "Replicas", "resolve", "resolve_composed"]


@dataclass(frozen=True)
class Groups:
    """The process groups a Pipeline runs on."""

    mesh: Any  # DeviceMesh, or None when not replicated
    pp: Any  # the pipeline's group (None: the world)
    dp: Any  # the replicas' group, None when not replicated (composed: the dp_replicate x dp_shard ranks)
    layout: Layout | None
    shard_mesh: Any = None  # composed with shard > 1: FSDP's mesh, ("dp_shard",) or HSDP's 2-D one
    tp_mesh: Any = None  # composed with tp > 1: the stage's tensor-parallel ranks


def resolve_composed(
    dp: int, shard: int, p: int, tp: int, group: Any, mesh: Any, distributed: bool, timeout: float
) -> Groups:
    """The groups of a composed plan (shard > 1 or tp > 1) on the ("dp_replicate", "dp_shard", "pp",
    "tp") mesh, given or made (mesh.py)."""
    n = dp * shard * p * tp
    if not distributed:
        raise RuntimeError(
            f"this plan runs dp={dp} x shard={shard} x pp={p} x tp={tp} = {n} ranks but torch.distributed "
            f"is not initialised in this process; start {n} ranks with pipeline.launch(fn, {n}, ...) or "
            f"torchrun --nproc-per-node {n} (then call pipeline.init_distributed() before Pipeline)"
        )
    if group is not None:
        raise ValueError(
            "group= and a composed plan (shard > 1 or tp > 1) do not mix: the pipeline runs on the 'pp' "
            "dim of its mesh; pass mesh= (or neither, and the mesh is made from the plan)"
        )
    if mesh is None:
        mesh, data = build_composed(dp, shard, p, tp, "cuda" if dist.get_backend() == "nccl" else "cpu")
        bound_timeouts(mesh, timeout)
        bound_timeouts(data, timeout)
    else:
        mesh, data = check_composed(mesh, dp, shard, p, tp)
    shard_mesh = None
    # replicas of tensor-parallel stages reduce through FSDP too (HSDP with shards of one: an
    # all-reduce of each DTensor gradient's local part); dp.py's buckets hold plain gradients only
    if shard > 1 or (dp > 1 and tp > 1):
        shard_mesh = mesh["dp_replicate", "dp_shard"] if dp > 1 else mesh["dp_shard"]
    tp_mesh = mesh["tp"] if tp > 1 else None
    group = data.get_group() if dp * shard > 1 else None
    return Groups(mesh, mesh.get_group("pp"), group, composed_layout(mesh, data), shard_mesh, tp_mesh)


def resolve(dp: int | None, p: int, group: Any, mesh: Any, distributed: bool, timeout: float) -> Groups:
    """The groups for a plan of ``dp`` replicas (None: the mesh's) of ``p`` ranks; ValueError when the
    world, ``group`` or ``mesh`` does not fit. A mesh made here has its groups bounded by ``timeout``
    (a caller's mesh keeps the timeouts its maker gave it)."""
    if mesh is None and (dp or 1) == 1:
        return Groups(None, group, None, None)
    if not distributed:
        n = (dp or 1) * p
        raise RuntimeError(
            f"this plan runs dp={dp} replicas of {p} ranks but torch.distributed is not initialised in this "
            f"process; start {n} ranks with pipeline.launch(fn, {n}, ...) or torchrun --nproc-per-node {n} "
            "(then call pipeline.init_distributed() before Pipeline)"
        )
    if group is not None:
        raise ValueError(
            "group= and replicas do not mix: a replicated pipeline (plan.dp > 1, or mesh=) runs on the "
            "'pp' group of its mesh; pass mesh= (or neither, and the mesh is made from the plan)"
        )
    if mesh is None:
        assert dp is not None
        check_world(dist.get_world_size(), dp, p)
        mesh = build_mesh(dp, p, "cuda" if dist.get_backend() == "nccl" else "cpu")
        bound_timeouts(mesh, timeout)
    else:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if dp is None and "dp" in names:
            dp = int(mesh.mesh.shape[names.index("dp")])
        check_mesh(mesh, dp or 1, p)
    return Groups(mesh, mesh.get_group("pp"), mesh.get_group("dp"), layout_of(mesh))


class Replicas:
    """One rank's data-parallel side: the "dp" Comm, the broadcast, the agreement, the reducer."""

    def __init__(
        self,
        groups: Groups,
        key_prefix: str,
        failure: tuple[Any, str],
        timeout: float,
        modules: Mapping[int, nn.Module],
        sched: Schedule,
        rank: int,
        executor: Hooked,
        bucket_mb: float,
        config: str,
        zero: int = 2,
    ) -> None:
        """``config``: this rank's pipeline in one line (schedule, m, balance), which its replicas must
        share; checked here, before anything of different sizes could meet in a collective. With a
        shard mesh (``groups.shard_mesh``) the stages are then sharded (sharded.py, ZeRO-``zero``) and
        FSDP reduces their gradients: the reducer here only weighs the replicas' rows."""
        assert groups.layout is not None
        self.layout, self.bucket_mb = groups.layout, bucket_mb
        self.comm = Comm(
            groups.dp, f"{key_prefix}/dp", timeout, failure=failure, p2p=False, global_names=True
        )
        # its communicator now (every algorithm connected: NCCL_RUNTIME_CONNECT=0), not at the step's
        # rows all-reduce: the broadcast below makes none where this rank's stages hold no tensor
        self.comm.collectives.make_group()
        state = module_state(modules.values())
        sizes = ",".join(
            f"{str(k[0]).removeprefix('torch.')}:{sum(t.numel() for t in ts)}" for k, ts in state.items()
        )
        self._agree(f"{config}|bucket_mb={bucket_mb:g}|state {sizes}", f"{key_prefix}/replicas")
        what = f"the parameters from replica 0 (rank {self.comm.name(0)})"  # one flat tensor per kind
        broadcast_state(state, lambda flat: self.comm.broadcast(flat, 0, what), self.comm.device)
        points = reduction_points(sched, rank)
        lowered = list(sched.lowered()[rank])
        owned = assign_parameters(modules, points, lowered)
        self.sharded: ShardedStages | None = None
        if groups.shard_mesh is not None:  # after the broadcast: FSDP shards each rank's full copy
            self.sharded = ShardedStages(modules, groups.shard_mesh, zero, sched, rank, executor)
            owned = {s: [] for s in modules}
        # a split backward accumulates a parameter once per layer holding it: launch such a stage at its end
        early = [s for s in modules if not (sched.split_backward and _shares_parameters(modules[s]))]
        self.reducer = GradReducer(
            owned, self.comm, int(bucket_mb * 1e6), self.comm.me, self.layout.replicas, early
        )
        executor.on_rows = self._rows_known
        reducer = self.reducer
        for a, s in points.items():
            if self.sharded is None:
                executor.hook(a, functools.partial(reducer.arm, s), functools.partial(reducer.launch, s))

    def _rows_known(self, sizes: Sequence[int]) -> Callable[[], torch.Tensor]:
        """The executor has read this step's micro-batch rows off the header: their all-reduce starts,
        and the last stage weighs its loss by the replica's share of the global batch."""
        self.reducer.start_rows(sum(sizes))
        return self.reducer.share

    def _agree(self, mine: str, key: str) -> None:
        """This rank's pipeline (``mine``) is its replicas'; a ValueError naming two that differ."""
        differs = agree(self.comm, key, mine)
        if differs is not None:
            q, theirs = differs
            raise ValueError(
                f"replicas disagree about the pipeline: rank {self.comm.me} (replica {self.comm.rank}) has "
                f"{summary(mine)}, rank {self.comm.name(q)} (replica {q}) has {summary(theirs)}; build "
                "every replica's Pipeline from the same model and Plan (and bucket_mb)"
            )

    def global_mean(self, pair: torch.Tensor) -> torch.Tensor:
        """The replicas' losses weighted by what their batches weigh (rows, or a variable-length
        step's target tokens): the mean over the global batch. ``pair``: this replica's (mean loss,
        weight), float64 on the device; the mean stays there (the step reads it once, at its end)."""
        total = torch.stack([pair[0] * pair[1], pair[1]])
        self.comm.all_reduce(total, dist.ReduceOp.SUM, "the loss's all-reduce over the replicas")
        return total[0] / total[1]

    def begin_step(self, record: bool) -> None:
        self.reducer.begin_step(record)
        if self.sharded is not None:
            self.sharded.begin_step()

    def wait(self, stages: Iterable[int]) -> None:
        if self.sharded is not None:  # FSDP reduced each stage at its last gradient action
            self.reducer.share()  # the rows' all-reduce ends in its step
            return
        self.reducer.wait(stages)

    @property
    def events(self) -> Sequence[Reduction]:
        return self.reducer.events

    def close(self) -> None:
        self.reducer.close()
        self.comm.close()


def _shares_parameters(module: nn.Module) -> bool:
    ids = [id(p) for layer in module.children() for p in layer.parameters()]
    return len(ids) != len(set(ids))
