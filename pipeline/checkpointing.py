"""Checkpoints that resume training bit-identically, at any stage count, written atomically.

    checkpointing.save(folder, step, pipe=pipe, optimizer=opt, lr_scheduler=sched,
                       grad_scaler=scaler, extra={"epoch": 3, "data": loader_pos}, keep=2)
    ...                                           # a new process: build pipe, opt, sched, scaler
    extra = checkpointing.load(folder, pipe=pipe, optimizer=opt, lr_scheduler=sched, grad_scaler=scaler)

Both are collective: call them on every rank, after ``opt.step()`` (the state
then is the state before the next step). A checkpoint holds the parameters
and buffers (BatchNorm's running statistics) under the original model's names,
the optimizer's state and param groups (learning rate, betas, weight decay,
initial_lr ...) per parameter, each rank's scheduler and GradScaler state and
torch generators (CPU, and CUDA once initialised), and ``extra``, any JSON-able
value (the same on every rank), e.g. the step and the data loader's position.
Python's and numpy's generators are not saved: put what the data order needs
in ``extra``. The layout and the rules at another stage count are in
``pipeline/checkpoint/state.py`` and ``optim.py``: a checkpoint taken at 4
stages loads at 2 and back.

Writing is atomic; ``keep`` complete checkpoints stay (``None``: all):

    folder/.tmp-step-00000100   every rank writes here (dcp.save), then a barrier
    folder/step-00000100        rank 0 renames the finished folder into place
    folder/latest               then points here, and older ones beyond ``keep`` go

A crash at any moment leaves ``latest`` naming a complete checkpoint (see
``pipeline/checkpoint/folder.py``). A bad argument or a checkpoint that does
not fit, on any rank, is raised on every rank before anything is written or
read (``pipeline/checkpoint/ranks.py``).

Room for fault tolerance: a manifest of per-file checksums written into the
temporary folder before the rename, the run's configuration and id beside the
step in the ``checkpoint`` record, and ``load`` falling back to the previous
complete checkpoint (``folder.complete`` lists them, oldest first).

The first API (``training_state`` + ``save(folder, step, state)`` +
``load(path, named_parameters, optimizer, extra_keys)``) works for one more
release, with a FutureWarning.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save

from pipeline.checkpoint import folder as _folder
from pipeline.checkpoint import legacy, ranks, state
from pipeline.checkpoint.folder import LATEST, latest
from pipeline.checkpoint.state import Stateful
from pipeline.runtime.pipe import Pipeline

__all__ = ["LATEST", "latest", "load", "save", "training_state"]


def save(
    folder: str | os.PathLike[str],
    step: int,
    legacy_state: dict[str, Any] | None = None,
    *,
    pipe: Pipeline | nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Stateful | None = None,
    grad_scaler: Stateful | None = None,
    extra: Any = None,
    keep: int | None = 2,
) -> Path:
    """Write checkpoint ``step`` of this run into ``folder`` (on every rank); return its folder.

    ``pipe``: the Pipeline (or a whole nn.Module in one process); ``optimizer``
    built from its parameters; ``extra``: any JSON-able value, the same on every
    rank (what ``load`` returns). ``keep``: how many complete checkpoints stay in
    ``folder`` after the save, this one and the newest others by step (``None``:
    all). ``save(folder, step, training_state(...))`` is the deprecated form.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step ({step!r}) must be an int >= 0, the number of optimizer steps taken")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(
            f"keep ({keep!r}) must be an int >= 1 (this checkpoint and keep-1 older) or None (all)"
        )
    if legacy_state is not None:
        warnings.warn(
            "checkpointing.save(folder, step, training_state(...)) is deprecated and will be removed; call "
            "checkpointing.save(folder, step, pipe=pipe, optimizer=optimizer, lr_scheduler=..., "
            "grad_scaler=..., extra=...), which also saves buffers, param groups, scheduler and scaler",
            FutureWarning,
            stacklevel=2,
        )
        return _write(Path(folder), step, legacy_state, keep)
    if pipe is None or not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"save() needs pipe= (a Pipeline or nn.Module) and optimizer= (a torch.optim.Optimizer), got "
            f"pipe={type(pipe).__name__}, optimizer={type(optimizer).__name__}"
        )
    text, flat, error = "", {}, None
    try:
        text = state.extra_text(extra)
        model = state.model_of(pipe)
        flat = state.collect(
            model, optimizer, lr_scheduler, grad_scaler, text, step, ranks.rank(), ranks.world()
        )
    except (TypeError, ValueError, RuntimeError) as exc:
        error = exc
    texts = ranks.together(error, text)
    differ = [r for r, t in enumerate(texts) if t != texts[0]]
    if differ:
        raise ValueError(
            f"save() got a different extra on rank {differ[0]} ({texts[differ[0]]}) than on rank 0 "
            f"({texts[0]}); extra is saved once for all ranks: pass the same value on every rank"
        )
    return _write(Path(folder), step, flat, keep)


def _write(root: Path, step: int, flat: dict[str, Any], keep: int | None) -> Path:
    def write_into(tmp: Path) -> None:
        _dcp_save(flat, storage_writer=FileSystemWriter(tmp))

    return _folder.write(root, step, keep, write_into)


def load(
    folder: str | os.PathLike[str],
    *legacy_args: Any,
    pipe: Pipeline | nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Stateful | None = None,
    grad_scaler: Stateful | None = None,
    **legacy_kwargs: Any,
) -> Any:
    """Restore a checkpoint into the objects given (on every rank); return its ``extra``.

    ``folder``: a folder of checkpoints (its latest complete one is loaded) or
    one step's folder. Pass what was saved: ``optimizer``, ``lr_scheduler`` and
    ``grad_scaler`` freshly built (an optimizer need not have stepped), the
    scheduler after the optimizer; ``optimizer=None`` loads the model alone.
    ``load(path, named_parameters, optimizer, extra_keys)`` is the deprecated form.
    """
    if legacy_args or legacy_kwargs:
        given = {} if optimizer is None else {"optimizer": optimizer}
        return _load_legacy(folder, legacy_args, {**legacy_kwargs, **given})
    if pipe is None:
        raise TypeError("load() needs pipe= (the Pipeline, or nn.Module, to load into)")
    path, model, meta, want, error = Path(folder), nn.Module(), {}, {}, None
    try:
        path = _folder.resolve(path)
        model = state.model_of(pipe)
        meta = FileSystemReader(path).read_metadata().state_dict_metadata
        want = state.targets(meta, model, optimizer, lr_scheduler, grad_scaler, ranks.rank(), repr(str(path)))
    except (TypeError, ValueError, RuntimeError, OSError) as exc:
        error = exc
    asked = ranks.together(error, sorted(k for k in want if k.startswith(state.MODEL)))
    _check_every_model_entry_asked(meta, {k for names in asked for k in names}, path)
    _load_checked(want, path)
    extra, error = None, None
    try:
        extra = state.restore(want, model, optimizer, lr_scheduler, grad_scaler, ranks.rank())
    except (TypeError, ValueError, RuntimeError) as exc:  # e.g. param groups formed differently
        error = exc
    ranks.together(error, None)
    return extra


def _check_every_model_entry_asked(meta: Mapping[str, Any], asked: set[str], path: Path) -> None:
    """Every saved model entry is loaded by some rank (else the model is smaller than the saved one)."""
    extra = sorted(k for k in meta if k.startswith(state.MODEL) and k not in asked)
    if extra:
        raise ValueError(
            f"checkpoint {str(path)!r} holds {[k[len(state.MODEL) :] for k in extra[:5]]} (of {len(extra)}) "
            "that no rank's model has; was it written by a bigger model? build the model it was saved from"
        )


def _load_checked(want: dict[str, Any], path: Path) -> None:
    try:
        _dcp_load(want, storage_reader=FileSystemReader(path))
    except (Exception, CheckpointException) as exc:  # dcp's exception is a BaseException
        raise ValueError(f"cannot load checkpoint {str(path)!r}: {str(exc).splitlines()[0]}") from exc


# ---- deprecated: the first API


def training_state(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Deprecated: the flat state of parameters, their optimizer state, RNG and ``extra``."""
    warnings.warn(
        "checkpointing.training_state is deprecated and will be removed: it misses buffers, param groups, "
        "the scheduler and the scaler; call checkpointing.save(folder, step, pipe=pipe, optimizer=optimizer, "
        "lr_scheduler=..., grad_scaler=..., extra=...)",
        FutureWarning,
        stacklevel=2,
    )
    return legacy.training_state(named_parameters, optimizer, extra, ranks.rank())


def _load_legacy(folder: str | os.PathLike[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    warnings.warn(
        "checkpointing.load(path, named_parameters, optimizer, extra_keys) is deprecated and will be "
        "removed; call checkpointing.load(folder, pipe=pipe, optimizer=optimizer, lr_scheduler=..., "
        "grad_scaler=...), which returns the extra given to save(..., extra=...)",
        FutureWarning,
        stacklevel=3,
    )

    def bind(
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        extra_keys: Iterable[str] = (),
    ) -> tuple[dict[str, nn.Parameter], torch.optim.Optimizer, list[str]]:
        return dict(named_parameters), optimizer, list(extra_keys)

    params, opt, extra_keys = bind(*args, **kwargs)
    path = Path(folder)
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    want = legacy.targets(path, meta, params, extra_keys, ranks.rank())
    _load_checked(want, path)
    return legacy.apply(want, params, opt, extra_keys, ranks.rank())
