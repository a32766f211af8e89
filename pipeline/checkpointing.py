"""Checkpoints that resume training bit-identically, at any stage count, written atomically, verified.

    resumed = checkpointing.resume(folder, pipe=pipe, optimizer=opt, lr_scheduler=sched,
                                   grad_scaler=scaler, config=run_config)   # None: the folder is empty
    start = 0 if resumed is None else resumed.step
    ...
    checkpointing.save(folder, step, pipe=pipe, optimizer=opt, lr_scheduler=sched, grad_scaler=scaler,
                       config=run_config, extra={"epoch": 3, "data": loader_pos}, keep=2)

All are collective: call them on every rank, after ``opt.step()`` (the state
then is the state before the next step). A checkpoint holds the parameters
and buffers (BatchNorm's running statistics) under the original model's names,
the optimizer's state and param groups (learning rate, betas, weight decay,
initial_lr ...) per parameter, each rank's scheduler and GradScaler state and
torch generators (CPU, and CUDA once initialised), and ``extra``, any JSON-able
value (the same on every rank), e.g. the step and the data loader's position.
Python's and numpy's generators are not saved: put what the data order needs
in ``extra``. The layout and the rules at another stage count are in
``pipeline/checkpoint/state.py`` and ``optim.py``: a checkpoint taken at 4
stages loads at 2 and back, and one of a composed pipeline (FSDP2 shards,
tensor parallelism: DTensors, saved by name as whole tensors) at any other
(pp, shard, tp), each rank reading its own slices.

A checkpoint belongs to one run (``pipeline/checkpoint/runs.py``): it records
the run's id and ``config`` (the run's settings, a JSON-able dict); ``resume``
refuses a checkpoint whose configuration differs from the current one, listing
every difference, unless ``allow_changes`` names it (a new stage count, dp).
``keep`` prunes the run's own older checkpoints, never another run's.

Nothing half-written or damaged is loaded (``pipeline/checkpoint/manifest.py``,
``choose.py``): every file's size and CRC-32 go into ``manifest.json``, written
last, before the folder is renamed into place; ``load`` and ``resume`` verify
them (each rank a share, all ranks the same verdict) and, in a folder of
checkpoints, fall back to the newest sound one with a CheckpointFallbackWarning
naming what was rejected and why. Writing is atomic (``folder.py``):

    folder/.tmp-step-00000100   every rank writes here (dcp.save), then digests its share
    folder/step-00000100        rank 0 writes the manifest, renames the finished folder into place
    folder/latest               then points here, and the run's older ones beyond ``keep`` go

A bad argument or a checkpoint that does not fit, on any rank, is raised on
every rank before anything is written or read (``pipeline/checkpoint/ranks.py``);
a failed write (a full disk) is raised on every rank naming the path and the
errno, and leaves the earlier checkpoints as they were.

Before anything is built, ``recorded_config(folder)`` reads the configuration the newest
checkpoint recorded, e.g. to reuse the plan a search chose instead of searching again:

    found = checkpointing.recorded_config(folder)      # (path, config) or None
    plan = Plan.from_json(found[1]["plan"]) if found else partition(model, ...)

The first API (``training_state`` + ``save(folder, step, state)`` +
``load(path, named_parameters, optimizer, extra_keys)``) works for one more
release, with a FutureWarning.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save

from pipeline.checkpoint import folder as _folder
from pipeline.checkpoint import legacy, ranks, runs, state
from pipeline.checkpoint.choose import (
    INTEGRITY,
    CheckpointFallbackWarning,
    Chosen,
    CorruptCheckpoint,
    choose,
    is_checkpoint,
)
from pipeline.checkpoint.folder import LATEST, candidates, latest, read_manifest
from pipeline.checkpoint.manifest import Manifest
from pipeline.checkpoint.runs import ConfigMismatch
from pipeline.checkpoint.state import Stateful
from pipeline.runtime.comm import world
from pipeline.runtime.pipe import Pipeline

__all__ = [
    "LATEST",
    "CheckpointFallbackWarning",
    "ConfigMismatch",
    "CorruptCheckpoint",
    "Resumed",
    "latest",
    "load",
    "recorded_config",
    "resume",
    "save",
    "training_state",
]


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
    config: dict[str, Any] | None = None,
    run_id: str | None = None,
) -> Path:
    """Write checkpoint ``step`` of this run into ``folder`` (on every rank); return its folder.

    ``pipe``: the Pipeline (or a whole nn.Module in one process); ``optimizer``
    built from its parameters; ``extra``: any JSON-able value, the same on every
    rank (what ``load`` returns). ``keep``: how many of this run's complete
    checkpoints stay in ``folder`` after the save, this one and the ones written
    last before it (``None``: all); another run's are never removed. ``config``:
    the run's settings (a JSON-able dict, the same on every rank) that ``resume``
    compares. ``run_id``: None continues the run this process resumed or saved
    in ``folder`` (else a new run). ``save(folder, step, training_state(...))``
    is the deprecated form.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step ({step!r}) must be an int >= 0, the number of optimizer steps taken")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(
            f"keep ({keep!r}) must be an int >= 1 (this checkpoint and keep-1 older) or None (all)"
        )
    if run_id is not None and (
        not isinstance(run_id, str) or not run_id or not all(c.isalnum() or c in "-_" for c in run_id)
    ):
        raise ValueError(f"run_id ({run_id!r}) must be a non-empty str of letters, digits, - and _, or None")
    if legacy_state is not None:
        warnings.warn(
            "checkpointing.save(folder, step, training_state(...)) is deprecated and will be removed; call "
            "checkpointing.save(folder, step, pipe=pipe, optimizer=optimizer, lr_scheduler=..., "
            "grad_scaler=..., extra=...), which also saves buffers, param groups, scheduler and scaler",
            FutureWarning,
            stacklevel=2,
        )
        runs.config_text(config)
        return _write(Path(folder), step, legacy_state, keep, config, run_id)
    if pipe is None or not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"save() needs pipe= (a Pipeline or nn.Module) and optimizer= (a torch.optim.Optimizer), got "
            f"pipe={type(pipe).__name__}, optimizer={type(optimizer).__name__}"
        )
    with _call(pipe, "checkpointing.save"):
        text, config_text, flat, error = "", "", {}, None
        try:
            text = state.extra_text(extra)
            config_text = runs.config_text(config)
            if isinstance(pipe, Pipeline):
                pipe.check_values()  # never save a meta model's uninitialised memory
            model = state.model_of(pipe)
            flat = state.collect(
                model, optimizer, lr_scheduler, grad_scaler, text, step, ranks.rank(), ranks.world()
            )
        except (TypeError, ValueError, RuntimeError) as exc:
            error = exc
        texts = ranks.together(error, (text, config_text))
        for i, what in enumerate(("extra", "config")):
            differ = [r for r, t in enumerate(texts) if t[i] != texts[0][i]]
            if differ:
                raise ValueError(
                    f"save() got a different {what} on rank {differ[0]} ({texts[differ[0]][i]}) than on "
                    f"rank 0 ({texts[0][i]}); {what} is saved once for all ranks: pass the same value on "
                    "every rank"
                )
        return _write(Path(folder), step, flat, keep, config, run_id)


def _call(pipe: object, what: str) -> contextlib.AbstractContextManager[None]:
    """A checkpoint of a Pipeline under the NCCL emulation is a call after construction: the world
    group's communicator and pairs its collectives use were made then, or it raises (world.py)."""
    emulated = isinstance(pipe, Pipeline) and pipe.comm is not None and pipe.comm.emulated
    return world.calling(emulated, what)


def _write(
    root: Path,
    step: int,
    flat: dict[str, Any],
    keep: int | None,
    config: dict[str, Any] | None,
    run_id: str | None,
) -> Path:
    marked = {**flat, INTEGRITY: "manifest"}  # tells a lost manifest from a checkpoint made before them
    run = ranks.from_rank0(None, run_id or runs.remembered(root) or runs.new_id())
    runs.remember(root, run)

    def write_into(tmp: Path) -> None:
        _dcp_save(marked, storage_writer=FileSystemWriter(tmp))

    return _folder.write(root, step, keep, write_into, run, config)


@dataclass(frozen=True)
class Resumed:
    """What ``resume`` loaded (path, step, run, extra) and how the configuration differs from the saved."""

    path: Path
    step: int
    run_id: str
    extra: Any
    changes: list[str]  # allowed configuration changes, "key: saved -> current"
    rejected: list[tuple[Path, str]]  # newer checkpoints passed over, and why

    def __str__(self) -> str:
        text = f"resumed run {self.run_id} from {str(self.path)!r} at step {self.step}"
        if self.changes:
            text += " with configuration changes: " + ", ".join(self.changes)
        if self.rejected:
            text += "; rejected " + "; ".join(f"{str(p)!r} ({why})" for p, why in self.rejected)
        return text


def resume(
    folder: str | os.PathLike[str],
    *,
    pipe: Pipeline | nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Stateful | None = None,
    grad_scaler: Stateful | None = None,
    config: dict[str, Any],
    allow_changes: Iterable[str] = (),
) -> Resumed | None:
    """Load the newest sound checkpoint of ``folder`` into the objects (on every rank); None when the
    folder holds no checkpoint (a first start: train from step 0, and ``save`` starts a new run).

    ``config``: the run's settings now; a checkpoint saved with others is a ConfigMismatch listing each
    difference (``key: saved -> current``) unless ``allow_changes`` names the key (or a key above it:
    "plan" allows "plan.balance"), e.g. ``allow_changes={"balance", "dp", "n_stages"}``. A damaged newest
    checkpoint is passed over with a CheckpointFallbackWarning; none sound is a CorruptCheckpoint.
    Later ``save`` calls into ``folder`` continue the run resumed (its id).
    """
    root = Path(folder)
    if is_checkpoint(root):
        raise ValueError(
            f"resume() takes the folder of checkpoints, got one checkpoint {str(root)!r}; pass "
            f"{str(root.parent)!r}, or load() this one"
        )
    if config is None:
        raise TypeError(
            "resume() needs config= (the run's settings, a dict) to compare with the checkpoint's"
        )
    with _call(pipe, "checkpointing.resume"):
        chosen = choose(root)
        if chosen is None:
            return None
        extra, changes = _restore(chosen, pipe, optimizer, lr_scheduler, grad_scaler, config, allow_changes)
    found = chosen.manifest
    step = found.step if found is not None else int(chosen.path.name.rsplit("-", 1)[-1])
    run_id = found.run_id if found is not None else runs.remembered(root) or ""
    return Resumed(chosen.path, step, run_id, extra, changes, chosen.rejected)


def recorded_config(folder: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]] | None:
    """The ``config`` the newest checkpoint in ``folder`` recorded (``save(..., config=...)``), with
    that checkpoint's path; None when the folder holds no checkpoint with a manifest (or none yet:
    a missing folder), or its newest one was saved without ``config``.

    What a restart reads before it builds anything: a plan the run chose (a search whose new profile
    could choose another) is then reused, and the run continues as it began. It reads the manifest
    alone (no collective: any process may call it) and verifies no file; ``resume`` does, may fall
    back past a damaged checkpoint to an older one, and compares the whole config with that one's.
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"recorded_config() takes a folder path (str or Path), got {type(folder).__name__}")
    root = Path(folder)
    if is_checkpoint(root):
        raise ValueError(
            f"recorded_config() takes the folder of checkpoints, got one checkpoint {str(root)!r}; pass "
            f"{str(root.parent)!r}"
        )
    if root.exists() and not root.is_dir():
        raise ValueError(
            f"recorded_config() takes the folder of checkpoints, got the file {str(root)!r}; pass the "
            "folder that save() wrote into"
        )
    for path in candidates(root):  # newest first; one without a readable manifest is passed over
        found = read_manifest(path)
        if isinstance(found, Manifest):
            return None if found.config is None else (path, found.config)
    return None


def load(
    folder: str | os.PathLike[str],
    *legacy_args: Any,
    pipe: Pipeline | nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Stateful | None = None,
    grad_scaler: Stateful | None = None,
    config: dict[str, Any] | None = None,
    allow_changes: Iterable[str] = (),
    **legacy_kwargs: Any,
) -> Any:
    """Restore a checkpoint into the objects given (on every rank); return its ``extra``.

    ``folder``: a folder of checkpoints (its newest sound one is loaded, see
    ``resume``) or one step's folder (loaded if sound, else a CorruptCheckpoint
    naming each damaged file). Pass what was saved: ``optimizer``,
    ``lr_scheduler`` and ``grad_scaler`` freshly built (an optimizer need not
    have stepped), the scheduler after the optimizer; ``optimizer=None`` loads
    the model alone. ``config``: compared as in ``resume`` (None: not compared).
    ``load(path, named_parameters, optimizer, extra_keys)`` is the deprecated form.
    """
    path = Path(folder)
    if legacy_args or legacy_kwargs:
        given = {} if optimizer is None else {"optimizer": optimizer}
        return _load_legacy(_chosen(path).path, legacy_args, {**legacy_kwargs, **given})
    if pipe is None:
        raise TypeError("load() needs pipe= (the Pipeline, or nn.Module, to load into)")
    with _call(pipe, "checkpointing.load"):
        extra, _ = _restore(_chosen(path), pipe, optimizer, lr_scheduler, grad_scaler, config, allow_changes)
    return extra


def _chosen(path: Path) -> Chosen:
    chosen = choose(path)
    if chosen is None:
        raise FileNotFoundError(
            f"no complete checkpoint in {str(path)!r}; pass a folder that save() wrote into, or one "
            "step folder in it (check checkpointing.latest(folder) before loading)"
        )
    return chosen


def _restore(
    chosen: Chosen,
    pipe: Pipeline | nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Stateful | None,
    grad_scaler: Stateful | None,
    config: dict[str, Any] | None,
    allow_changes: Iterable[str],
) -> tuple[Any, list[str]]:
    """Load ``chosen`` into the objects, after comparing ``config``; its extra and the allowed changes."""
    path, model, meta, want, changes, error = chosen.path, nn.Module(), {}, {}, [], None
    try:
        if config is not None:  # checked here: a bad config on one rank is raised on every rank
            runs.config_text(config)
            saved = chosen.manifest.config if chosen.manifest is not None else None
            changes = runs.check(saved, config, allow_changes, repr(str(path)))
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
    if isinstance(pipe, Pipeline):  # a meta model's tensors the checkpoint gave values
        pipe.note_loaded(model.state_dict(keep_vars=True).values())
    if chosen.manifest is not None:  # later saves into this folder continue the run loaded
        runs.remember(path.parent, chosen.manifest.run_id)
    return extra, changes


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
