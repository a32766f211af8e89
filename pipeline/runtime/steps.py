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
by its rows on the last stage's rank, broadcast over the pipeline, averaged over the replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipeline.runtime.executor import Executor, Prefetched
from pipeline.runtime.microbatch import Batch, split
from pipeline.runtime.outputs import check_dst, share_outputs
from pipeline.runtime.p2p import Comm
from pipeline.runtime.replicas import Replicas
from pipeline.runtime.stage import StageRuntime
from pipeline.runtime.stream import from_host
from pipeline.runtime.ties import TiedGrads
from pipeline.schedules.program import Collective, Program, ReduceWait
from pipeline.schedules.schedule import Schedule, forward_only

__all__ = ["StepRunner"]


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

    @property
    def needs_inputs(self) -> bool:
        return 0 in self.stages

    @property
    def needs_targets(self) -> bool:
        return self.last in self.stages

    # ---- the calls

    def train(
        self,
        inputs: Batch | None,
        targets: Any,
        prefetch: Sequence[Any] | None,
        record: bool,
        scaler: torch.amp.GradScaler | None,
    ) -> float:
        """One training step: the batch's mean loss, on every rank."""
        xs, ys = self.microbatches(inputs, targets, "step")
        self.start_prefetch(prefetch)
        self.tied.begin()  # first: a tied weight's earlier gradient is put aside, not in a bucket
        if self.replicas is not None:
            self.replicas.begin_step(record)
        last = self.stages.get(self.last)
        if last is not None:  # set at every step (evaluate records its losses unscaled anyway)
            last.scale = scaler.scale if scaler is not None else None
        elif scaler is not None:  # its scale is made at the first scale(): unscale_ needs it here too
            scaler.scale(torch.zeros((), device=self.device))
        self.executor.run(xs, ys, record)
        return self.finish(self.program, self.executor.sizes)

    def forward_only(
        self,
        inputs: Batch | None,
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
            xs, ys = self.microbatches(inputs, targets, method, want_loss)
            self.start_prefetch(prefetch)
            for stage in self.modules:
                stage.eval()
            if last is not None:
                last.keep_outputs, last.want_loss = outputs, want_loss
                ys = ys if want_loss else [None] * self.schedule.n_microbatches
            with torch.no_grad():
                self.eval_executor.run(xs, ys, False)
            tail = self.eval_executor.sched.program(self.rank, dp=self.dp)  # the loss's collectives
            loss = self.finish(tail, self.eval_executor.sizes) if want_loss else None
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
        self, inputs: Batch | None, targets: Any, method: str, want_targets: bool = True
    ) -> tuple[list[Batch], list[Any]]:
        """The batch on this rank's device (one pinned asynchronous copy), split into micro-batches."""
        self.check_values()
        m = self.schedule.n_microbatches
        xs: list[Batch] = []
        ys: list[Any] = []
        if self.needs_inputs:
            if inputs is None:
                raise ValueError(
                    f"rank {self.rank} holds stage 0 but {method}() got no inputs; pass the batch on this "
                    "rank (pipe.needs_inputs is True here)"
                )
            xs = split(self._on_device(inputs, "inputs"), m, what="inputs")
        if self.needs_targets and want_targets:
            if targets is None:
                raise ValueError(
                    f"rank {self.rank} holds the last stage ({self.last}) but {method}() got no targets; "
                    "pass targets=... on this rank (the loss is computed there; pipe.needs_targets is "
                    "True here)"
                )
            ys = split(self._on_device(targets, "targets"), m, what="targets")
        return xs, ys

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

    def finish(self, program: Program, sizes: Sequence[int]) -> float:
        """Run ``program``'s tail in its order (the order every rank of each group runs it, which
        the validator checks): the replicas' reductions finish, tied weights' gradients are summed
        (each copy: every copy's sum), the loss goes out. The batch's mean loss, on every rank."""
        last = self.stages.get(self.last)
        comm = self.comm
        value = comm.zeros(()) if comm is not None else torch.zeros((), device=self.device)
        if last is not None:  # each micro-batch loss weighted by its rows: the batch's mean
            losses = torch.stack(last.losses).float()
            shares = from_host(last.weights, torch.float32, losses.device)
            value += (losses * shares).sum().to(value.device)
        mean: float | None = None
        for x in program.tail():
            if isinstance(x, ReduceWait):
                assert self.replicas is not None
                self.replicas.wait([x.stage])
            elif isinstance(x, Collective) and x.what == "ties":
                self.tied.reduce(x.ranks)
            elif isinstance(x, Collective) and x.op == "broadcast":
                assert comm is not None
                comm.broadcast(value, x.root, f"the loss from rank {comm.name(x.root)}")
            elif isinstance(x, Collective):  # the loss over the replicas
                assert self.replicas is not None
                mean = self.replicas.global_mean(float(value), sum(sizes))
        return float(value) if mean is None else mean
