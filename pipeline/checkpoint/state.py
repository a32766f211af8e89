"""What a checkpoint holds: a flat dict for ``torch.distributed.checkpoint``, and back into the objects.

    # r: rank, s: stage

Each rank contributes what it holds, every key once in the whole checkpoint:

    checkpoint               JSON: format, step, number of ranks (the same on every rank)
    model/<name>             parameters and persistent buffers under the original model's names
                             ("3.weight", "1.running_mean", "1.num_batches_tracked")
    optim/<name>/<key>       the optimizer, per parameter (see optim.py)
    param_group/<name>
    param_groups/<r>
    lr_scheduler/<r>         each rank's scheduler.state_dict()
    grad_scaler/<r>          each rank's GradScaler.state_dict()
    rng/<r>/cpu, rng/<r>/cuda   each rank's torch generators (CUDA's when CUDA is initialised)
    extra                    the caller's JSON text (the same on every rank)

The names come from ``get_model_state_dict`` of one module holding this rank's
stages merged (``model_of``): the model's own names (``blocks.3.fc.weight``),
whether the stages are slices of an ``nn.Sequential`` or traced graph stages,
and however many stages a rank holds (v = 2: stages 0 and 2 on rank 0). A
tensor held under several names (a head tied to the token embedding) is one
entry, under its first name in ``named_parameters`` (``tok.weight``), which is
also the name a traced stage gives it; every rank holding a copy writes the
same entry (dcp keeps one) and loads it, and one process loads it into all of
its names. Loading at another stage count, each rank asks for the names it now
holds and their optimizer entries. Per-rank entries go back to the same rank; a rank the
checkpoint did not have takes rank 0's scheduler and scaler state (the same on
every rank up to the per-group lists) and keeps its generators: with more
ranks than were saved, the random streams (dropout masks) cannot continue
unchanged. A scheduler's per-group lists (``base_lrs``, ``_last_lr``) are
re-derived from the restored param groups (``initial_lr``, ``lr``), which
came back by parameter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from pipeline.checkpoint import optim
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.trace.tracing import first_names, is_constant

__all__ = ["FORMAT", "RECORD", "Stateful", "collect", "extra_text", "model_of", "restore", "targets"]

FORMAT = 2  # the deprecated training_state layout (no RECORD entry) was 1
RECORD, MODEL, EXTRA = "checkpoint", "model/", "extra"
SCHEDULER, SCALER, RNG = "lr_scheduler", "grad_scaler", "rng"


class Stateful(Protocol):
    """An lr scheduler or a GradScaler: anything with ``state_dict`` and ``load_state_dict``."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def model_of(pipe: Pipeline | nn.Module) -> nn.Module:
    """One module holding this rank's parameters and buffers under the original model's names (or
    ``pipe`` itself): its local stages merged (see ``_merge``)."""
    if isinstance(pipe, nn.Module):
        return pipe
    if not isinstance(pipe, Pipeline):
        raise TypeError(f"pipe must be a Pipeline (or an nn.Module), got {type(pipe).__name__}")
    stages = list(pipe.module) if isinstance(pipe.module, nn.ModuleList) else [pipe.module]
    union = _merge(stages)
    mine = {n for n, _ in union.named_parameters()} | {
        n for n, _ in union.named_buffers() if not is_constant(n)
    }
    theirs = {n for n, _ in pipe.named_parameters()} | {n for n, _ in pipe.named_buffers()}
    if mine != theirs:  # the runtime's layout changed under us: never save under other names
        raise RuntimeError(
            f"checkpoint names {sorted(mine ^ theirs)[:5]} differ from pipe.named_parameters()"
        )
    return union


def _merge(stages: list[nn.Module]) -> nn.Module:
    """The local stages as one module tree with their paths (``blocks.2.fc.weight``).

    Two stages of a rank (v > 1) may both hold a path with different objects there: traced stages
    each have their own ``blocks`` container (stage 0 ``blocks.0``, stage 2 ``blocks.2``), and a
    weight tied between them is one Parameter under one name in both. Such a path becomes a fresh
    container holding the direct parameters and buffers of every object there (one Parameter per
    name, else a RuntimeError); a path with one object in all stages keeps that module itself::

        stage 0: tok, blocks{0}, (fresh)       union: tok, blocks{0, 2} (fresh), norm, head
        stage 2: blocks{2}, norm, head         tok, blocks.0, blocks.2, norm, head: the modules
    """
    at: dict[str, list[nn.Module]] = {}
    for stage in stages:
        for path, module in stage.named_modules(remove_duplicate=False):
            same = at.setdefault(path, [])
            if not any(m is module for m in same):
                same.append(module)
    union, whole = nn.Module(), list[str]()
    for path in sorted(at, key=lambda p: (p.count(".") if p else -1, p)):  # parents first
        parent, _, name = path.rpartition(".")
        if not path:
            for root in at[path]:
                _copy_direct(root, union, "")
        elif any(path.startswith(w + ".") for w in whole):
            continue  # inside a module kept whole
        elif len(at[path]) == 1:
            union.get_submodule(parent).add_module(name, at[path][0])
            whole.append(path)
        else:
            into = nn.Module()
            for module in at[path]:
                _copy_direct(module, into, path + ".")
            union.get_submodule(parent).add_module(name, into)
    return union


def _copy_direct(module: nn.Module, into: nn.Module, path: str) -> None:
    """``module``'s own parameters and buffers (not its children's) into ``into``, as it keeps them."""
    for name, param in module._parameters.items():
        have = into._parameters.get(name)
        if have is not None and have is not param:
            raise RuntimeError(f"two local stages hold different parameters named {path}{name}")
        if param is not None:
            into.register_parameter(name, param)
    for name, buf in module._buffers.items():
        held = into._buffers.get(name)
        if held is not None and held is not buf:
            raise RuntimeError(f"two local stages hold different buffers named {path}{name}")
        if buf is not None:
            into.register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)


def extra_text(extra: Any) -> str:
    """``extra`` as JSON text, or a TypeError when it would not come back as it went in."""
    try:
        text = json.dumps(extra, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"extra must be JSON-able (dicts with str keys, lists, str, int, float, bool, None): {exc}; "
            "convert the value first (e.g. str(path), a tensor's .tolist())"
        ) from exc
    if json.loads(text) != extra:
        raise TypeError(
            f"extra {extra!r} would load as {json.loads(text)!r}; use lists for tuples and str dict keys"
        )
    return text


def _rank_key(prefix: str, rank: int) -> str:
    return f"{prefix}/{rank}"


def collect(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Stateful | None,
    grad_scaler: Stateful | None,
    extra: str,
    step: int,
    rank: int,
    world: int,
) -> dict[str, Any]:
    """This rank's entries of the checkpoint (tensors are the live ones: write before changing them)."""
    flat: dict[str, Any] = {RECORD: json.dumps({"format": FORMAT, "step": step, "world_size": world})}
    flat.update({f"{MODEL}{n}": t for n, t in _model_state(model).items()})
    flat.update(optim.flatten(optimizer, _param_names(model), rank))
    if lr_scheduler is not None:
        flat[_rank_key(SCHEDULER, rank)] = (lr_scheduler.state_dict(),)
    if grad_scaler is not None:
        flat[_rank_key(SCALER, rank)] = (grad_scaler.state_dict(),)
    flat[f"{RNG}/{rank}/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        flat[f"{RNG}/{rank}/cuda"] = torch.cuda.get_rng_state()
    flat[EXTRA] = extra
    return flat


def _model_state(model: nn.Module) -> dict[str, Any]:
    """The model's state dict, each tensor once: a tied weight under its first name only."""
    aliases = _aliases(model)
    return {n: t for n, t in get_model_state_dict(model).items() if n not in aliases}


def _aliases(model: nn.Module) -> dict[str, str]:
    """{later name: first name} of each parameter or buffer the model holds under several names
    (``head.weight``: ``tok.weight``): the name a traced stage gives it (tracing.first_names)."""
    return {name: first for name, first in first_names(model).items() if name != first}


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def targets(
    meta: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Stateful | None,
    grad_scaler: Stateful | None,
    rank: int,
    where: str,
) -> dict[str, Any]:
    """What this rank loads (dcp fills it in), or a ValueError saying what does not fit."""
    if RECORD not in meta:
        raise ValueError(
            f"checkpoint {where} was written by the deprecated training_state API; load it with "
            "checkpointing.load(path, named_parameters, optimizer, extra_keys)"
        )
    want: dict[str, Any] = {RECORD: None, EXTRA: None}
    params = _model_state(model)  # the live tensors: dcp loads in place
    missing = [n for n in params if f"{MODEL}{n}" not in meta]
    if missing:
        raise ValueError(
            f"checkpoint {where} lacks {missing[:5]} (of {len(missing)} missing); was it written by a "
            "different model? pass load() a checkpoint of this model"
        )
    wrong = [
        f"{n}: saved {tuple(getattr(meta[f'{MODEL}{n}'], 'size', ()))}, now {tuple(t.shape)}"
        for n, t in params.items()
        if isinstance(t, torch.Tensor)
        and (
            not isinstance(meta[f"{MODEL}{n}"], TensorStorageMetadata)
            or tuple(meta[f"{MODEL}{n}"].size) != tuple(t.shape)
        )
    ]
    if wrong:
        raise ValueError(
            f"checkpoint {where} does not fit this model ({'; '.join(wrong[:3])}); build the model "
            "with the configuration it was saved with before calling load"
        )
    want.update({f"{MODEL}{n}": t for n, t in params.items()})
    if optimizer is not None:
        found, lacking = optim.targets(optimizer, _param_names(model), meta, rank)
        if lacking:
            raise ValueError(
                f"checkpoint {where} has no optimizer state for {lacking[:5]}; was it saved with "
                "optimizer= built from these parameters? pass optimizer=None to load the model alone"
            )
        want.update(found)
    for obj, prefix, arg in ((lr_scheduler, SCHEDULER, "lr_scheduler"), (grad_scaler, SCALER, "grad_scaler")):
        saved = any(k.startswith(f"{prefix}/") for k in meta)
        if obj is not None and not saved:
            raise ValueError(f"checkpoint {where} was saved without {arg}=; pass {arg}=None to load()")
        if obj is None and saved and optimizer is not None:  # resuming training without it is wrong
            raise ValueError(
                f"checkpoint {where} holds {arg} state; pass {arg}= to load() so that training resumes "
                "with it (or optimizer=None to load the model alone)"
            )
        if obj is not None:
            own = _rank_key(prefix, rank)
            want[own if own in meta else _rank_key(prefix, 0)] = None
    for device in ("cpu", "cuda"):
        key = f"{RNG}/{rank}/{device}"
        if key in meta and (device == "cpu" or torch.cuda.is_available()):
            size = tuple(meta[key].size)  # both generators' states are CPU byte tensors
            want[key] = torch.empty(size, dtype=torch.uint8, device="cpu")
    return want


def restore(
    loaded: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Stateful | None,
    grad_scaler: Stateful | None,
    rank: int,
) -> Any:
    """Put ``loaded`` (``targets`` filled in) into the objects; return the extra."""
    record = json.loads(loaded[RECORD])
    if record.get("format") != FORMAT:
        raise ValueError(
            f"checkpoint format {record.get('format')!r} is not {FORMAT}; this stagewise reads {FORMAT}"
        )
    entries = {k[len(MODEL) :]: v for k, v in loaded.items() if k.startswith(MODEL)}
    entries.update({alias: entries[name] for alias, name in _aliases(model).items() if name in entries})
    set_model_state_dict(model, entries)
    if optimizer is not None:
        optim.restore(optimizer, _param_names(model), loaded, rank)
    for obj, prefix in ((lr_scheduler, SCHEDULER), (grad_scaler, SCALER)):
        if obj is not None:
            own = _rank_key(prefix, rank)
            (state,) = loaded[own] if own in loaded else loaded[_rank_key(prefix, 0)]
            obj.load_state_dict(state)
            if prefix == SCHEDULER and optimizer is not None:
                _rederive_group_lists(obj, optimizer)
    if f"{RNG}/{rank}/cpu" in loaded:
        torch.set_rng_state(loaded[f"{RNG}/{rank}/cpu"])
    if f"{RNG}/{rank}/cuda" in loaded:
        torch.cuda.set_rng_state(loaded[f"{RNG}/{rank}/cuda"])
    return json.loads(loaded[EXTRA])


def _rederive_group_lists(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """The scheduler's per-group lists from the restored groups: its saved lists follow the saving
    rank's group order, which another rank, another stage count or another build may not share."""
    groups = optimizer.param_groups
    if hasattr(scheduler, "base_lrs") and all("initial_lr" in g for g in groups):
        scheduler.base_lrs = [g["initial_lr"] for g in groups]
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [g["lr"] for g in groups]
