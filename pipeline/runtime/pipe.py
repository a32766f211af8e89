"""``Pipeline``: a model cut into stages over the ranks of a process group, trained one step at a time.

    # p: ranks, v: virtual stages per rank, m: micro-batches, s: stage

    pipe = Pipeline(model, [3, 3, 2, 2], schedule="1f1b", n_microbatches=8, loss_fn=F.cross_entropy)
    loss = pipe.step(inputs, targets)        # on every rank; returns the mean micro-batch loss
    opt = torch.optim.AdamW(pipe.parameters())

Stage s (``balance[s]`` consecutive layers of the ``nn.Sequential``) lives on rank
s % p. Only this rank's stages are kept. ``step`` leaves in ``.grad`` the gradient
of the mean micro-batch loss, exactly what one process computes for the whole
batch (each micro-batch loss is scaled by 1/m); grads accumulate across steps
as usual, so call ``opt.zero_grad()`` between steps.

A failure on any rank (bad input, an exception in a stage, a timeout) is
published in the group's store before it is raised, and the other ranks, which
watch for it whenever they wait, raise within a fraction of a second, naming
the failed rank and the action they were waiting for (see p2p.py).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.runtime import stream
from pipeline.runtime.executor import Executor
from pipeline.runtime.microbatch import Batch, split
from pipeline.runtime.p2p import Comm, PeerFailure, PipelineTimeout
from pipeline.runtime.recompute import check_mode
from pipeline.runtime.stage import LossFn, StageRuntime
from pipeline.schedules.schedule import Schedule, forward_only
from pipeline.schedules.schedule import schedule as make_schedule
from pipeline.schedules.timeline import Timeline
from pipeline.schedules.validate import validate

__all__ = ["Pipeline"]

_instances = itertools.count()  # same order of construction on every rank -> same store keys
_DEFAULT_M = 8


def _as_balance(balance: object) -> list[int]:
    raw = getattr(balance, "balance", balance)
    if not isinstance(raw, Sequence) or not all(isinstance(b, int) and not isinstance(b, bool) for b in raw):
        raise TypeError(f"balance must be a list of layer counts or a Plan with .balance, got {balance!r}")
    values = list(raw)
    if not values or any(b < 1 for b in values):
        raise ValueError(f"balance {values} must hold at least one stage, each of >= 1 layers")
    return values


class Pipeline:
    """This rank's stages of ``model`` and the executor that runs ``schedule`` over them.

    ``timeout`` (seconds) bounds every wait on another rank. ``init_fn(module)``
    runs on each local stage after a meta-device model is materialised: its
    parameters then come from ``reset_parameters`` (re-initialisation, not the
    values of any other copy of the model) and then ``init_fn``.
    """

    def __init__(
        self,
        model: nn.Sequential,
        balance: Sequence[int] | Any,
        *,
        schedule: str | Schedule = "1f1b",
        n_microbatches: int | None = None,
        loss_fn: LossFn | None = None,
        n_virtual: int = 1,
        checkpoint: str = "never",
        group: Any = None,
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        self.checkpoint = check_mode(checkpoint)
        self.balance = _as_balance(balance)
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        n_stages = len(self.balance)
        if n_stages != world * n_virtual:
            raise ValueError(
                f"balance has {n_stages} stages but world size ({world}) x n_virtual ({n_virtual}) is "
                f"{world * n_virtual}; pass {world * n_virtual} layer counts or change n_virtual"
            )
        if sum(self.balance) != len(model):
            raise ValueError(
                f"balance {self.balance} sums to {sum(self.balance)} layers but the model has {len(model)}; "
                "the layer counts must add up to len(model)"
            )
        self.schedule = self._schedule(schedule, n_stages, world, n_microbatches, n_virtual)
        self.n_microbatches = self.schedule.n_microbatches
        if loss_fn is None:
            raise ValueError("loss_fn is required: pass loss_fn=f with f(output, target) -> scalar tensor")
        if device is None:
            on_gpu = distributed and dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.device = torch.device(device)
        self._stage_ids = self.schedule.stages_of(self.rank)
        self._modules = [self._local_stage(model, s, init_fn) for s in self._stage_ids]
        self.module: nn.Module = self._modules[0] if len(self._modules) == 1 else nn.ModuleList(self._modules)
        self.stages = {
            s: StageRuntime(
                s,
                mod,
                n_stages=n_stages,
                n_microbatches=self.n_microbatches,
                split_backward=self.schedule.split_backward,
                checkpoint=checkpoint,
                loss_fn=loss_fn,
                device=self.device,
            )
            for s, mod in zip(self._stage_ids, self._modules, strict=True)
        }
        self._prefix = f"stagewise/pipe{next(_instances)}"
        self.comm = Comm(group, self._prefix, timeout) if distributed else None
        self.executor = Executor(self.schedule, self.rank, self.stages, self.comm, self.device, self._prefix)
        self._eval_executor: Executor | None = None  # built at the first evaluate()
        self._agreed = False
        self.last_loss_rank = self.schedule.rank_of(n_stages - 1)

    # ---- construction

    @staticmethod
    def _schedule(
        schedule: str | Schedule, n_stages: int, world: int, n_microbatches: int | None, n_virtual: int
    ) -> Schedule:
        if isinstance(schedule, str):
            return make_schedule(schedule, n_stages, n_microbatches or _DEFAULT_M, n_virtual=n_virtual)
        if schedule.n_stages != n_stages or schedule.n_ranks != world:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.n_stages} stages on {schedule.n_ranks} ranks, "
                f"but balance has {n_stages} stages on a world of {world}; build the schedule for these"
            )
        if schedule.n_virtual != n_virtual:
            raise ValueError(
                f"n_virtual ({n_virtual}) does not match the schedule's ({schedule.n_virtual}); "
                f"pass n_virtual={schedule.n_virtual}"
            )
        if n_microbatches is not None and n_microbatches != schedule.n_microbatches:
            raise ValueError(
                f"n_microbatches ({n_microbatches}) does not match the schedule's "
                f"({schedule.n_microbatches}); omit n_microbatches or pass {schedule.n_microbatches}"
            )
        validate(schedule)
        return schedule

    def _local_stage(
        self, model: nn.Sequential, s: int, init_fn: Callable[[nn.Module], None] | None
    ) -> nn.Sequential:
        start = sum(self.balance[:s])
        layers = OrderedDict((str(k), model[k]) for k in range(start, start + self.balance[s]))
        module = nn.Sequential(layers)  # keys are the original indices: names stay "3.weight"
        if any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
            module.to_empty(device=self.device)
            with torch.no_grad():
                for sub in module.modules():
                    reset = getattr(sub, "reset_parameters", None)
                    if callable(reset):
                        reset()
            if init_fn is not None:
                init_fn(module)
        return module.to(self.device)

    def close(self) -> None:
        """Stop this rank's communication thread (also done when the Pipeline is garbage-collected).

        Sends still in flight complete first; ``step`` and ``evaluate`` then raise.
        """
        if self.comm is not None:
            self.comm.close()

    # ---- parameters

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for mod in self._modules:
            yield from mod.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    # ---- the step

    def step(self, inputs: Batch | None = None, targets: Any = None, *, record: bool = False) -> float:
        """One training step over the batch; the mean micro-batch loss as a float, on every rank.

        ``inputs`` are needed on stage 0's rank and ``targets`` on the last stage's;
        other ranks may pass None. ``record`` keeps this step's measured timeline
        (see ``timeline`` and ``write_trace``).
        """
        with self._publish_failure():
            if not self._agreed:
                self._agree()
            xs, ys = self._microbatches(inputs, targets)
            self.executor.run(xs, ys, record)
            return self._loss()

    def evaluate(self, inputs: Batch | None = None, targets: Any = None) -> float:
        """The mean micro-batch loss without gradients, on every rank; call it on every rank.

        Runs only the forwards (stage order on each rank), with every stage in eval
        mode and autograd off, then restores the modes. Parameters and ``.grad``
        are untouched; nothing is kept for a backward.
        """
        if self._eval_executor is None:
            self._eval_executor = Executor(
                forward_only(self.schedule),
                self.rank,
                self.stages,
                self.comm,
                self.device,
                f"{self._prefix}/eval",
            )
        modes = [(mod, mod.training) for stage in self._modules for mod in stage.modules()]
        try:
            with self._publish_failure():
                if not self._agreed:
                    self._agree()
                xs, ys = self._microbatches(inputs, targets)
                for stage in self._modules:
                    stage.eval()
                with torch.no_grad():
                    self._eval_executor.run(xs, ys, False)
                return self._loss()
        finally:
            for mod, training in modes:
                mod.training = training
            for st in self.stages.values():
                st.discard()

    @contextlib.contextmanager
    def _publish_failure(self) -> Iterator[None]:
        """Publish this rank's failure so that waiting peers raise too (the first failure only)."""
        try:
            yield
        except BaseException as exc:
            if self.comm is not None and not isinstance(exc, PeerFailure):
                text = str(exc) if isinstance(exc, PipelineTimeout) else f"{type(exc).__name__}: {exc}"
                self.comm.publish(text)
            raise

    def _microbatches(self, inputs: Batch | None, targets: Any) -> tuple[list[Batch], list[Any]]:
        m, ex = self.n_microbatches, self.executor
        xs: list[Batch] = []
        ys: list[Any] = []
        if 0 in self.stages:
            if inputs is None:
                raise ValueError(f"rank {self.rank} holds stage 0 but step() got no inputs; pass the batch")
            xs = [self._to_device(x, ex) for x in split(_pinned(inputs), m, what="inputs")]
        if self.schedule.n_stages - 1 in self.stages:
            if targets is None:
                raise ValueError(
                    f"rank {self.rank} holds the last stage ({self.schedule.n_stages - 1}) but step() got no "
                    "targets; pass targets=... on this rank (the loss is computed there)"
                )
            ys = [self._to_device(y, ex) for y in split(_pinned(targets), m, what="targets")]
        return xs, ys

    def _to_device(self, x: Batch, ex: Executor) -> Batch:
        if isinstance(x, tuple):
            return tuple(stream.to_device(t, self.device, ex.copy_stream, ex.compute_stream) for t in x)
        return stream.to_device(x, self.device, ex.copy_stream, ex.compute_stream)

    def _agree(self) -> None:
        """At the first step: every rank runs the same schedule, micro-batch count and balance."""
        if self.comm is not None and self.comm.world_size > 1:
            mine = f"{self.schedule.to_text()}|m={self.n_microbatches}|balance={self.balance}"
            key = f"{self._prefix}/config"
            self.comm.set_key(f"{key}/{self.rank}", mine.encode())
            for q in range(self.comm.world_size):
                theirs = self.comm.wait_key(f"{key}/{q}", f"rank {q}'s configuration").decode()
                if theirs != mine:
                    raise ValueError(
                        f"ranks disagree about the pipeline: rank {self.rank} has {_summary(mine)}, rank {q} "
                        f"has {_summary(theirs)}; build the Pipeline with the same schedule, n_microbatches "
                        "and balance on every rank"
                    )
        self._agreed = True

    def _loss(self) -> float:
        last = self.stages.get(self.schedule.n_stages - 1)
        value = torch.zeros((), dtype=torch.float32, device=self._comm_device())
        if last is not None:
            value += torch.stack(last.losses).float().sum().to(value.device) / self.n_microbatches
        if self.comm is not None and self.comm.world_size > 1:
            self.comm.broadcast(value, self.last_loss_rank, f"the loss from rank {self.last_loss_rank}")
        return float(value)

    def _comm_device(self) -> torch.device:
        return self.device if self.comm is not None and self.comm.nccl else torch.device("cpu")

    # ---- measurements of the last step

    @property
    def busy_time(self) -> float:
        """Seconds this rank spent in compute actions in the last step (host clock)."""
        return self.executor.busy

    def peak_activations(self) -> dict[int, int]:
        """Per local stage: the most micro-batches whose activations it held at once in the last step."""
        return {s: st.peak for s, st in self.stages.items()}

    def timeline(self) -> Timeline:
        """This rank's events of the last ``step(record=True)``: compute, sends posted, receive waits."""
        return Timeline(list(self.executor.events), self.schedule.n_ranks)

    def gather_timeline(self) -> Timeline | None:
        """Every rank's events in one Timeline on rank 0 (None elsewhere); call on every rank."""
        events = self.executor.events
        if self.comm is None or self.comm.world_size == 1:
            return self.timeline()
        gathered: list[Any] = [None] * self.comm.world_size if self.rank == 0 else []
        dist.gather_object(events, gathered if self.rank == 0 else None, dst=0, group=self.comm.group)
        if self.rank != 0:
            return None
        return Timeline([e for part in gathered for e in part], self.schedule.n_ranks)

    def write_trace(self, path: str, simulated: Timeline | None = None) -> None:
        """Gather the last recorded step to rank 0 and write one Chrome trace (every rank; call on all)."""
        from pipeline.schedules.trace import write_chrome_trace

        measured = self.gather_timeline()
        if measured is None:
            return
        if simulated is None:
            write_chrome_trace(path, measured, names=["measured"])
        else:
            write_chrome_trace(path, simulated, measured, names=["simulated", "measured"])


def _pinned(batch: Any) -> Any:
    if isinstance(batch, tuple):
        return tuple(stream.pin(t) for t in batch)
    return stream.pin(batch) if isinstance(batch, torch.Tensor) else batch


def _summary(config: str) -> str:
    text, m, balance = config.split("|")
    return f"{m}, {balance}, schedule {' / '.join(text.splitlines())!r}"
