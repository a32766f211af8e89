"""One plan on every rank: ``partition`` called on every rank of a process group runs once.

A profile is measured time, and measured times differ between processes: if every rank of a
torchrun job partitioned on its own, their balances could disagree ([6, 12] on one rank, [7, 11] on
the next) and the pipeline would refuse to start. Where ``torch.distributed`` is initialised with
more than one rank, ``partition`` therefore runs on rank 0 only, and every rank returns its plan::

    rank 0:  plan = partition(...)  ->  store[key] = plan.to_json()   (or the error it raised)
    rank r:  wait for store[key] (bounded by ``SHARE_TIMEOUT_S``)  ->  Plan.from_json(...)

so the plans are byte-identical. Every rank must call ``partition`` the same number of times, in
the same order (each call has its own key), as with any collective.
"""

from __future__ import annotations

import datetime
import functools
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from pipeline.plan import Plan

__all__ = ["SHARE_TIMEOUT_S", "shared_across_ranks"]

SHARE_TIMEOUT_S = 3600.0  # rank 0 profiles the whole model meanwhile: minutes for a large one
_calls = itertools.count()
_ERROR = "error|"

F = TypeVar("F", bound=Callable[..., Plan])


def shared_across_ranks(make: F) -> F:
    """``make`` (``partition``) runs on rank 0 of the default group; every rank returns its plan."""

    @functools.wraps(make)
    def once(*args: Any, **kwargs: Any) -> Plan:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return make(*args, **kwargs)
        from torch.distributed import distributed_c10d as c10d

        store, rank = c10d._get_default_store(), dist.get_rank()
        key = f"stagewise/partition/{next(_calls)}"
        if rank == 0:
            try:
                plan = make(*args, **kwargs)
            except Exception as exc:
                store.set(key, f"{_ERROR}{type(exc).__name__}: {exc}")
                raise
            store.set(key, plan.to_json())
            return plan
        try:
            store.wait([key], datetime.timedelta(seconds=SHARE_TIMEOUT_S))
            text = bytes(store.get(key)).decode()
        except Exception as exc:
            raise RuntimeError(
                f"rank {rank} waited {SHARE_TIMEOUT_S:.0f} s for rank 0's plan (partition runs on rank 0 "
                f"and is shared) and got none: {exc}; check rank 0's output, and that every rank calls "
                "partition the same number of times"
            ) from exc
        if text.startswith(_ERROR):
            raise ValueError(f"partition failed on rank 0, which plans for every rank: {text[len(_ERROR) :]}")
        return Plan.from_json(text)

    return once  # type: ignore[return-value]
