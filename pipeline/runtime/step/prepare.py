"""Prepare: a call's batch as this rank's micro-batches, on the host.

    # m: micro-batches, i: a micro-batch, r: this rank

The first of the four moves of a step's data, each one module's, each handing the next a value::

    prepare   (here)         inputs, targets -> Prepared: split into m (microbatch.py) or packed
                             by length (varlen.py: padded, grouped, weighed by target tokens)
    describe  (describe.py)  Prepared -> Described: the header every rank reads, each stage's
                             signatures for the micro-batches' shapes
    place     (place.py)     Prepared -> Placed: the micro-batches on the device (copied on the copy
                             stream, or the copy a prefetch started)
    run       (executor.py)  Described, Placed -> the program

Only the ranks that hold stage 0 (inputs) or the last stage (targets) have anything to prepare; a
rank that needs a batch and got None is told which, and why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.runtime.inputs.microbatch import Batch, split
from pipeline.runtime.inputs.varlen import (
    Packed,
    StepCosts,
    VarLen,
    is_ragged,
    lengths_of,
    pad,
    plan_step,
    positions,
    unpad,
)
from pipeline.schedules.schedule import Schedule

__all__ = ["Inputs", "Prepared", "Preparer"]

Inputs = Batch | list[torch.Tensor]  # a batch, or a variable-length step's sequences (varlen.py)


@dataclass
class Prepared:
    """A call's micro-batches on this rank, on the host: ``xs`` (stage 0's rank), ``ys`` (the last
    stage's); a variable-length step's header words, loss units and check of the header; and the
    batches as given (``given``: "inputs" / "targets" -> the caller's object), which a prefetched
    copy is matched against."""

    xs: list[Batch]
    ys: list[Any]
    extra: tuple[int, ...] = ()
    units: list[int] | None = None
    check: Callable[[tuple[int, ...]], None] | None = None
    given: dict[str, Any] = field(default_factory=dict)


def _sequences(value: Any, what: str, method: str) -> None:
    if not is_ragged(value):
        raise ValueError(
            f"{method}() got a {type(value).__name__} for {what}, but this Pipeline packs variable-length "
            "steps (varlen=VarLen(...)): pass a list of sequences, one tensor each, its length first "
            "(the targets: one per input sequence, of its length), or (padded, lengths)"
        )


def _check_lengths(mine: Sequence[int], header: tuple[int, ...]) -> None:
    """On the last stage's rank: its targets' lengths are the samples' (rank 0's, in the header)."""
    if not header:
        raise ValueError(
            "the targets here are a list of sequences but rank 0 gave a batch tensor for the inputs; "
            "give both as lists (a variable-length step) or both as tensors"
        )
    if tuple(mine) != header:
        bad = next((j for j, (a, b) in enumerate(zip(mine, header, strict=False)) if a != b), None)
        where = (
            f"sequence {bad} has {header[bad]} input tokens but {mine[bad]} target tokens"
            if bad is not None
            else f"{len(header)} input sequences but {len(mine)} target sequences"
        )
        raise ValueError(
            f"the targets do not match the inputs on rank 0: {where}; pass each sequence's targets "
            "(of its length) in the same order"
        )


class Preparer:
    """Rank ``rank``'s preparation of its calls' batches under ``schedule`` (see the module docstring)."""

    def __init__(self, schedule: Schedule, rank: int, needs_inputs: bool, needs_targets: bool) -> None:
        self.schedule, self.rank = schedule, rank
        self.needs_inputs, self.needs_targets = needs_inputs, needs_targets
        self.last = schedule.n_stages - 1
        # variable-length steps (varlen.py): the packing options, each compute's cost and the memory limit
        self.varlen: tuple[VarLen, StepCosts] | None = None
        self.last_packing: Packed | None = None  # the last call's, where this rank packed one

    def prepare(
        self, inputs: Inputs | None, targets: Any, method: str, want_targets: bool = True
    ) -> Prepared:
        """The batch split into micro-batches (views of it); a list of sequences packed instead."""
        if self.varlen is not None:
            return self._packed(inputs, targets, method, want_targets)
        m = self.schedule.n_microbatches
        out = Prepared([], [])
        if self.needs_inputs:
            if is_ragged(inputs):
                raise ValueError(
                    f"{method}() got a list for inputs; a list of sequences of different lengths needs a "
                    "Pipeline built with varlen=VarLen(token_budget=...); else pass a batch tensor"
                )
            out.given["inputs"] = x = self._given(inputs, "inputs", method)
            out.xs = split(x, m, what="inputs")
        if self.needs_targets and want_targets:
            out.given["targets"] = y = self._given(targets, "targets", method)
            out.ys = split(y, m, what="targets")
        return out

    def _packed(self, inputs: Any, targets: Any, method: str, want_targets: bool) -> Prepared:
        """A variable-length step (varlen.py): rank 0 packs and orders its samples by their lengths,
        which the header carries; the last stage's rank packs its targets alike, checks their lengths
        against the header's, and weighs each micro-batch's loss by its target tokens."""
        assert self.varlen is not None
        opts, costs = self.varlen
        out = Prepared([], [])
        lengths: list[int] | None = None
        self.last_packing = None
        if self.needs_inputs:
            inputs = unpad(self._given(inputs, "inputs", method), "inputs")
            _sequences(inputs, "inputs", method)
            lengths = lengths_of(inputs, "inputs", opts)
            self.last_packing = plan_step(lengths, self.schedule, opts, costs)
            padded = pad(inputs, self.last_packing, opts.pad_id)
            out.xs = list(padded)
            if opts.documents:  # a model that takes documents declares that it takes (tokens, position ids)
                out.xs = list(zip(padded, positions(self.last_packing, inputs[0].device), strict=True))
            out.extra = tuple(lengths)
        if self.needs_targets and want_targets:
            targets = unpad(self._given(targets, "targets", method), "targets")
            _sequences(targets, "targets", method)
            mine = lengths_of(targets, "targets", opts)
            if lengths is None or mine != lengths:  # packed alike from the same lengths, else refused
                self.last_packing = plan_step(mine, self.schedule, opts, costs)
            padded = pad(targets, self.last_packing, opts.ignore_index)  # type: ignore[arg-type]
            # target sequences on the host: no sync (on a device, one for the step)
            out.units = torch.stack([(y != opts.ignore_index).sum() for y in padded]).tolist()
            empty = [i for i, n in enumerate(out.units) if n == 0]
            if empty:
                groups = [list(self.last_packing.groups[i]) for i in empty]  # type: ignore[union-attr]
                raise ValueError(
                    f"micro-batches {empty} (sequences {groups}) have no target token that is not "
                    f"ignore_index ({opts.ignore_index}): their mean loss is undefined; give every "
                    "sequence at least one target token"
                )
            out.ys = list(padded)
            out.check = functools.partial(_check_lengths, mine)
        return out

    def _given(self, value: Any, slot: str, method: str) -> Any:
        """``value``, the call's "inputs" or "targets", refused where this rank needs it and it is None."""
        if value is None:
            fix = {
                "inputs": f"stage 0 but {method}() got no inputs; pass the batch on this rank "
                "(pipe.needs_inputs is True here)",
                "targets": f"the last stage ({self.last}) but {method}() got no targets; pass targets=... "
                "on this rank (the loss is computed there; pipe.needs_targets is True here)",
            }
            raise ValueError(f"rank {self.rank} holds {fix[slot]}")
        return value
