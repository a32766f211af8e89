"""A rank's stages from a plan, for any model: a traced model's graph stages, or a Sequential's slices.

    # p: ranks, k: stages, s: stage, r: rank

``partition`` records in a traced model's plan how it traced it (``plan.graph``, a ``TracedGraph``:
method, fingerprint, the sample's shapes and dtypes, the layers' names and the stages they were
grouped for). Every rank then::

    model (real or meta) --trace(zeros of the sample's shapes, on the model's device)--> graph
        --layers grouped for the plan's stages (plan.graph.stages)
        --fingerprint == the plan's?--> no: ValueError naming the first layer that differs
        --stage_specs(balance)--> a holder per stage (the model's own modules, nothing copied)
        --find_ties(all k holders)--> ties (the same on every rank)
        --build this rank's stages--> materialize them together (meta) or move them to ``device``

Tracing a meta model costs no memory, and only this rank's stages are materialised, all in one
call, so a weight tied between two of its stages stays one tensor. A process that builds several
Pipelines of one model traces it once: the trace is kept while the model lives, for as long as
its device, the sample's shapes and its module objects stay the same (a replaced submodule is
traced again). An ``nn.Sequential`` plan
slices the model as before (``plan.split``) and finds its ties the same way.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipeline.plan import Plan, TracedGraph
from pipeline.runtime.trace.materialize import materialize
from pipeline.runtime.trace.ties import Tie, find_ties
from pipeline.runtime.trace.traced import build, holder, stage_specs
from pipeline.runtime.trace.tracing import Traced, trace

__all__ = ["plan_stages", "traced_for_plan"]

# the last trace of each live model, for the same device, sample and module objects: a process
# that builds several Pipelines of one model traces it once (the entry goes with the model)
_traces: weakref.WeakKeyDictionary[nn.Module, tuple[Any, Traced]] = weakref.WeakKeyDictionary()


def plan_stages(
    model: nn.Module,
    plan: Plan,
    local: Sequence[int],
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None = None,
    unset: dict[int, str] | None = None,
) -> tuple[dict[int, nn.Module], list[Tie]]:
    """This rank's stage modules (``local``: stage indices) on ``device``, and every tie of the plan;
    ``unset``: see ``materialize``."""
    if plan.graph is None:
        if not isinstance(model, nn.Sequential):
            raise ValueError(
                f"this plan splits an nn.Sequential of {plan.n_layers} layers, but the model is a "
                f"{type(model).__name__}; make the plan for this model with partition(model, n_ranks, sample)"
            )
        every: list[nn.Module] = list(plan.split(model))
        mine = {s: every[s] for s in local}
    else:
        traced = traced_for_plan(model, plan)
        specs = stage_specs(traced, plan.balance)
        every = [
            holder(traced.root, {t for at in spec.layers for t in traced.layers[at].params}, traced.constants)
            for spec in specs
        ]
        mine = {s: build(traced, specs[s], every[s], device) for s in local}
    ties = find_ties(every)
    modules = list(mine.values())
    if any(t.is_meta for mod in modules for t in itertools.chain(mod.parameters(), mod.buffers())):
        materialize(modules, device, init_fn, unset)
    for mod in modules:
        mod.to(device)
    return mine, ties


def traced_for_plan(model: nn.Module, plan: Plan) -> Traced:
    """``model`` traced as ``partition`` traced it for ``plan``; a ValueError if it is another model."""
    record = plan.graph
    if record is None:
        raise ValueError(
            f"this plan (balance {plan.balance}) records no traced graph: it splits an nn.Sequential; make "
            "the plan for this model with partition(model, n_ranks, sample)"
        )
    where = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
    sample = tuple(
        torch.zeros(shape, dtype=getattr(torch, dtype), device=where) for shape, dtype in record.sample
    )
    modules = tuple((name, id(sub)) for name, sub in model.named_modules())
    key = (str(where), repr(record.sample), record.stages, modules)
    cached = _traces.get(model)
    if cached is not None and cached[0] == key:
        traced = dataclasses.replace(cached[1], root=model)
    else:
        traced = trace(model, sample if len(sample) > 1 else sample[0], stages=record.stages)
        _traces[model] = (key, dataclasses.replace(traced, root=nn.Module()))  # not the model itself
    if traced.fingerprint != record.fingerprint:
        raise ValueError(_another_model(model, record, traced))
    if len(traced.layers) != plan.n_layers:
        raise ValueError(
            f"the plan's balance {plan.balance} covers {plan.n_layers} layers but the traced model has "
            f"{len(traced.layers)}; make the plan again with partition(model, ...)"
        )
    return traced


def _another_model(model: nn.Module, record: TracedGraph, traced: Traced) -> str:
    theirs = record.layers
    ours = [layer.name for layer in traced.layers]
    differ = next((at for at, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), None)
    if differ is not None:
        kind = type(model).__name__
        what = f"layer {differ} is {ours[differ]} in this {kind} but {theirs[differ]} in the plan"
    elif len(theirs) != len(ours):
        what = f"this {type(model).__name__} has {len(ours)} layers, the plan's model {len(theirs)}"
    else:
        what = "the layers have the same names but their calls differ (the code or a size changed)"
    return (
        f"this plan was made for another model ({what}; fingerprint {record.fingerprint} in the plan, "
        f"{traced.fingerprint} here); make the plan for this model with partition(model, n_ranks, sample)"
    )
