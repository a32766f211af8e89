"""Atomic, stage-count independent checkpoints with ``torch.distributed.checkpoint``.

    path = checkpointing.save(folder, step, checkpointing.training_state(named_params, opt, extra))
    extra = checkpointing.load(checkpointing.latest(folder), named_params, opt, extra_keys)

Every rank writes only what it holds, under the names of the original model:

    model/3.weight               the parameter
    optim/3.weight/exp_avg       each per-parameter optimizer tensor (AdamW: step, exp_avg, exp_avg_sq)
    rng/<rank>/cpu, rng/<rank>/cuda
    <extra keys>                 step, data position, config ... (any picklable value, same on every rank)

so a checkpoint taken with 4 stages loads into 2: each rank just asks for the
names it now holds. Saving is atomic:

    folder/.tmp-step-00000100   every rank writes here (dcp.save), then a barrier
    folder/.old-step-00000100   rank 0 moves an earlier save of the same step aside
    folder/step-00000100        rank 0 renames the finished folder into place
    folder/latest               then points here (write a temporary file + os.replace)

A crash at any moment leaves ``latest`` naming a complete checkpoint: the new
one, or the one it named before (``latest()`` finds a step moved aside).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save

__all__ = ["LATEST", "latest", "load", "save", "training_state"]

LATEST = "latest"
_PREFIX = "step-"
_OLD = ".old-"  # a step's previous checkpoint while the step is saved again
_KEEP = 2  # complete checkpoints kept; older ones are removed after a successful save


def _distributed() -> bool:
    return bool(dist.is_initialized())  # type: ignore[no-untyped-call]


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {f"rng/{_rank()}/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state[f"rng/{_rank()}/cuda"] = torch.cuda.get_rng_state()
    return state


def training_state(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The flat state this rank saves: its parameters, their optimizer state, RNG, ``extra``."""
    state: dict[str, Any] = {}
    for name, p in named_parameters:
        state[f"model/{name}"] = p.detach()
        for key, value in optimizer.state.get(p, {}).items():
            state[f"optim/{name}/{key}"] = value
    state.update(_rng_state())
    for key, value in (extra or {}).items():
        if isinstance(value, (Mapping, list, tuple)):  # dcp would flatten it into other keys
            raise TypeError(
                f"extra[{key!r}] is a {type(value).__name__}; store containers as a string (json.dumps) "
                "or give each element its own key"
            )
        state[key] = value
    return state


def save(folder: str | os.PathLike[str], step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` (collectively, on every rank) as checkpoint ``step``; return its folder."""
    root = Path(folder)
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f".tmp-{_PREFIX}{step:08d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
    _barrier()
    _dcp_save(state, storage_writer=FileSystemWriter(tmp))
    _barrier()
    if _rank() == 0:
        old = root / f"{_OLD}{final.name}"
        if final.exists():  # saving a step again, e.g. after resuming from it
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        pointer = root / f".{LATEST}.tmp"
        with pointer.open("w") as f:
            f.write(final.name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, root / LATEST)
        for stale in root.glob(f"{_OLD}*"):  # this save's, and any a crash left behind
            shutil.rmtree(stale, ignore_errors=True)
        for stale in _complete(root)[:-_KEEP]:
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def _complete(root: Path) -> list[Path]:
    """Finished checkpoints (with dcp's metadata file), oldest first."""
    found = [p for p in root.glob(f"{_PREFIX}*") if (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest(folder: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``latest`` names, else the newest complete one, else None.

    A crash while a step is saved again, between moving its previous folder
    aside and moving the new one into place, leaves only ``.old-step-...``:
    that previous folder is then the one ``latest`` means.
    """
    root = Path(folder)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        for named in (root / name, root / f"{_OLD}{name}"):
            if (named / ".metadata").is_file():
                return named
    found = _complete(root)
    return found[-1] if found else None


def load(
    path: str | os.PathLike[str],
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    extra_keys: Iterable[str] = (),
) -> dict[str, Any]:
    """Load this rank's parameters and optimizer state in place (collectively); return the extras.

    Optimizer tensors are allocated from the checkpoint's metadata, so a fresh
    optimizer that has not stepped yet receives the saved state.
    """
    path = Path(path)
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    params = dict(named_parameters)
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
    for key in (f"rng/{_rank()}/cpu", f"rng/{_rank()}/cuda"):
        if key in meta and (key.endswith("cpu") or torch.cuda.is_available()):
            # RNG states are CPU byte tensors for both generators; never the default device
            size = tuple(getattr(meta[key], "size", ()))
            state[key] = torch.empty(size, dtype=torch.uint8, device="cpu")
    for key in extra_keys:
        state[key] = None
    _load_checked(state, path)
    for name, p in params.items():
        prefix = f"optim/{name}/"
        opt_state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if opt_state:
            optimizer.state[p] = opt_state
    if f"rng/{_rank()}/cpu" in state:
        torch.set_rng_state(state[f"rng/{_rank()}/cpu"])
    if f"rng/{_rank()}/cuda" in state:
        torch.cuda.set_rng_state(state[f"rng/{_rank()}/cuda"])
    return {k: state[k] for k in extra_keys}


def _load_checked(state: dict[str, Any], path: Path) -> None:
    try:
        _dcp_load(state, storage_reader=FileSystemReader(path))
    except (Exception, CheckpointException) as exc:  # dcp's exception is a BaseException
        raise ValueError(f"cannot load checkpoint {str(path)!r}: {str(exc).splitlines()[0]}") from exc
