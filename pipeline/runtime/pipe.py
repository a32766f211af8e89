"""``Pipeline``: a model cut into stages over the ranks of a process group, trained one step at a time.

    # p: ranks, v: virtual stages per rank, m: micro-batches, s: stage

    plan = partition(model, 4, sample, schedule="1f1b", n_microbatches=8)   # or Plan(balance=[...], ...)
    pipe = Pipeline(model, plan, loss_fn=F.cross_entropy)    # on every rank
    opt = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(inputs, targets)        # the mean micro-batch loss, on every rank
    pipe.clip_grad_norm_(1.0)                # the norm over every stage's gradients
    opt.step(); opt.zero_grad()
    state = pipe.gather_state_dict()         # the whole model's state dict on rank 0

The plan says the balance, schedule, m, v and recomputation mode; a plain
balance list with those as keywords works too (see options.py). Stage s
(``balance[s]`` consecutive layers of the ``nn.Sequential``) lives on rank
s % p. Only this rank's stages are kept. ``step`` leaves in ``.grad`` the
gradient of the mean micro-batch loss, exactly what one process computes for
the whole batch (each micro-batch loss is scaled by 1/m); grads accumulate
across steps as usual, so call ``opt.zero_grad()`` between steps.

A failure on any rank (bad input, an exception in a stage, a timeout) is
published in the group's store before it is raised, and the other ranks, which
watch for it whenever they wait, raise within a fraction of a second, naming
the failed rank and the action they were waiting for (see p2p.py).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.plan import Plan
from pipeline.runtime import grads, stream
from pipeline.runtime.executor import Executor
from pipeline.runtime.gather import gather_state_dict
from pipeline.runtime.microbatch import Batch, split
from pipeline.runtime.options import check_group, check_model, resolve
from pipeline.runtime.p2p import Comm, PeerFailure, PipelineTimeout
from pipeline.runtime.stage import LossFn, StageRuntime
from pipeline.schedules.schedule import Schedule, forward_only
from pipeline.schedules.timeline import Timeline

__all__ = ["Pipeline"]

# per process group (its global ranks): every member builds its Pipelines on it in the same
# order, so the n-th one has the same store keys on every member, whatever other groups exist
_instances: dict[tuple[int, ...], Iterator[int]] = {}


class Pipeline:
    """This rank's stages of ``model`` and the executor that runs the plan's schedule over them.

    ``plan`` is a ``Plan`` (it says balance, schedule, ``n_microbatches``,
    ``n_virtual`` and ``recompute``; a keyword may repeat it, not contradict it)
    or a list of layer counts per stage, with those options as keywords
    (defaults: 1f1b, m = p, v = 2 for interleaved-1f1b, recompute "never"), or
    with ``schedule=`` a ``Schedule`` object. ``checkpoint=`` is the old name of
    ``recompute=``. ``timeout`` (seconds) bounds every wait on another rank.
    ``init_fn(module)`` runs on each local stage after a meta-device model is
    materialised: its parameters then come from ``reset_parameters``
    (re-initialisation, not the values of any other copy of the model) and then
    ``init_fn``.
    """

    def __init__(
        self,
        model: nn.Sequential,
        plan: Plan | Sequence[int],
        *,
        loss_fn: LossFn | None,
        schedule: str | Schedule | None = None,
        n_microbatches: int | None = None,
        n_virtual: int | None = None,
        recompute: str | None = None,
        checkpoint: str | None = None,
        group: Any = None,
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        options = resolve(
            plan,
            schedule=schedule,
            n_microbatches=n_microbatches,
            n_virtual=n_virtual,
            recompute=recompute,
            checkpoint=checkpoint,
        )
        check_model(model, options.balance)
        if loss_fn is None:
            raise ValueError("loss_fn is required: pass loss_fn=f with f(output, target) -> scalar tensor")
        distributed = dist.is_available() and dist.is_initialized()
        check_group(options, distributed, dist.get_world_size(group) if distributed else 1)
        self.plan: Plan | None = options.plan  # None when a Schedule object was given
        self.balance, self.schedule, self.recompute = options.balance, options.schedule, options.recompute
        self.n_microbatches = self.schedule.n_microbatches
        self.rank = dist.get_rank(group) if distributed else 0
        if device is None:
            on_gpu = distributed and dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.device = torch.device(device)
        n_stages = len(self.balance)
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
                recompute=self.recompute,
                loss_fn=loss_fn,
                device=self.device,
            )
            for s, mod in zip(self._stage_ids, self._modules, strict=True)
        }
        self._prefix = _store_prefix(group, distributed)
        self.comm = Comm(group, self._prefix, timeout) if distributed else None
        self.executor = Executor(self.schedule, self.rank, self.stages, self.comm, self.device, self._prefix)
        self._eval_executor: Executor | None = None  # built at the first evaluate()
        self._agreed = False
        self._gathers = itertools.count()  # gather_state_dict calls: a store key each
        self.last_loss_rank = self.schedule.rank_of(n_stages - 1)

    # ---- construction

    def _local_stage(
        self, model: nn.Sequential, s: int, init_fn: Callable[[nn.Module], None] | None
    ) -> nn.Sequential:
        start = sum(self.balance[:s])
        keys = list(model._modules)[start : start + self.balance[s]]
        module = nn.Sequential(OrderedDict((k, model._modules[k]) for k in keys))  # names as in the model
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

    # ---- parameters and buffers (this rank's stages; names as in the model, e.g. "3.weight")

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Each parameter once, even when a module appears in two local stages (as nn.Module does)."""
        seen: set[int] = set()
        for mod in self._modules:
            for name, p in mod.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        for mod in self._modules:
            for name, b in mod.named_buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    yield name, b

    def buffers(self) -> Iterator[torch.Tensor]:
        for _, b in self.named_buffers():
            yield b

    def _grads(self) -> list[torch.Tensor]:
        """The local gradients, each parameter's once (``named_parameters`` skips repeats)."""
        return [p.grad for p in self.parameters() if p.grad is not None]

    def gather_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict (parameters and buffers, the model's names, CPU copies) on rank
        ``dst``, None on the others; call on every rank."""
        world = self.comm.world_size if self.comm is not None else 1
        if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world:
            raise ValueError(f"dst ({dst!r}) must be a rank of the pipeline's group, 0 to {world - 1}")
        local = {s: mod.state_dict() for s, mod in zip(self._stage_ids, self._modules, strict=True)}
        key = f"{self._prefix}/state{next(self._gathers)}"
        with self._publish_failure():
            return gather_state_dict(local, self.comm, dst, key, self._comm_device())

    # ---- the optimizer step's companions: call on every rank, after step()

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> float:
        """Clip the gradients of every stage, on every rank, by their total norm; returns that norm.

        The same as ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on the
        whole model in one process: the total is the ``norm_type`` norm of all
        gradients (inf: the largest absolute value), each parameter counted once, and
        every gradient is scaled by ``min(1, max_norm / (total + 1e-6))``.
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm >= 0:
            raise ValueError(f"max_norm ({max_norm!r}) must be a number >= 0, e.g. 1.0")
        gs = self._grads()
        with self._publish_failure():
            total = grads.total_norm(gs, norm_type, self.comm, self._comm_device())
        value = float(total)
        # every rank has the same value, so every rank raises the same error
        if error_if_nonfinite and not math.isfinite(value):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the pipeline's gradients is {value}, so they "
                "cannot be clipped; pass error_if_nonfinite=False to clip anyway, or skip the optimizer "
                "step when grads_finite() is False"
            )
        grads.clip_(gs, float(max_norm), total)
        return value

    def grads_finite(self) -> bool:
        """True when no gradient of any stage holds an inf or NaN: the same answer on every rank."""
        gs = self._grads()
        with self._publish_failure():
            return grads.all_finite(gs, self.comm, self._comm_device())

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


def _store_prefix(group: Any, distributed: bool) -> str:
    """This Pipeline's store keys: the n-th Pipeline on the group's ranks."""
    members: tuple[int, ...] = ()
    if distributed:
        members = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    return f"stagewise/pipe{next(_instances.setdefault(members, itertools.count()))}"


def _pinned(batch: Any) -> Any:
    if isinstance(batch, tuple):
        return tuple(stream.pin(t) for t in batch)
    return stream.pin(batch) if isinstance(batch, torch.Tensor) else batch


def _summary(config: str) -> str:
    text, m, balance = config.split("|")
    return f"{m}, {balance}, schedule {' / '.join(text.splitlines())!r}"
