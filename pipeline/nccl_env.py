"""``NCCL_RUNTIME_CONNECT=0``: NCCL connects every collective algorithm when it makes a communicator.

Since NCCL 2.22 a communicator is made without its connections (``NCCL_RUNTIME_CONNECT=1``, the
default): the first collective that picks an algorithm (ring, tree, NVLS, PAT, CollNet; the pick
depends on the message's size) connects it, a blocking handshake with the peers inside that
``dist.*`` call, where no timeout or failure watch of the pipeline's can reach. A peer that raised
but is still alive then holds the rank there for good: at the first loss broadcast, the first
bucket all-reduce of the replicas, the first checkpoint. A warm-up collective at construction does
not help: a one-float all-reduce connects the algorithm NCCL picks for one float (tree or ring, LL),
not the one a 25 MB bucket gets. With ``NCCL_RUNTIME_CONNECT=0`` ``ncclCommInitRank`` (and
``ncclCommSplit``) connects ring, tree, NVLS, PAT and CollNet before it returns (NCCL's
``initTransportsRank``), so the communicators a Pipeline makes at construction (runtime/
collectives.py, runtime/world.py), under its creation guard (runtime/arrival.py), are connected
there. The cost: the buffers of every algorithm, used or not (tens of MB per GPU).

Point-to-point connections are lazy at any setting: NCCL connects a pair at its first send or
receive (every p2p channel of that peer at once, whatever the size), so the Pipeline sends one
message per pair that anything posts later (collectives.py, world.py).

When NCCL reads it. ``NCCL_RUNTIME_CONNECT`` is an ``NCCL_PARAM``: read from the environment
(``getenv``) the first time a communicator is made in the process and cached for the process's
life. That is inside ``init_process_group(..., device_id=...)`` (torch then makes the world's
communicator at once), else at the process's first NCCL collective. So ``import pipeline`` sets it
(``os.environ.setdefault``: a value the user gave stays), which is early enough wherever the
package is imported before ``init_process_group``: ``pipeline.launch``'s ranks, ``torchrun`` of a
script that imports it, ``pipeline.init_distributed()``. ``check`` (called by every Pipeline on the
NCCL path) warns with a ``LazyConnectWarning`` when the process runs lazily anyway: the variable
is not 0 (the user's choice, respected), or it was set here after torch.distributed had already
been initialised with NCCL, when NCCL may have read it before.

This module imports nothing but the standard library: ``import pipeline`` stays free of torch.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["EAGER", "VAR", "LazyConnectWarning", "check", "given", "late", "lazy_reason", "nccl_initialised"]

VAR = "NCCL_RUNTIME_CONNECT"
EAGER = "0"
FIRST_VERSION = (2, 22, 0)  # the first NCCL that connects at runtime; older ones connect at init


class LazyConnectWarning(UserWarning):
    """This process's NCCL may connect collective algorithms inside a step (see ``pipeline.nccl_env``)."""


def nccl_initialised(modules: Mapping[str, Any]) -> str | None:
    """Why NCCL may have read ``VAR`` already, from what ``modules`` (``sys.modules``) holds: a
    default process group with an NCCL backend; None when torch.distributed is not initialised
    with NCCL (or not imported: then nothing made an NCCL communicator through torch)."""
    c10d = modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return None
    try:
        if not c10d.is_initialized():
            return None
        backend = str(c10d.get_backend())
        bound = getattr(c10d._get_default_group(), "bound_device_id", None)
    except Exception:
        return None
    if "nccl" not in backend:
        return None
    if bound is not None:
        return f"init_process_group(device_id={bound}) had made the world's NCCL communicator"
    return "torch.distributed was initialised with NCCL (its first collective makes a communicator)"


given: str | None = os.environ.get(VAR)  # the user's own value, before the default below
late: str | None = nccl_initialised(sys.modules) if given is None else None
os.environ.setdefault(VAR, EAGER)


def lazy_reason(
    value: str | None, given: str | None, late: str | None, version: tuple[int, ...] | None
) -> str | None:
    """Why this process's NCCL connects lazily, or None: ``value`` is ``VAR`` now, ``given`` what
    the user had set before ``import pipeline``, ``late`` why NCCL may have read it before that
    import, ``version`` NCCL's (None: unknown, taken as one that connects at runtime)."""
    if version is not None and tuple(version) < FIRST_VERSION:
        return None  # NCCL before 2.22 connects every collective algorithm when it makes a communicator
    consequence = (
        "NCCL then connects each collective algorithm (ring, tree, NVLS ...; picked by message size) "
        "at its first use, inside a step or a checkpoint, a blocking handshake that the pipeline's "
        "timeout cannot interrupt: a peer that failed but is still alive holds this rank there"
    )
    if value is None or value.strip() != EAGER:
        if value is None:
            now = "unset in this process (removed after import pipeline set it)"
        elif value == given:
            now = f"{value!r} in this process (set before pipeline was imported)"
        else:
            now = f"{value!r} in this process (set after pipeline was imported)"
        return (
            f"{VAR} is {now}, not {EAGER!r}: {consequence}. Export {VAR}={EAGER} "
            "in every rank's environment before its first NCCL communicator (or leave it unset: "
            "import pipeline sets it)"
        )
    if given is None and late is not None:
        return (
            f"pipeline set {VAR}={EAGER} when it was imported, but {late} before that, and NCCL reads "
            f"{VAR} once per process, at its first communicator: it may run lazily. {consequence}. "
            f"Import pipeline before init_process_group, or export {VAR}={EAGER} in the launch environment"
        )
    return None


def check(version: tuple[int, ...] | None = None) -> str | None:
    """Warn (``LazyConnectWarning``) where this process's NCCL may connect lazily; returns the reason.
    ``version``: NCCL's, when known (``torch.cuda.nccl.version()``)."""
    reason = lazy_reason(os.environ.get(VAR), given, late, version)
    if reason is not None:
        warnings.warn(reason, LazyConnectWarning, stacklevel=3)
    return reason
