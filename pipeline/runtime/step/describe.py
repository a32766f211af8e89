"""Describe: a call's micro-batches as signatures every rank agrees on, and each stage's for them.

    # s: stage, i: micro-batch, r: this rank

The second move of a step's data (prepare.py: the four). Rank 0 puts its micro-batches' signatures
(and a variable-length step's lengths) in the step header; every rank reads it, checks that it runs
the same call under the same autocast state, and sets up its stages' input and output signatures for
the signatures not seen before (metadata.py: the protocol; fake tensors, or a shape rule per stage for
a variable-length run), which size every receive buffer of the step. Shapes only: no tensor moves,
so a bad batch fails here, on every rank, before anything is copied or sent::

    Prepared --header (rank 0 sets, the others read)--> micro-batch signatures, extra words
             --set up once per new signature----------> stages' in/out signatures -> message specs
             --the targets' rows against the header----> Described (the rows, what each weighs)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.runtime.comm import emulation
from pipeline.runtime.comm.p2p import NCCL_DTYPES, Comm
from pipeline.runtime.inputs.microbatch import Signature, batch_rows, signature
from pipeline.runtime.step.metadata import (
    Signatures,
    check_sendable,
    derive_signatures,
    exchange_header,
    exchange_rules,
    set_specs,
)
from pipeline.runtime.step.prepare import Prepared
from pipeline.runtime.step.program import Msg
from pipeline.runtime.step.stage import StageRuntime
from pipeline.runtime.trace.shape_rules import ShapeRule
from pipeline.schedules.actions import Action
from pipeline.schedules.schedule import Schedule

__all__ = ["Described", "Describer"]


@dataclass(frozen=True)
class Described:
    """What every rank knows of the call once described: each micro-batch's signature (stage 0's
    input) and rows, what each weighs in the loss (its rows, or a variable-length step's target
    tokens), and the words rank 0 added to the header."""

    micro: tuple[Signature, ...]
    sizes: list[int]
    units: list[int]
    extra: tuple[int, ...]


class Describer:
    """Rank ``rank``'s descriptions for one executor's program (its messages, ``msgs``, take their
    specs from here); the signatures set up are kept per autocast state for the run."""

    def __init__(
        self,
        sched: Schedule,
        rank: int,
        stages: dict[int, StageRuntime],
        comm: Comm | None,
        device: torch.device,
        key_prefix: str,
        msgs: dict[Action, Msg],
    ) -> None:
        self.sched, self.rank, self.stages, self.comm, self.device = sched, rank, stages, comm, device
        self.key_prefix, self.msgs = key_prefix, msgs
        self.nccl = comm is not None and comm.nccl
        self.emulated = comm is not None and comm.emulated
        # signatures: per autocast state, per local stage, per micro-batch signature (set up once each)
        self._input_key: tuple[tuple[Signature, ...], int] | None = None
        self._version = 0
        self._derived: dict[int, tuple[Signatures, Signatures]] = {}
        self.micro: tuple[Signature, ...] = ()  # the last call's micro-batch signatures
        self.in_sig: Signatures = {}  # per local stage, per micro-batch signature, this autocast state
        self.out_sig: Signatures = {}
        # a variable-length run meets new shapes every step: each stage's shape rule, per autocast
        # state, computes their signatures without fake tensors or messages (shape_rules.py)
        self.shape_rules = False
        self.one_row = False  # every micro-batch is one row (rows of documents): rules for one row
        self._rules: dict[int, dict[int, ShapeRule]] = {}
        self.fake_derivations = 0  # micro-batch signatures set up stage by stage (fake tensors or their memo)

    def describe(self, prepared: Prepared) -> Described:
        """The call's description (see the module docstring); raises on every rank alike for a batch
        the ranks disagree on."""
        with emulation.strict_devices(self.emulated):
            mine = [signature(x) for x in prepared.xs] if prepared.xs else None
            micro, mode, extra = exchange_header(
                self.comm, self.rank, self.sched.n_ranks, self.device, mine, prepared.extra
            )
            if (micro, mode) != self._input_key:  # the autocast state changes the dtypes between stages too
                self._setup(micro, mode)
                self._input_key = (micro, mode)
            if prepared.check is not None:
                prepared.check(extra)
            sizes = [sig[0][0][0] for sig in micro]
            _check_targets(prepared.ys, sizes)
            self.micro = micro
            return Described(micro, sizes, prepared.units if prepared.units is not None else sizes, extra)

    def _setup(self, micro: tuple[Signature, ...], mode: int) -> None:
        """Every local stage's input and output signatures for the micro-batch signatures not seen
        before under this autocast state; the messages' specs for this step's."""
        self._version += 1
        self.in_sig, self.out_sig = self._derived.setdefault(mode, ({}, {}))
        key = f"{self.key_prefix}/sig{self._version}"
        sched, stages, comm = self.sched, self.stages, self.comm
        rules = self._rules.get(mode)
        known = list(next(iter(self.in_sig.values()), {}))  # set up at earlier steps: the same everywhere
        if self.shape_rules and rules is None and known and any(sig not in known for sig in micro):
            # new shapes after the first step's: from here on rules pay for their trace
            at = f"{self.key_prefix}/rules{self._version}"
            made = exchange_rules(known, self.in_sig, stages, sched, comm, at, self.one_row)
            if made is not None:
                self._rules[mode] = rules = made
        self.fake_derivations += derive_signatures(
            micro, stages, sched, self.rank, comm, key, self.in_sig, self.out_sig, rules
        )
        set_specs(self.msgs, self.in_sig, self.out_sig, micro)
        if self.nccl:
            check_sendable(self.msgs, NCCL_DTYPES, "NCCL")


def _check_targets(targets: Sequence[Any], sizes: list[int]) -> None:
    """On the last stage's rank: the targets have the inputs' rows (the header's), split alike."""
    if not targets or targets[0] is None:
        return
    got = [batch_rows(y, what="targets") for y in targets]
    if got != sizes:
        raise ValueError(
            f"the targets have {sum(got)} rows but the inputs (on stage 0's rank) {sum(sizes)}; "
            "pass the targets of the same batch as the inputs"
        )
