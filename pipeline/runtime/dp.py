"""Data parallelism across pipeline replicas: each stage's gradients all-reduced in buckets, overlapped.

    # p: ranks per pipeline, r: a pipeline rank, d: a replica, s: stage, i: micro-batch, B_d: rows of d

Every replica d runs the same pipeline on its own B_d rows. Afterwards every
rank must hold the gradient of the mean loss over all the replicas' rows, what
one process computes on their concatenation:

    g = sum_d (B_d / B) g_d          B = sum_d B_d,  g_d: replica d's gradient of its mean loss

A stage's gradients are final during its last weight-gradient action of the
step (its last W on a split-backward schedule such as zb-h1, else its last B;
``reduction_points`` reads it off the rank's part of the schedule). The stage is
armed just before it: as autograd accumulates each parameter's gradient for the
last time (a post-accumulate-grad hook), the buckets whose gradients are all
final are launched, asynchronously, in bucket order, on the "dp" group, as
DistributedDataParallel does within its backward; the rest once the action
ends. The step goes on, and ``wait`` collects them before ``step`` returns::

    rank r, interleaved (stages 0 and 2), m = 4:
    compute    .. B(2,3) ...... | B(0,2) | B(0,3) ....... | wait
    dp group       [stage 2: bucket 0][bucket 1] [stage 0: 0][1]
                   ^ launched while B(2, 3) runs, overlapping it and the pipeline's drain

Each bucket (about ``bucket_bytes``, like DistributedDataParallel's 25 MB; one
dtype each, parameters in reverse order as backward produces them) is one flat
buffer: the stage's gradients multiplied by B_d, then one flag per parameter,
1 where this rank has a gradient::

    flat = [ B_d * g(p_1) | B_d * g(p_2) | ... | has(p_1), has(p_2), ... ]   all-reduce SUM

and one small float64 all-reduce of B_d gives B. ``wait`` divides by B, so the
weights B_d / B sum to 1 (with equal batches, the mean over the dp replicas).
A parameter without a gradient on every replica keeps ``.grad`` None, as one
process leaves an unused parameter; one that has a gradient on any replica
gets the reduced one. Gradients that accumulate across steps (no
``zero_grad``) reduce correctly too: the part from earlier steps is the same
on every replica, and the weights sum to 1.

The collectives go through the pipeline's ``Comm`` for the "dp" group: every
wait is bounded by the pipeline's timeout and watches the failure key that the
whole mesh shares, so a replica that fails makes every rank raise, naming it.
Gloo runs the all-reduces on its own threads (CPU); NCCL on its stream, ordered
after the compute that produced the gradients.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.schedule import Schedule

__all__ = [
    "DEFAULT_BUCKET_MB",
    "Collectives",
    "GradReducer",
    "Reduction",
    "assign_parameters",
    "check_bucket_mb",
    "reduction_points",
]

DEFAULT_BUCKET_MB = 25.0  # DistributedDataParallel's default bucket_cap_mb


class Collectives(Protocol):
    """What the reducer needs of the "dp" group's ``Comm``: asynchronous all-reduces, waited with
    the pipeline's timeout and failure watch."""

    device: torch.device

    def start_all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> Any: ...

    def finish(self, work: Any, what: str) -> None: ...


def check_bucket_mb(bucket_mb: float) -> float:
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, int | float) or not bucket_mb > 0:
        raise ValueError(f"bucket_mb ({bucket_mb!r}) must be a number of megabytes > 0, e.g. 25.0")
    return float(bucket_mb)


def reduction_points(sched: Schedule, rank: int) -> dict[Action, int]:
    """Per local stage, the compute action after which its gradients are final: its last W on a
    split-backward schedule, else its last B (action -> stage)."""
    kind = Kind.W if sched.split_backward else Kind.B
    last: dict[int, Action] = {}
    for a in sched.lowered()[rank]:
        if a.kind is kind:
            last[a.stage] = a
    missing = sorted(set(sched.stages_of(rank)) - set(last))
    if missing:  # a schedule without a backward (forward_only) has nothing to reduce
        raise ValueError(f"schedule {sched.name!r} has no {kind.value} action for stages {missing}")
    return {a: s for s, a in last.items()}


def assign_parameters(
    modules: Mapping[int, nn.Module], points: Mapping[Action, int], lowered: Sequence[Action]
) -> dict[int, list[nn.Parameter]]:
    """Each trainable parameter once, to the local stage whose gradients are final last among those
    holding it (a module in two local stages gets gradients from both); stage -> its parameters."""
    position = {s: lowered.index(a) for a, s in points.items()}
    owner: dict[int, tuple[int, nn.Parameter]] = {}
    for s in sorted(modules, key=lambda s: position[s]):
        for p in modules[s].parameters():
            if p.requires_grad:
                owner[id(p)] = (s, p)  # a later stage overrides
    out: dict[int, list[nn.Parameter]] = {s: [] for s in modules}
    seen: set[int] = set()
    for s in modules:
        for p in modules[s].parameters():
            if id(p) not in seen and owner.get(id(p), (None,))[0] == s:
                seen.add(id(p))
                out[s].append(p)
    return out


@dataclass
class _Bucket:
    stage: int
    index: int  # within the stage: launched in this order
    params: list[nn.Parameter]
    numel: int  # of the gradients; the flags follow
    dtype: torch.dtype
    device: torch.device
    itemsize: int
    flat: torch.Tensor | None = None  # allocated at the first launch, reused
    work: Any = None
    ready: int = 0  # parameters whose gradient is final (while the stage is armed)
    launched: float = 0.0  # wall time; 0: not launched this step
    missing: list[int] = field(default_factory=list)  # params (by index) without a local gradient


@dataclass(frozen=True)
class Reduction:
    """One bucket of the last recorded step: wall times of its launch and of the end of its wait."""

    rank: int  # global
    stage: int
    bucket: int
    nbytes: int
    launched: float
    done: float


def _buckets(stage: int, params: Sequence[nn.Parameter], cap: int) -> list[_Bucket]:
    """``params`` in reverse order (as backward produces them) in buckets of one dtype and device,
    each at most ``cap`` bytes unless a single parameter is larger."""
    out: list[_Bucket] = []
    open_: dict[tuple[torch.dtype, torch.device], _Bucket] = {}
    for p in reversed(list(params)):
        key = (p.dtype, p.device)
        b = open_.get(key)
        size = p.numel() * p.element_size()
        if b is not None and (b.numel * p.element_size() + size) > cap:
            b = None
        if b is None:
            b = _Bucket(stage, len(out), [], 0, p.dtype, p.device, p.element_size())
            open_[key] = b
            out.append(b)
        b.params.append(p)
        b.numel += p.numel()
    return out


class GradReducer:
    """The "dp" all-reduce of one rank's gradients, stage by stage (see the module docstring).

    ``params``: per local stage its parameters (``assign_parameters``); ``comm``: the
    "dp" group's; ``rank``: this rank's global rank and ``replicas`` its "dp" group's
    global ranks, for records and errors. ``early``: the stages whose buckets may
    start during their last gradient action, each once its parameters' gradients
    are accumulated (a post-accumulate-grad hook per parameter; fires once per
    backward). A stage whose layers share a parameter is left out: a split
    backward accumulates such a parameter once per layer.
    """

    def __init__(
        self,
        params: Mapping[int, Sequence[nn.Parameter]],
        comm: Collectives,
        bucket_bytes: int,
        rank: int,
        replicas: Sequence[int],
        early: Iterable[int] = (),
    ) -> None:
        self.comm, self.rank = comm, rank
        self.buckets = {s: _buckets(s, ps, bucket_bytes) for s, ps in params.items()}
        self._group = f"replicas {list(replicas)}"
        self._rows: torch.Tensor | None = None
        self._rows_work: Any = None
        self._row_count = 0.0
        self._armed: int | None = None  # the stage in its last gradient action
        self._pending: list[int] = []  # stages whose buckets were all launched this step, in order
        self.record = False
        self.events: list[Reduction] = []
        self.exposed = 0.0  # seconds the last step's wait blocked the host
        self._hooks = [
            p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                functools.partial(self._accumulated, b)
            )
            for s in early
            for b in self.buckets.get(s, [])
            for p in b.params
        ]

    # ---- the step

    def begin_step(self, record: bool) -> None:
        self.abandon()
        self.record, self.events, self.exposed = record, [], 0.0

    def arm(self, stage: int, rows: int) -> None:
        """Stage ``stage`` starts its last gradient action (``rows``: this replica's B_d): its buckets
        launch as their gradients become final."""
        if stage in self._pending:
            raise RuntimeError(f"rank {self.rank}: stage {stage}'s gradients were reduced twice in one step")
        if self._rows_work is None:  # the first stage of the step: the weights' denominator B
            self._rows = torch.full((1,), float(rows), dtype=torch.float64, device=self.comm.device)
            self._rows_work = self.comm.start_all_reduce(
                self._rows, dist.ReduceOp.SUM, f"the batch rows' all-reduce over {self._group}"
            )
        self._row_count = float(rows)
        for b in self.buckets[stage]:
            b.ready, b.launched = 0, 0.0
        self._armed = stage

    def _accumulated(self, b: _Bucket, _param: torch.Tensor) -> None:
        if self._armed != b.stage:
            return
        b.ready += 1
        self._launch_ready(b.stage)

    def _launch_ready(self, stage: int) -> None:
        """Launch the stage's buckets in order, up to the first whose gradients are not all final."""
        for b in self.buckets[stage]:
            if b.launched:
                continue
            if b.ready < len(b.params):
                return
            self._start(b)

    def launch(self, stage: int) -> None:
        """Stage ``stage``'s last gradient action is done: launch the buckets not launched yet."""
        if self._armed != stage:
            raise RuntimeError(f"rank {self.rank}: stage {stage} launched its gradient all-reduce unarmed")
        for b in self.buckets[stage]:
            if not b.launched:
                self._start(b)
        self._armed = None
        self._pending.append(stage)

    def _start(self, b: _Bucket) -> None:
        n = len(b.params)
        if b.flat is None:
            b.flat = torch.empty(b.numel + n, dtype=b.dtype, device=b.device)
        flat, rows = b.flat, self._row_count
        b.missing = []
        off = 0
        for k, p in enumerate(b.params):
            part = flat[off : off + p.numel()]
            off += p.numel()
            if p.grad is None:
                part.zero_()
                b.missing.append(k)
            else:
                torch.mul(p.grad.reshape(-1), rows, out=part)
        flags = flat[b.numel :]
        flags.fill_(1)
        for k in b.missing:
            flags[k] = 0
        b.launched = time.time()
        b.work = self.comm.start_all_reduce(flat, dist.ReduceOp.SUM, self._what(b))

    def _what(self, b: _Bucket) -> str:
        mb = (b.numel + len(b.params)) * b.itemsize / 1e6
        return (
            f"the gradient all-reduce of stage {b.stage} (bucket {b.index}, {mb:.1f} MB) over {self._group}"
        )

    def wait(self, stages: Iterable[int]) -> None:
        """Wait for every launched bucket and leave the reduced gradients in ``.grad``; ``stages``:
        the local stages, each of which must have been launched this step."""
        unlaunched = sorted(set(stages) - set(self._pending))
        if unlaunched:
            raise RuntimeError(f"rank {self.rank}: stages {unlaunched} finished the step without launching "
                               "their gradient all-reduce")  # fmt: skip
        if not self._pending:
            return
        start = time.perf_counter()
        assert self._rows is not None
        self.comm.finish(self._rows_work, f"the batch rows' all-reduce over {self._group}")
        total = float(self._rows.item())
        for s in self._pending:
            for b in self.buckets[s]:
                self.comm.finish(b.work, self._what(b))
                b.work = None
                self._unpack(b, total)
                if self.record:
                    assert b.flat is not None
                    nbytes = b.flat.numel() * b.flat.element_size()
                    self.events.append(Reduction(self.rank, s, b.index, nbytes, b.launched, time.time()))
        self.exposed = time.perf_counter() - start
        self._pending, self._rows_work = [], None

    def _unpack(self, b: _Bucket, total: float) -> None:
        assert b.flat is not None
        flat = b.flat
        lacking = b.missing or any(p.grad is None for p in b.params)
        has = flat[b.numel :].tolist() if lacking else []  # a host sync only when some grad is None
        off = 0
        for k, p in enumerate(b.params):
            part = flat[off : off + p.numel()].view_as(p)
            off += p.numel()
            if p.grad is not None:
                torch.div(part, total, out=p.grad)
            elif has[k] > 0:  # another replica has a gradient for it
                p.grad = part / total

    def abandon(self) -> None:
        """After a failed step: forget the launched works (the group is unusable after a failure)."""
        for buckets in self.buckets.values():
            for b in buckets:
                b.work, b.launched, b.ready = None, 0.0, 0
        self._pending, self._rows_work, self._armed = [], None, None

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
