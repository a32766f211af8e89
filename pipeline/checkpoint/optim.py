"""The optimizer's state and hyperparameters, saved per parameter name, so that they re-shard.

    # r: rank, s: stage

``optimizer.state_dict()`` numbers the parameters 0, 1, ... in the order of
this rank's param groups and keeps the hyperparameters once per group: both
are per rank and mean nothing at another stage count. So every entry is saved
under the name of its parameter in the original model:

    optim/<name>/<key>     its state (AdamW: step, exp_avg, exp_avg_sq)
    param_group/<name>     the hyperparameters of the group it was in: every key
                           but "params" and "param_names" (lr, betas, weight_decay,
                           LambdaLR's initial_lr, ...)

and on load each group of the optimizer takes its hyperparameters from the
saved ones of its own parameters, whichever rank saved them:

    saved at 4 stages                      loaded at 2 stages, rank 0
    r0 group 0 [0.weight]  lr .1 wd .1     group 0 [0.weight, 3.weight] <- lr .1 wd .1 (agreed)
    r0 group 1 [0.bias]    lr .1 wd 0      group 1 [0.bias, 3.bias]     <- lr .1 wd 0  (agreed)
    r1 group 0 [3.weight]  lr .1 wd .1
    r1 group 1 [3.bias]    lr .1 wd 0

Parameters of one group that were saved with different hyperparameters (the
groups were formed differently) are an error naming two of them. Saved keys
the group lacks are added (a scheduler built after the load finds
``initial_lr``); keys the checkpoint lacks keep their values. A group can be
empty on a rank (weight decay for matrices only, and a stage of norms): each
rank also saves its groups' values by index,

    param_groups/<r>       [group 0's values, group 1's, ...]

and an empty group takes the values of the group of its index that this rank
saved, or rank 0's when the checkpoint has fewer ranks.

This is the layout of ``torch.distributed.checkpoint.state_dict`` with
``flatten_optimizer_state_dict=True`` (made for pipeline parallelism), written
here because ``get_optimizer_state_dict`` takes a zero-lr optimizer step to
create state for an optimizer that has none: a checkpoint taken before the
first step would then resume with Adam's step count at 1, not 0.

ZeRO-1 (``torch.distributed.optim.ZeroRedundancyOptimizer`` over the
pipeline's "dp" group) keeps each parameter's state on one replica only, in
its local optimizer (``.optim``, over this rank's shard). Each rank saves its
shard's entries, so the replicas together save every parameter once, in the
same layout as a plain optimizer: a checkpoint of either loads into the other,
and at another dp (the shards then differ) each rank asks for its own shard's
names. The hyperparameters of every group of the wrapper, whose groups hold all
parameters, are restored too and passed on to the local optimizer.

Sharded and split parameters (``plan.shard`` > 1: FSDP2's DTensors over "dp_shard"; ``plan.tp``
> 1: a parallelize_fn's over "tp"). AdamW keeps a DTensor parameter's state as DTensors of its
placements; dcp saves each by name as the one global tensor it is (every rank its shard), so the
entries are those of a plain optimizer and the checkpoint records nothing of the layout. On load a
state tensor of the parameter's shape is asked for laid out as the parameter now is (``_target``:
``empty_like``, the same mesh and placements), so dcp re-shards it and each rank reads its own
slice; at a layout without DTensors it is a plain tensor as before::

    saved at (pp=2, shard=2)                   loaded at (pp=2, tp=2), tp rank 1
    optim/0.0.weight/exp_avg  (12, 6)          DTensor Shard(0) over "tp": rows 6..11 read
      rank 0 rows 0..5, rank 2 rows 6..11      (a plain tensor there would not step: AdamW
                                               refuses DTensor parameters with plain state)

Tensor values are dcp tensors; any other value (a number, None, a dict) is
stored whole inside a 1-tuple, since dcp would split a dict into other keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

__all__ = ["flatten", "restore", "targets"]

STATE, GROUP, GROUPS = "optim/", "param_group/", "param_groups/"
_NOT_HYPER = ("params", "param_names")  # per group, not per parameter: never saved nor loaded


def _name_of(names: Mapping[int, str], p: torch.Tensor, g: int, i: int) -> str:
    name = names.get(id(p))
    if name is None:
        raise ValueError(
            f"optimizer.param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)}) is not a parameter of "
            "pipe on this rank; build the optimizer from pipe.parameters() (or pipe.named_parameters())"
        )
    return name


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


def _local(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: ZeRO's local one (over its shard), else ``optimizer``.

    ZeRO passes the wrapper's hyperparameters on to the local groups only when it steps, so a
    scheduler's change since is passed on here first (as ZeRO's step would).
    """
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    for group, shard in zip(optimizer.param_groups, optimizer.optim.param_groups, strict=True):
        shard.update(_hyper(group))
    local: torch.optim.Optimizer = optimizer.optim
    return local


def flatten(optimizer: torch.optim.Optimizer, names: Mapping[int, str], rank: int) -> dict[str, Any]:
    """``optimizer``'s state and hyperparameters under parameter names (``names``: id(param) -> name);
    under ZeRO, this rank's shard's."""
    optimizer = _local(optimizer)
    flat: dict[str, Any] = {f"{GROUPS}{rank}": ([_hyper(g) for g in optimizer.param_groups],)}
    for g, group in enumerate(optimizer.param_groups):
        hyper = _hyper(group)
        for i, p in enumerate(group["params"]):
            name = _name_of(names, p, g, i)
            flat[f"{GROUP}{name}"] = (hyper,)
            for key, value in optimizer.state.get(p, {}).items():
                flat[f"{STATE}{name}/{key}"] = value if isinstance(value, torch.Tensor) else (value,)
    return flat


def targets(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], meta: Mapping[str, Any], rank: int
) -> tuple[dict[str, Any], list[str]]:
    """What to load for ``optimizer`` (``meta``: the checkpoint's entries), and the names it lacks."""
    want, missing = _targets(_local(optimizer), names, meta, rank)
    if isinstance(optimizer, ZeroRedundancyOptimizer):  # every group's hyperparameters, of all parameters
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = _name_of(names, p, g, i)
                if f"{GROUP}{name}" in meta:
                    want[f"{GROUP}{name}"] = None
                elif name not in missing:
                    missing.append(name)
    return want, missing


def _targets(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], meta: Mapping[str, Any], rank: int
) -> tuple[dict[str, Any], list[str]]:
    saved: dict[str, list[str]] = {}
    for key in meta:
        if key.startswith(STATE):
            name, _, _ = key[len(STATE) :].rpartition("/")
            saved.setdefault(name, []).append(key)
    own = f"{GROUPS}{rank}"
    want: dict[str, Any] = {own if own in meta else f"{GROUPS}0": None}
    missing: list[str] = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            name = _name_of(names, p, g, i)
            if f"{GROUP}{name}" not in meta:
                missing.append(name)
                continue
            want[f"{GROUP}{name}"] = None  # dcp puts the stored object here
            for key in saved.get(name, []):
                item = meta[key]
                want[key] = _target(item, p) if isinstance(item, TensorStorageMetadata) else None
    return want, missing


def _target(item: TensorStorageMetadata, p: torch.Tensor) -> torch.Tensor:
    """Where dcp loads a saved state tensor of parameter ``p``: one of ``p``'s shape is laid out as
    ``p`` (a DTensor's local shard only, so each rank reads its slice), on its device; another
    (Adam's scalar step) a CPU tensor."""
    if tuple(item.size) != tuple(p.shape):
        return torch.empty(tuple(item.size), dtype=item.properties.dtype, device="cpu")
    if isinstance(p, DTensor):  # the same mesh and placements: the saved tensor re-sharded by dcp
        return torch.empty_like(p.detach(), dtype=item.properties.dtype)
    return torch.empty(tuple(item.size), dtype=item.properties.dtype, device=p.device)


def restore(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], loaded: Mapping[str, Any], rank: int
) -> None:
    """Load ``loaded`` (``targets`` filled in by dcp) into ``optimizer``: state and param groups."""
    local = _local(optimizer)
    own = f"{GROUPS}{rank}"
    (by_index,) = loaded[own] if own in loaded else loaded[f"{GROUPS}0"]
    current = local.state_dict()  # its param_groups hold the parameters' indices
    state, groups = _merged(local, current["param_groups"], names, loaded, by_index)
    local.load_state_dict({"state": state, "param_groups": groups})
    if local is not optimizer:  # ZeRO: the wrapper's groups (all parameters), then the local ones from them
        _, full = _merged(optimizer, optimizer.param_groups, names, loaded, by_index)
        for group, values in zip(optimizer.param_groups, full, strict=True):
            group.update(_hyper(values))
        for group, shard in zip(optimizer.param_groups, local.param_groups, strict=True):
            shard.update(_hyper(group))


def _merged(
    optimizer: torch.optim.Optimizer,
    current: list[dict[str, Any]],
    names: Mapping[int, str],
    loaded: Mapping[str, Any],
    by_index: list[dict[str, Any]],
) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """The state by parameter index and the param groups ``optimizer`` loads (``current``: its groups
    as ``state_dict`` gives them, parameters by index)."""
    by_name: dict[str, dict[str, Any]] = {}
    for key, value in loaded.items():
        if key.startswith(STATE):
            name, _, item = key[len(STATE) :].rpartition("/")
            by_name.setdefault(name, {})[item] = value if isinstance(value, torch.Tensor) else value[0]
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for g, (group, indexed) in enumerate(zip(optimizer.param_groups, current, strict=True)):
        merged = dict(indexed)
        first: tuple[str, dict[str, Any]] | None = None
        for i, p in enumerate(group["params"]):
            name = _name_of(names, p, g, i)
            (hyper,) = loaded[f"{GROUP}{name}"]
            if first is None:
                first = (name, hyper)
                merged.update(_hyper(hyper))
            else:
                _check_same_group(g, first, (name, hyper))
            if name in by_name:
                state[indexed["params"][i]] = by_name[name]
        if first is None and g < len(by_index):  # no parameters here: the values saved for this index
            merged.update(_hyper(by_index[g]))
        groups.append(merged)
    return state, groups


def _check_same_group(g: int, a: tuple[str, dict[str, Any]], b: tuple[str, dict[str, Any]]) -> None:
    (name_a, hyper_a), (name_b, hyper_b) = a, b
    for key in sorted(set(hyper_a) | set(hyper_b)):
        if key in _NOT_HYPER:
            continue
        va, vb = hyper_a.get(key), hyper_b.get(key)
        same = (
            torch.equal(va, vb) if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) else va == vb
        )
        if not same:
            raise ValueError(
                f"optimizer.param_groups[{g}] holds {name_a!r} and {name_b!r}, saved with {key}={va!r} and "
                f"{key}={vb!r}: the checkpoint's param groups were formed differently; build the "
                "optimizer's param groups by the rule used when it was saved"
            )
