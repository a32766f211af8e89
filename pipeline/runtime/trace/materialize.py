"""Materialise a meta-device model's local stages: real storage, real values, ties kept, nothing left blank.

    # s: stage

``to_empty`` gives meta tensors storage but not values: a parameter or buffer that no
``reset_parameters`` writes (an ``nn.Parameter(torch.ones(n))`` made in ``__init__``, a registered
causal mask) would hold whatever memory it got, silently. ``materialize`` instead::

    1. one new tensor per meta tensor (by identity), put in every place that held it, so a weight
       tied between two modules (or two local stages) stays one tensor
    2. ``reset_parameters()`` (or ``_reset_parameters()``) of every submodule, once each, no grad
    3. ``init_fn(module)`` on each given module, if given
    4. every new tensor that nothing wrote (its version counter never moved and it was not
       replaced) is named in a ValueError, with the ways to give it values; or, with ``unset``
       given, recorded there (id -> name) for weights that will be loaded later
       (``Pipeline.load_pretrained``), which then refuses to step until each has its values

The stages' modules are the model's own (traced.py, or an ``nn.Sequential`` slice), so step 2
runs the model's real ``reset_parameters``; values are a re-initialisation, not a copy of any
other instance of the model (tied copies on other ranks are made equal by ties.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["materialize", "unset_message"]


def materialize(
    modules: Sequence[nn.Module],
    device: torch.device | str,
    init_fn: Callable[[nn.Module], None] | None = None,
    unset: dict[int, str] | None = None,
) -> None:
    """Give every meta parameter and buffer of ``modules`` storage on ``device`` and real values (above);
    with ``unset``, those left without values are recorded there instead of raising."""
    places: dict[int, list[tuple[nn.Module, str, bool]]] = {}  # id -> (owner, name, is parameter)
    subs = list({id(sub): sub for mod in modules for sub in mod.modules()}.values())
    for sub in subs:
        for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, t in table.items():
                if t is not None and t.is_meta:
                    places.setdefault(id(t), []).append((sub, name, is_param))
    if not places:
        return
    made: dict[int, torch.Tensor] = {}
    for key, where in places.items():
        owner, name, is_param = where[0]
        old = owner._parameters[name] if is_param else owner._buffers[name]
        assert old is not None
        fresh = torch.empty_like(old, device=device)
        new: torch.Tensor = nn.Parameter(fresh, requires_grad=old.requires_grad) if is_param else fresh
        for sub, attr, param in where:
            (sub._parameters if param else sub._buffers)[attr] = new  # type: ignore[assignment]
        made[key] = new
    start = {key: t._version for key, t in made.items()}
    with torch.no_grad():
        for sub in subs:
            reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
            if callable(reset):
                reset()
    if init_fn is not None:
        for mod in modules:
            init_fn(mod)
    blank = [  # an empty tensor has no values to miss
        key
        for key, t in made.items()
        if t._version == start[key] and _still_held(places[key], t) and t.numel()
    ]
    if blank and unset is not None:
        unset.update(_names(modules, blank, places))
    elif blank:
        raise ValueError(unset_message(list(_names(modules, blank, places).values())))


def _still_held(where: list[tuple[nn.Module, str, bool]], t: torch.Tensor) -> bool:
    """False once init_fn replaced the tensor (it then has the values init_fn gave it)."""
    sub, name, is_param = where[0]
    return (sub._parameters if is_param else sub._buffers).get(name) is t


def _names(
    modules: Sequence[nn.Module], blank: list[int], places: dict[int, list[tuple[nn.Module, str, bool]]]
) -> dict[int, str]:
    """id of each blank tensor -> "name (a parameter of Class)"."""
    names: dict[int, str] = {}
    for mod in modules:
        for name, t in [
            *mod.named_parameters(remove_duplicate=False),
            *mod.named_buffers(remove_duplicate=False),
        ]:
            names.setdefault(id(t), name)
    out = {}
    for key in blank:
        sub, attr, is_param = places[key][0]
        held = sub._parameters[attr] if is_param else sub._buffers[attr]
        assert held is not None
        kind = "parameter" if is_param else "buffer"
        out[id(held)] = f"{names.get(id(held), attr)} (a {kind} of {type(sub).__name__})"
    return out


def unset_message(items: list[str]) -> str:
    """The error for tensors a meta-device model's materialisation left without values."""
    shown = ", ".join(items[:8]) + (f" and {len(items) - 8} more" if len(items) > 8 else "")
    return (
        f"materialising the meta-device model left {shown} without values: no reset_parameters() writes "
        "it, so it would hold uninitialised memory; give its module a reset_parameters() that sets it "
        "(e.g. nn.init.ones_ for a scale, the mask for a registered buffer), pass init_fn= that sets it, "
        "load it with pipe.load_pretrained(path), or build the model on a real device"
    )
