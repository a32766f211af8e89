"""``Pipeline``'s options: a ``Plan`` or a balance list plus keywords, into one checked configuration.

    # letters: see pipeline/__init__.py (p ranks, v stages per rank, m micro-batches, s stage)

Two ways in, one way out::

    Pipeline(model, plan, loss_fn=f)                     the plan says everything; a keyword
                                                         that contradicts it is a ValueError
    Pipeline(model, [3, 3, 2, 2], loss_fn=f,             the keywords make the plan, with the
             schedule="1f1b", n_microbatches=8)          defaults of ``partition`` (m = p, v = 2
                                                         for interleaved-1f1b, else 1)
    Pipeline(model, [3, 3], loss_fn=f, schedule=sched)   a ``Schedule`` object: run as given,
                                                         checked against the balance and the group

``Options`` is what comes out: the plan (None for a ``Schedule`` object, whose
actions no plan describes), the balance, the schedule to run, the
recomputation mode: one for every stage, or one per stage (``recompute=("always",
"never")``), which ``recompute_of(s)`` reads for stage s, and ``compile``:
torch.compile's keywords for each layer, or None (eager; step/compiled.py). A plan does not
say whether to compile: the same plan runs eager or compiled. The checks against the
process group (``check_group``) and the model (``check_model``) come after, in
``Pipeline``, where both are known.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from pipeline.plan import Plan
from pipeline.runtime.step.compiled import check_compile, for_recompute
from pipeline.runtime.step.recompute import Recompute, check_recompute, mode_of
from pipeline.schedules.schedule import Schedule
from pipeline.schedules.validate import validate

__all__ = ["Options", "check_group", "check_model", "resolve"]


@dataclass(frozen=True)
class Options:
    plan: Plan | None  # None when a Schedule object was given
    balance: list[int]
    schedule: Schedule
    recompute: Recompute  # one mode, or one per stage
    compile: dict[str, Any] | None = None  # torch.compile's keywords per layer; None: eager

    def recompute_of(self, stage: int) -> str:
        """Stage ``stage``'s recomputation mode."""
        return mode_of(self.recompute, stage)


def resolve(
    plan: Plan | Sequence[int],
    *,
    schedule: str | Schedule | None,
    n_microbatches: int | None,
    n_virtual: int | None,
    recompute: Recompute | None,
    checkpoint: str | None,
    compile: object = None,
) -> Options:
    """The plan and schedule that ``Pipeline(model, plan, ...)`` runs; ValueError on any contradiction."""
    recompute = _recompute(recompute, checkpoint)
    compiled = check_compile(compile)
    options = _resolve(plan, schedule, n_microbatches, n_virtual, recompute)
    recomputes = any(options.recompute_of(s) != "never" for s in range(len(options.balance)))
    return dataclasses.replace(options, compile=for_recompute(compiled, recomputes))


def _resolve(
    plan: Plan | Sequence[int],
    schedule: str | Schedule | None,
    n_microbatches: int | None,
    n_virtual: int | None,
    recompute: Recompute | None,
) -> Options:
    for label, value in (("n_microbatches", n_microbatches), ("n_virtual", n_virtual)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{label} ({value!r}) must be an integer >= 1, or omitted for the default")
    if isinstance(plan, Plan):
        return _from_plan(plan, schedule, n_microbatches, n_virtual, recompute)
    balance = _balance(plan)
    if isinstance(schedule, Schedule):
        mode = check_recompute("never" if recompute is None else recompute, schedule.n_stages)
        return _from_schedule(balance, schedule, n_microbatches, n_virtual, mode)
    made = Plan(
        balance=balance,
        schedule="1f1b" if schedule is None else schedule,
        n_microbatches=0 if n_microbatches is None else n_microbatches,  # 0: the plan's default
        n_virtual=0 if n_virtual is None else n_virtual,
        recompute="never" if recompute is None else recompute,
    )
    return Options(made, made.balance, made.build_schedule(), made.recompute)


def _recompute(recompute: Recompute | None, checkpoint: str | None) -> Recompute | None:
    """``recompute=``, or the old ``checkpoint=`` with a FutureWarning."""
    if checkpoint is None:
        return recompute
    warnings.warn(
        "Pipeline(checkpoint=...) is renamed recompute=... (activation recomputation; 'checkpoint' "
        "now only means a training checkpoint on disk); checkpoint= goes in the next release",
        FutureWarning,
        stacklevel=4,  # the caller of Pipeline(...)
    )
    if recompute is not None and recompute != checkpoint:
        raise ValueError(
            f"recompute={recompute!r} and checkpoint={checkpoint!r} disagree; checkpoint= is the old name "
            "of recompute=: pass recompute= alone"
        )
    return checkpoint


def _balance(balance: object) -> list[int]:
    if (
        isinstance(balance, str | bytes)
        or not isinstance(balance, Sequence)
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in balance)
    ):
        raise TypeError(
            f"plan must be a pipeline.Plan or a list of layer counts per stage, got {type(balance).__name__} "
            f"{balance!r}"
        )
    values = list(balance)
    if not values or any(b < 1 for b in values):
        raise ValueError(f"balance {values} must hold at least one stage, each of >= 1 layers")
    return values


def _from_plan(
    plan: Plan, schedule: str | Schedule | None, m: int | None, v: int | None, recompute: Recompute | None
) -> Options:
    name = schedule.name if isinstance(schedule, Schedule) else schedule
    given: list[tuple[str, object, object]] = [
        ("schedule", name, plan.schedule),
        ("n_microbatches", m, plan.n_microbatches),
        ("n_virtual", v, plan.n_virtual),
        ("recompute", _as_given(recompute), plan.recompute),
    ]
    for label, value, planned in given:
        if value is not None and value != planned:
            raise ValueError(
                f"{label} ({value!r}) contradicts the plan's ({planned!r}); omit {label} or make the "
                f"plan with {label}={value!r} (plan.replace({label}={value!r}))"
            )
    if isinstance(schedule, Schedule):  # the plan's own schedule, built by hand: it must be that one
        shape = (schedule.n_stages, schedule.n_ranks, schedule.n_microbatches)
        if shape != (plan.n_stages, plan.n_ranks, plan.n_microbatches):
            raise ValueError(
                f"schedule {schedule.name!r} has {shape[0]} stages on {shape[1]} ranks and {shape[2]} "
                f"micro-batches, but the plan {plan.n_stages} stages on {plan.n_ranks} ranks and "
                f"{plan.n_microbatches} micro-batches; omit schedule= to run the plan's"
            )
        validate(schedule)
        return Options(plan, plan.balance, schedule, plan.recompute)
    return Options(plan, plan.balance, plan.build_schedule(), plan.recompute)


def _as_given(recompute: Recompute | None) -> Recompute | None:
    """A list of modes compares equal to the plan's tuple."""
    return tuple(recompute) if isinstance(recompute, list) else recompute


def _from_schedule(
    balance: list[int], schedule: Schedule, m: int | None, v: int | None, mode: Recompute
) -> Options:
    if len(balance) != schedule.n_stages:
        raise ValueError(
            f"schedule {schedule.name!r} has {schedule.n_stages} stages but balance has {len(balance)}; "
            "build the schedule for these stages or pass one layer count per stage"
        )
    if v is not None and v != schedule.n_virtual:
        raise ValueError(
            f"n_virtual ({v}) does not match the schedule's ({schedule.n_virtual}); "
            f"omit n_virtual or pass {schedule.n_virtual}"
        )
    if m is not None and m != schedule.n_microbatches:
        raise ValueError(
            f"n_microbatches ({m}) does not match the schedule's ({schedule.n_microbatches}); "
            f"omit n_microbatches or pass {schedule.n_microbatches}"
        )
    validate(schedule)
    return Options(None, balance, schedule, mode)


def check_group(options: Options, distributed: bool, world: int) -> None:
    """The schedule's ranks against the process group's: the first thing a newcomer gets wrong."""
    p = options.schedule.n_ranks
    if not distributed and p > 1:
        raise RuntimeError(
            f"this pipeline runs on {p} ranks but torch.distributed is not initialised in this process; "
            f"start {p} ranks with pipeline.launch(fn, {p}, ...) (fn builds the Pipeline on each rank) or "
            f"torchrun --nproc-per-node {p} (then call pipeline.init_distributed() before Pipeline), or "
            "make a plan for 1 rank"
        )
    if p != world:
        what = "plan" if options.plan is not None else f"schedule {options.schedule.name!r}"
        raise ValueError(
            f"the {what} is for {p} ranks ({len(options.balance)} stages, n_virtual "
            f"{options.schedule.n_virtual}) but the process group has {world}; make the plan for {world} "
            f"ranks (e.g. partition(model, {world}, ...)) or start {p} ranks"
        )


def check_model(model: Any, balance: list[int], plan: Plan | None = None) -> nn.Module:
    """``model`` as the plan cuts it, or a TypeError / ValueError saying what to change: an
    nn.Sequential for a balance, any module for a plan ``partition`` made by tracing it."""
    if plan is not None and plan.graph is not None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be the nn.Module the plan was made for, got {type(model).__name__}")
        return model  # checked against the plan's graph when the stages are built (graph_stages.py)
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"Pipeline cuts an nn.Sequential into stages of consecutive layers, got {type(model).__name__}; "
            "wrap the model's layers, in the order they run, in one: nn.Sequential(layer_0, layer_1, ...), "
            "or make the plan with partition(model, n_ranks, sample), which splits any module it can trace"
        )
    if sum(balance) != len(model):
        raise ValueError(
            f"balance {balance} sums to {sum(balance)} layers but the model has {len(model)}; "
            "the layer counts must add up to len(model)"
        )
    return model
