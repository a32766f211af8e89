"""One rank's calls over a batch: the step, and the forward-only passes (evaluate, predict).

    # m: micro-batches, i: a micro-batch, r: this rank

``Pipeline`` is the facade (it builds the parts, checks the arguments, publishes a failure,
measures memory); a ``StepRunner`` does the work of each call, in this order::

    step       batch -> device (a prefetched copy if it is the one prefetched) -> m micro-batches
               -> the next call's copy started -> tied grads put aside, replicas' buckets armed
               -> the executor runs the program (computes, messages, reductions started)
               -> the program's tail (``finish``): reductions ended, tied grads summed, the loss
    evaluate   the same batch handling, stages in eval mode and autograd off, the forward-only
    predict    schedule's program, its tail (the loss), the outputs to the ranks that ask

The loss that ``finish`` returns is the batch's mean on every rank: each micro-batch's loss weighted
by its rows on the last stage's rank, broadcast over the pipeline, averaged over the replicas. It
stays on the device until ``finish``'s last line reads it: the call's one host synchronisation
(``HOST_SYNC``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.runtime.comm.p2p import Comm
from pipeline.runtime.comm.stream import from_host
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
from pipeline.runtime.replicas.replicas import Replicas
from pipeline.runtime.step.executor import Executor, Prefetched
from pipeline.runtime.step.outputs import check_dst, share_outputs
from pipeline.runtime.step.stage import StageRuntime
from pipeline.runtime.trace.ties import TiedGrads
from pipeline.schedules.program import Collective, Program, ReduceWait
from pipeline.schedules.schedule import Schedule, forward_only

__all__ = ["HOST_SYNC", "Inputs", "Prepared", "StepRunner", "host_sync_site"]

Inputs = Batch | list[torch.Tensor]  # a batch, or a variable-length step's sequences (varlen.py)


@dataclass
class Prepared:
    """A call's micro-batches on this rank: ``xs`` (stage 0's rank), ``ys`` (the last stage's);
    a variable-length step's header words, loss units and check of the header (see ``Executor.run``)."""

    xs: list[Batch]
    ys: list[Any]
    extra: tuple[int, ...] = ()
    units: list[int] | None = None
    check: Callable[[tuple[int, ...]], None] | None = None


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


class StepRunner:
    """Rank ``rank``'s step, evaluate and predict over ``stages`` (see the module docstring)."""

    def __init__(
        self,
        schedule: Schedule,
        program: Program,
        rank: int,
        stages: dict[int, StageRuntime],
        modules: list[nn.Module],
        executor: Executor,
        comm: Comm | None,
        device: torch.device,
        key_prefix: str,
        tied: TiedGrads,
        replicas: Replicas | None,
        dp: int,
        check_values: Callable[[], None],
    ) -> None:
        self.schedule, self.program, self.rank, self.stages = schedule, program, rank, stages
        self.modules, self.executor, self.comm, self.device = modules, executor, comm, device
        self.key_prefix, self.tied, self.replicas, self.dp = key_prefix, tied, replicas, dp
        self.check_values = check_values
        self.last = schedule.n_stages - 1
        self.last_loss_rank = schedule.rank_of(self.last)
        self.eval_executor: Executor | None = None  # built at the first forward-only call
        self.prefetched: dict[str, Prefetched] = {}  # "inputs" / "targets": the next call's copy
        self.prefetch_used = 0  # prefetched copies a call took (for tests)
        # variable-length steps (varlen.py): the packing options, each compute's cost and the memory limit
        self.varlen: tuple[VarLen, StepCosts] | None = None
        self.last_packing: Packed | None = None  # the last call's, where this rank packed one

    @property
    def needs_inputs(self) -> bool:
        return 0 in self.stages

    @property
    def needs_targets(self) -> bool:
        return self.last in self.stages

    # ---- the calls

    def train(
        self,
        inputs: Inputs | None,
        targets: Any,
        prefetch: Sequence[Any] | None,
        record: bool,
        scaler: torch.amp.GradScaler | None,
    ) -> float:
        """One training step: the batch's mean loss, on every rank."""
        batch = self.microbatches(inputs, targets, "step")
        self.start_prefetch(prefetch)
        self.tied.begin()  # first: a tied weight's earlier gradient is put aside, not in a bucket
        if self.replicas is not None:
            self.replicas.begin_step(record)
        last = self.stages.get(self.last)
        if last is not None:  # set at every step (evaluate records its losses unscaled anyway)
            last.scale = scaler.scale if scaler is not None else None
        elif scaler is not None:  # its scale is made at the first scale(): unscale_ needs it here too
            scaler.scale(torch.zeros((), device=self.device))
        self.executor.run(batch.xs, batch.ys, record, batch.extra, batch.units, batch.check)
        return self.finish(self.program, self.executor.units)

    def forward_only(
        self,
        inputs: Inputs | None,
        targets: Any,
        method: str,
        outputs: bool,
        dst: Any,
        prefetch: Sequence[Any] | None,
    ) -> tuple[float | None, Batch | None]:
        """The forwards of one batch in eval mode: (the loss unless predicting, the outputs if asked)."""
        world = self.comm.world_size if self.comm is not None else 1
        dst = check_dst(dst, world) if outputs else None
        if self.eval_executor is None:
            sched = forward_only(self.schedule)
            self.eval_executor = Executor(
                sched, self.rank, self.stages, self.comm, self.device, f"{self.key_prefix}/eval"
            )
        want_loss = method != "predict"
        last = self.stages.get(self.last)
        modes = [(mod, mod.training) for stage in self.modules for mod in stage.modules()]
        try:
            if method == "predict" and (
                is_ragged(inputs) or (self.varlen is not None and is_ragged(unpad(inputs, "inputs")))
            ):
                raise ValueError(
                    "predict() takes a batch tensor (or tuple); its outputs are concatenated along "
                    "dim 0, which sequences of different lengths are not: call evaluate(samples, "
                    "targets, return_outputs=True) per group of equal lengths, or pad them"
                )
            batch = self.microbatches(inputs, targets, method, want_loss)
            self.start_prefetch(prefetch)
            for stage in self.modules:
                stage.eval()
            ys = batch.ys
            if last is not None:
                last.keep_outputs, last.want_loss = outputs, want_loss
                ys = ys if want_loss else [None] * self.schedule.n_microbatches
            with torch.no_grad():
                self.eval_executor.run(batch.xs, ys, False, batch.extra, batch.units, batch.check)
            tail = self.eval_executor.sched.program(self.rank, dp=self.dp)  # the loss's collectives
            loss = self.finish(tail, self.eval_executor.units) if want_loss else None
            kept = last.outputs if last is not None else None
            out = share_outputs(kept, self.comm, self.last_loss_rank, dst, method) if outputs else None
            return loss, out
        finally:
            for mod, training in modes:
                mod.training = training
            for st in self.stages.values():
                st.discard()
            if last is not None:
                last.keep_outputs, last.want_loss = False, True

    # ---- the batch

    def microbatches(
        self, inputs: Inputs | None, targets: Any, method: str, want_targets: bool = True
    ) -> Prepared:
        """The batch on this rank's device (one pinned asynchronous copy), split into micro-batches;
        a list of sequences packed instead (``_packed``)."""
        self.check_values()
        if self.varlen is not None:
            return self._packed(inputs, targets, method, want_targets)
        m = self.schedule.n_microbatches
        xs: list[Batch] = []
        ys: list[Any] = []
        if self.needs_inputs:
            if is_ragged(inputs):
                raise ValueError(
                    f"{method}() got a list for inputs; a list of sequences of different lengths needs a "
                    "Pipeline built with varlen=VarLen(token_budget=...); else pass a batch tensor"
                )
            xs = split(self._on_device(self._given(inputs, "inputs", method), "inputs"), m, what="inputs")
        if self.needs_targets and want_targets:
            ys = split(self._on_device(self._given(targets, "targets", method), "targets"), m, what="targets")
        return Prepared(xs, ys)

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
            # a model that takes documents declares that it takes (tokens, position ids)
            xs: list[Batch] = (
                [
                    (x, pos)
                    for x, pos in zip(padded, positions(self.last_packing, inputs[0].device), strict=True)
                ]
                if opts.documents
                else [x for x in padded]
            )
            out.xs = [self.executor.to_device(x) for x in xs]
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
            out.ys = [self.executor.to_device(y) for y in padded]
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

    def _on_device(self, batch: Any, slot: str) -> Any:
        """``batch`` on this rank's device: its prefetched copy when it is the batch prefetched."""
        pre = self.prefetched.get(slot)
        if pre is not None and pre.host is batch:
            del self.prefetched[slot]
            self.prefetch_used += 1
            return self.executor.take_prefetched(pre)
        return self.executor.to_device(batch)

    def start_prefetch(self, prefetch: Sequence[Any] | None) -> None:
        """Start the copies of the next call's inputs and targets, where this rank uses them."""
        if prefetch is None:
            return
        x, y = prefetch
        if self.needs_inputs and x is not None:
            self.prefetched["inputs"] = self.executor.prefetch(x)
        if self.needs_targets and y is not None:
            self.prefetched["targets"] = self.executor.prefetch(y)

    # ---- the program's tail

    def finish(self, program: Program, units: Sequence[int]) -> float:
        """Run ``program``'s tail in its order (the order every rank of each group runs it, which
        the validator checks): the replicas' reductions finish, tied weights' gradients are summed
        (each copy: every copy's sum), the loss goes out. The batch's mean loss, on every rank.

        The loss travels with what its micro-batches weigh in all (``units``: rows, or a variable-
        length step's target tokens, which only the last stage's rank knows), so that every rank
        weighs the replicas' losses alike."""
        last = self.stages.get(self.last)
        comm = self.comm
        # on the device (the Comm's, else the stages'): read on the host only at the end, once
        pair = (
            comm.zeros((2,), torch.float64)
            if comm is not None
            else torch.zeros((2,), dtype=torch.float64, device=self.device)
        )
        if last is not None:  # each micro-batch loss weighted by its share: the batch's mean
            losses = torch.stack(last.losses).float()
            shares = from_host(last.weights, torch.float32, losses.device)
            pair[0] += (losses * shares).sum().to(pair.device)  # float32 to float64: exact
            pair[1] += float(sum(units))
        mean: torch.Tensor | None = None  # the replicas' global mean, on the device
        for x in program.tail():
            if isinstance(x, ReduceWait):
                assert self.replicas is not None
                self.replicas.wait([x.stage])
            elif isinstance(x, Collective) and x.what == "ties":
                self.tied.reduce(x.ranks)
            elif isinstance(x, Collective) and x.op == "broadcast":
                assert comm is not None
                comm.broadcast(pair, x.root, f"the loss from rank {comm.name(x.root)}")
            elif isinstance(x, Collective):  # the loss over the replicas
                assert self.replicas is not None
                mean = self.replicas.global_mean(pair)
        loss = pair[0] if mean is None else mean
        return float(loss)  # HOST_SYNC (below): the call's one host synchronisation


# The one host synchronisation of a step (and of evaluate and predict): the loss read on the host at
# the end of ``finish``; on CUDA the host waits there for the call's queued work. Named here, beside
# it, as (function, its source line), for scripts/gpu_check.py, which allows this site and no other
# under ``torch.cuda.set_sync_debug_mode``; tests/test_host_sync.py checks that it is the one read.
HOST_SYNC = ("StepRunner.finish", "return float(loss)")


def host_sync_site() -> tuple[str, int]:
    """``HOST_SYNC`` as (source file, line number): its line (the code, a comment aside), found exactly
    once in its function's source."""
    qualname, text = HOST_SYNC
    target: Any = globals()[qualname.split(".")[0]]
    for part in qualname.split(".")[1:]:
        target = getattr(target, part)
    lines, first = inspect.getsourcelines(target)
    found = [first + k for k, line in enumerate(lines) if line.split("#")[0].strip() == text]
    if len(found) != 1:
        raise RuntimeError(
            f"HOST_SYNC names the line {text!r} in {qualname}, which has it {len(found)} times, expected "
            "once: the step's host synchronisation moved; make HOST_SYNC name the line that reads the loss"
        )
    return str(inspect.getsourcefile(target)), found[0]
