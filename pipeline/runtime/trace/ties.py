"""Tied weights: parameters held by more than one stage, kept equal across the ranks that hold them.

    # p: ranks, r: rank, k: stages, s: stage

A tie is one ``Parameter`` object that two or more stages read (an embedding and the LM head
sharing a weight; the same module in two places of an ``nn.Sequential``). ``find_ties`` finds them
by identity in the stage modules every rank builds from the same model, so every rank finds the
same ties in the same order. Each rank holding a tied stage keeps a copy; after each backward::

    rank 0 (stage 0: tok)       grad g0 ---.
                                            all_reduce(SUM) over the tie's ranks -> g0 + g3 on both
    rank 3 (stage 3: head)      grad g3 ---'

so every copy has the gradient one process would compute for the shared parameter, and the
optimizer keeps the copies identical (they start identical: ``sync`` broadcasts them once).

``TiedGrads`` makes one process group per set of ranks that some tie spans (ties over the same
ranks share it, and their gradients travel in one flat buffer per dtype), created once, by the
members only, and talks through a ``Comm``: the pipeline's timeout and failure watch. A tie whose
stages all live on one rank needs nothing (one object, autograd sums both uses).

Only this step's gradient is summed: ``begin`` puts aside what ``.grad`` already holds (grads
accumulate across steps without ``zero_grad``), ``reduce`` sums the new part and adds it back;
summing the whole ``.grad`` would count an earlier step's sum once per copy. ``counted`` says
which copy a global gradient norm includes (one per tie: the lowest rank's).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.runtime.comm.p2p import Comm
from pipeline.schedules.program import tie_groups

__all__ = ["Tie", "TiedGrads", "find_ties"]


@dataclass(frozen=True)
class Tie:
    """A parameter read by several stages: its name in each (``names[j]`` in ``stages[j]``)."""

    names: tuple[str, ...]
    stages: tuple[int, ...]

    def describe(self) -> str:
        names = " / ".join(dict.fromkeys(self.names))
        return f"{names} (stages {', '.join(map(str, self.stages))})"


def find_ties(stages: Sequence[nn.Module]) -> list[Tie]:
    """Parameters (by identity) that more than one of ``stages`` (one module per stage) holds."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for s, module in enumerate(stages):
        for name, p in module.named_parameters(remove_duplicate=False):
            places = seen.setdefault(id(p), [])
            if not any(at == s for at, _ in places):
                places.append((s, name))
    return [
        Tie(tuple(name for _, name in places), tuple(s for s, _ in places))
        for places in seen.values()
        if len(places) > 1
    ]


class TiedGrads:
    """This rank's tied parameters and their groups (see the module docstring).

    ``params[(s, name)]``: the local parameter that stage s holds as ``name`` (this rank's stages
    only); ``rank_of(s)``: the group rank of stage s. Build it on every rank of ``group`` (the
    pipeline's), in the same order as the other ranks' pipelines. ``failure``: the pipeline's
    failure key (store, key), which the ties' groups then watch too (see ``Comm``). ``pipelines``:
    every replica's global ranks, when ``group`` is one of several pipelines (a mesh).
    """

    def __init__(
        self,
        ties: Sequence[Tie],
        params: dict[tuple[int, str], nn.Parameter],
        rank_of: Callable[[int], int],
        rank: int,
        *,
        group: Any = None,
        timeout: float = 300.0,
        key_prefix: str = "stagewise/ties",
        failure: tuple[Any, str] | None = None,
        pipelines: list[list[int]] | None = None,
    ) -> None:
        self.rank = rank
        self._local: list[tuple[Tie, nn.Parameter, tuple[int, ...]]] = []
        sets: dict[tuple[int, ...], list[int]] = {}  # ranks -> indices into _local
        for tie in ties:
            ranks = tuple(sorted({rank_of(s) for s in tie.stages}))
            mine = [params[(s, n)] for s, n in zip(tie.stages, tie.names, strict=True) if (s, n) in params]
            if not mine:
                continue
            if len({id(p) for p in mine}) != 1:
                raise ValueError(
                    f"tied parameter {tie.describe()} is {len(mine)} different tensors on rank {rank}; the "
                    "stages of one rank must share it (build them together, e.g. one materialize() call)"
                )
            self._local.append((tie, mine[0], ranks))
            if len(ranks) > 1:
                sets.setdefault(ranks, []).append(len(self._local) - 1)
        made = _tie_groups(ties, rank_of, sets, group, pipelines, timeout)
        self._groups: list[tuple[Comm, tuple[int, ...], list[int]]] = []
        for ranks, members in sets.items():
            prefix = f"{key_prefix}/{'-'.join(map(str, ranks))}"
            comm = Comm(made[ranks], prefix, timeout, failure=failure, p2p=False, global_names=True)
            self._groups.append((comm, ranks, members))
        self._stash: dict[int, torch.Tensor | None] = {}

    @property
    def ties(self) -> list[Tie]:
        """The ties this rank holds a copy of."""
        return [tie for tie, _, _ in self._local]

    def counted(self, p: nn.Parameter) -> bool:
        """Whether this rank's copy of ``p`` counts in a global gradient norm (one copy per tie does)."""
        for _, q, ranks in self._local:
            if q is p:
                return self.rank == ranks[0]
        return True

    def sync(self) -> None:
        """Make every copy equal to the lowest rank's (once, after the stages are built)."""
        for comm, ranks, members in self._groups:
            with torch.no_grad():
                for p in self._params(members):
                    what = f"the tied parameter {self._name(p)} from rank {ranks[0]} (to ranks {list(ranks)})"
                    data = p.detach().to(comm.device)
                    comm.broadcast(data, 0, what)  # group rank 0: the lowest of ``ranks``
                    p.copy_(data)

    def begin(self) -> None:
        """Before a step's backward: put aside the gradients the tied copies hold already."""
        self._stash = {}
        for _, _, members in self._groups:
            for p in self._params(members):
                self._stash[id(p)] = p.grad
                p.grad = None

    def reduce(self, only: tuple[int, ...] | None = None) -> None:
        """After a step's backward: sum this step's gradients of every tie over its ranks (see above);
        ``only``: the ties over those ranks alone (the program's ``all_reduce ties``, one per group)."""
        if only is not None and only not in [ranks for _, ranks, _ in self._groups]:
            raise RuntimeError(f"rank {self.rank} holds no tied weight over ranks {list(only)}: the program "
                               "and the ties found in the stages disagree")  # fmt: skip
        for comm, ranks, members in self._groups:
            if only is not None and ranks != only:
                continue
            params = self._params(members)
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in params:
                by_dtype.setdefault(p.dtype, []).append(p)
            for dtype, group in by_dtype.items():
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
                flat = torch.cat([g.reshape(-1) for g in grads]).to(comm.device)
                names = ", ".join(self._name(p) for p in group)
                comm.all_reduce(
                    flat,
                    dist.ReduceOp.SUM,
                    f"the gradients of tied {names} ({dtype}) over ranks {list(ranks)}",
                )
                at = 0
                for p in group:
                    part = flat[at : at + p.numel()].view_as(p).to(p.device)
                    at += p.numel()
                    old = self._stash.pop(id(p), None)
                    p.grad = part if old is None else old.add_(part)

    def close(self) -> None:
        for comm, _, _ in self._groups:
            comm.close()

    def _params(self, members: list[int]) -> list[nn.Parameter]:
        return [self._local[j][1] for j in members]

    def _name(self, p: nn.Parameter) -> str:
        return next(tie.describe() for tie, q, _ in self._local if q is p)


def _tie_groups(
    ties: Sequence[Tie],
    rank_of: Callable[[int], int],
    mine: dict[tuple[int, ...], list[int]],
    group: Any,
    pipelines: list[list[int]] | None,
    timeout: float,
) -> dict[tuple[int, ...], Any]:
    """The process group of each set of pipeline ranks in ``mine``.

    ``dist.new_group`` is collective over the world and, with a bound device
    (``init_process_group(device_id=...)``), splits the world's NCCL communicator, which every
    world rank must join. So every rank makes the group of every tie's ranks in every pipeline, in
    one order (the ties' order: the same on every rank), and keeps its own. A pipeline that is a
    subgroup of a larger world (no mesh) cannot: its members make theirs alone, unbound only."""
    sets = tie_groups(rank_of, [tie.stages for tie in ties])
    made: dict[tuple[int, ...], Any] = {}
    if not sets:  # every tie within one rank (one process, too): no group anywhere
        return made
    td = datetime.timedelta(seconds=timeout)  # bounded like every other wait (torch's default: 30 min)
    n = dist.get_world_size(group)
    row = [dist.get_global_rank(group, q) if group is not None else q for q in range(n)]
    rows = pipelines if pipelines is not None else [row]
    if sorted(g for r in rows for g in r) == list(range(dist.get_world_size())):
        for other in rows:
            for ranks in sets:
                pg = dist.new_group([other[q] for q in ranks], timeout=td)
                if other == row and ranks in mine:
                    made[ranks] = pg
        return made
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    if bound is not None:
        raise ValueError(
            f"the pipeline's group holds ranks {row} of a world of {dist.get_world_size()} with a bound "
            f"device ({bound}): the tied weights' groups split the world's communicator, which every "
            "world rank must join; pass a mesh that spans the world (mesh=), or group=None"
        )
    for ranks in mine:  # only the members meet here
        made[ranks] = dist.new_group([row[q] for q in ranks], timeout=td, use_local_synchronization=True)
    return made
