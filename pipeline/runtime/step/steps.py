"""One rank's calls over a batch: the step, and the forward-only passes (evaluate, predict).

    # m: micro-batches, i: a micro-batch, r: this rank

``Pipeline`` is the facade (it builds the parts, checks the arguments, publishes a failure,
measures memory); a ``StepRunner`` does the work of each call, in this order::

    step       the batch's four moves (prepare.py): prepare (m micro-batches on the host) ->
               describe (the header, every stage's signatures) -> place (on the device, or the
               prefetched copy) -> the next call's copy started -> tied grads put aside, replicas'
               buckets armed -> run (the executor: computes, messages, reductions started)
               -> the program's tail (``finish``): reductions ended, tied grads summed, the loss
    evaluate   the same batch handling, stages in eval mode and autograd off, the forward-only
    predict    schedule's program, its tail (the loss), the outputs to the ranks that ask

The loss that ``finish`` returns is the batch's mean on every rank: each micro-batch's loss weighted
by its rows on the last stage's rank, broadcast over the pipeline, averaged over the replicas. It
stays on the device until ``finish``'s last line reads it: the call's one host synchronisation
(``HOST_SYNC``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipeline.runtime.comm.p2p import Comm
from pipeline.runtime.comm.stream import from_host
from pipeline.runtime.inputs.microbatch import Batch
from pipeline.runtime.inputs.varlen import Packed, StepCosts, VarLen, is_ragged, unpad
from pipeline.runtime.replicas.replicas import Replicas
from pipeline.runtime.step.describe import Describer
from pipeline.runtime.step.executor import Executor
from pipeline.runtime.step.outputs import check_dst, share_outputs
from pipeline.runtime.step.place import Placer
from pipeline.runtime.step.prepare import Inputs, Preparer
from pipeline.runtime.step.stage import StageRuntime
from pipeline.runtime.trace.ties import TiedGrads
from pipeline.schedules.program import Collective, Program, ReduceWait
from pipeline.schedules.schedule import Schedule, forward_only

__all__ = ["HOST_SYNC", "Inputs", "StepRunner", "host_sync_site"]


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
        # a call's data, move by move (prepare.py): each executor has its describer (its messages' specs)
        self.preparer = Preparer(schedule, rank, self.needs_inputs, self.needs_targets)
        self.describer = Describer(schedule, rank, stages, comm, device, key_prefix, executor.msgs)
        self.eval_describer: Describer | None = None
        self.placer = Placer(device, executor.emulated, schedule.n_microbatches)

    @property
    def varlen(self) -> tuple[VarLen, StepCosts] | None:
        """A variable-length run's packing options and each compute's cost (varlen.py), or None."""
        return self.preparer.varlen

    @varlen.setter
    def varlen(self, value: tuple[VarLen, StepCosts] | None) -> None:
        self.preparer.varlen = value

    @property
    def last_packing(self) -> Packed | None:
        return self.preparer.last_packing

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
        self.check_values()
        prepared = self.preparer.prepare(inputs, targets, "step")
        described = self.describer.describe(prepared)
        placed = self.placer.place(prepared)
        self.placer.start_prefetch(prefetch, self.needs_inputs, self.needs_targets)
        self.tied.begin()  # first: a tied weight's earlier gradient is put aside, not in a bucket
        if self.replicas is not None:
            self.replicas.begin_step(record)
        last = self.stages.get(self.last)
        if last is not None:  # set at every step (evaluate records its losses unscaled anyway)
            last.scale = scaler.scale if scaler is not None else None
        elif scaler is not None:  # its scale is made at the first scale(): unscale_ needs it here too
            scaler.scale(torch.zeros((), device=self.device))
        self.executor.run(placed, described, record)
        return self.finish(self.program, described.units)

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
        if self.eval_executor is None or self.eval_describer is None:
            sched, prefix = forward_only(self.schedule), f"{self.key_prefix}/eval"
            self.eval_executor = Executor(sched, self.rank, self.stages, self.comm, self.device, prefix)
            self.eval_describer = Describer(
                sched, self.rank, self.stages, self.comm, self.device, prefix, self.eval_executor.msgs
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
            self.check_values()
            prepared = self.preparer.prepare(inputs, targets, method, want_loss)
            described = self.eval_describer.describe(prepared)
            placed = self.placer.place(prepared)
            self.placer.start_prefetch(prefetch, self.needs_inputs, self.needs_targets)
            for stage in self.modules:
                stage.eval()
            if self.replicas is not None and self.replicas.sharded is not None:
                self.replicas.sharded.begin_forward_only()
            if last is not None:
                last.keep_outputs, last.want_loss = outputs, want_loss
                if not want_loss:
                    placed.ys = [None] * self.schedule.n_microbatches
            with torch.no_grad():
                self.eval_executor.run(placed, described, False)
            tail = self.eval_executor.sched.program(self.rank, dp=self.dp)  # the loss's collectives
            loss = self.finish(tail, described.units) if want_loss else None
            kept = last.outputs if last is not None else None
            out = share_outputs(kept, self.comm, self.last_loss_rank, dst, method) if outputs else None
            return loss, out
        finally:
            for mod, training in modes:
                mod.training = training
            if self.replicas is not None and self.replicas.sharded is not None:
                self.replicas.sharded.reshard()  # what FSDP's hooks gathered for the forwards
            for st in self.stages.values():
                st.discard()
            if last is not None:
                last.keep_outputs, last.want_loss = False, True

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
