"""The first checkpoint layout (``training_state``), kept for one release behind a FutureWarning.

    model/<name>, optim/<name>/<key>, rng/<r>/cpu, rng/<r>/cuda, <extra keys>

It lacks buffers, param groups, the scheduler and the scaler: a resume from it
is not exact (see ``pipeline.checkpointing``, which replaces it). The state
dict is built here; ``pipeline.checkpointing`` does the reading and writing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["apply", "targets", "training_state"]


def _rng_state(rank: int) -> dict[str, Any]:
    state: dict[str, Any] = {f"rng/{rank}/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state[f"rng/{rank}/cuda"] = torch.cuda.get_rng_state()
    return state


def training_state(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    extra: Mapping[str, Any] | None,
    rank: int,
) -> dict[str, Any]:
    """The flat state this rank saves: its parameters, their optimizer state, RNG, ``extra``."""
    state: dict[str, Any] = {}
    for name, p in named_parameters:
        state[f"model/{name}"] = p.detach()
        for key, value in optimizer.state.get(p, {}).items():
            state[f"optim/{name}/{key}"] = value
    state.update(_rng_state(rank))
    for key, value in (extra or {}).items():
        if isinstance(value, (Mapping, list, tuple)):  # dcp would flatten it into other keys
            raise TypeError(
                f"extra[{key!r}] is a {type(value).__name__}; store containers as a string (json.dumps) "
                "or give each element its own key, or use checkpointing.save(..., extra=...), which "
                "takes any JSON-able value"
            )
        state[key] = value
    return state


def targets(
    path: Path,
    meta: Mapping[str, Any],
    params: Mapping[str, nn.Parameter],
    extra_keys: Iterable[str],
    rank: int,
) -> dict[str, Any]:
    """What this rank loads from a ``training_state`` checkpoint (dcp fills it in)."""
    state: dict[str, Any] = {}
    missing = [f"model/{n}" for n in params if f"model/{n}" not in meta]
    missing += [k for k in extra_keys if k not in meta]
    if missing:
        raise ValueError(
            f"checkpoint {str(path)!r} lacks {missing[:5]} (of {len(missing)} missing); "
            "was it written by a different model? pass load() a checkpoint written for these "
            "named_parameters, and only extra_keys that were saved with it"
        )
    wrong = [
        f"{name}: saved {tuple(getattr(meta[f'model/{name}'], 'size', ()))}, now {tuple(p.shape)}"
        for name, p in params.items()
        if tuple(getattr(meta[f"model/{name}"], "size", ())) != tuple(p.shape)
    ]
    if wrong:
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit this model ({'; '.join(wrong[:3])}); "
            "build the model with the configuration it was saved with before calling load"
        )
    for name, p in params.items():
        state[f"model/{name}"] = p.detach()
        prefix = f"optim/{name}/"
        for key, item in meta.items():
            if not key.startswith(prefix):
                continue
            if not isinstance(item, TensorStorageMetadata):  # dcp puts the loaded object in its place
                state[key] = None
                continue
            device = p.device if tuple(item.size) == tuple(p.shape) else torch.device("cpu")
            state[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype, device=device)
    for key in (f"rng/{rank}/cpu", f"rng/{rank}/cuda"):
        if key in meta and (key.endswith("cpu") or torch.cuda.is_available()):
            # RNG states are CPU byte tensors for both generators; never the default device
            size = tuple(getattr(meta[key], "size", ()))
            state[key] = torch.empty(size, dtype=torch.uint8, device="cpu")
    for key in extra_keys:
        state[key] = None
    return state


def apply(
    state: Mapping[str, Any],
    params: Mapping[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    extra_keys: Iterable[str],
    rank: int,
) -> dict[str, Any]:
    """Put the loaded optimizer state and RNG in place (parameters were loaded in place); the extras."""
    for name, p in params.items():
        prefix = f"optim/{name}/"
        opt_state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if opt_state:
            optimizer.state[p] = opt_state
    if f"rng/{rank}/cpu" in state:
        torch.set_rng_state(state[f"rng/{rank}/cpu"])
    if f"rng/{rank}/cuda" in state:
        torch.cuda.set_rng_state(state[f"rng/{rank}/cuda"])
    return {k: state[k] for k in extra_keys}
