"""Data parallelism across pipeline replicas: each stage's gradients all-reduced in buckets, overlapped.

    # p: ranks per pipeline, r: a pipeline rank, d: a replica, s: stage, i: micro-batch, B_d: rows of d

Every replica d runs the same pipeline on its own B_d rows. Afterwards every
rank must hold the gradient of the mean loss over all the replicas' rows, what
one process computes on their concatenation:

    g = sum_d (B_d / B) g_d          B = sum_d B_d,  g_d: replica d's gradient of its mean loss

The weights cost nothing: once the step's rows are known, one small float64
all-reduce gives B (``start_rows``), and the last stage multiplies each
micro-batch's loss by ``share()`` = B_d / B, so that autograd itself produces
(B_d / B) g_d and a plain SUM all-reduce leaves g.

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
dtype each, parameters in reverse order as backward produces them) of several
parameters is one flat buffer, and each parameter's ``.grad`` is a view of it
(DDP's gradient_as_bucket_view); a parameter as large as a bucket is a bucket
of its own, and its ``.grad`` is all-reduced as it is::

    bucket 0   flat = [ g(p_1) | g(p_2) | g(p_3) ]    all-reduce SUM, in place
                        ^ p_1.grad (a view)
    bucket 1   p_4.grad                             all-reduce SUM, in place
    stage s    has = [ 1, 1, 0, 1 ]                 after its buckets: who has a gradient

Autograd accumulates into the views, so a bucket is launched without a copy
and the reduced gradients are in ``.grad`` when its all-reduce ends. After
``zero_grad()`` (set_to_none, torch's default) the first accumulation of a step
makes a fresh tensor: in a bucket of several, the hook copies it into the view
once and points ``.grad`` back at it; a bucket of one keeps it. Gradients that
``.grad`` already holds when a step begins (accumulation across steps without
``zero_grad``) are the same on every replica, the previous step's reduction:
they are divided by the number of replicas, so that the SUM counts them once.

A parameter without a gradient on every replica keeps ``.grad`` None, as one
process leaves an unused parameter; one that has a gradient on any replica
gets the reduced one (the stage's small ``has`` all-reduce tells).

The collectives go through the pipeline's ``Comm`` for the "dp" group: every
wait is bounded by the pipeline's timeout and watches the failure key that the
whole mesh shares, so a replica that fails makes every rank raise, naming it.
Gloo runs the all-reduces on its own threads (CPU); NCCL on its stream, ordered
after the compute that produced the gradients.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipeline.plan import REPLICA_DTYPE
from pipeline.runtime.comm.stream import from_host
from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.program import Reduce
from pipeline.schedules.schedule import Schedule

__all__ = [
    "DEFAULT_BUCKET_MB",
    "Collectives",
    "GradReducer",
    "Hooked",
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
    world_size: int

    def start_all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> Any: ...

    def finish(self, work: Any, what: str) -> None: ...


def check_bucket_mb(bucket_mb: float) -> float:
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, int | float) or not bucket_mb > 0:
        raise ValueError(f"bucket_mb ({bucket_mb!r}) must be a number of megabytes > 0, e.g. 25.0")
    return float(bucket_mb)


class Hooked(Protocol):
    """What the replicas need of the rank's executor (step/executor.py; named here, not imported: the
    step room sits above this one): calls around each compute, and the step's rows once known."""

    on_rows: Callable[[list[int]], Callable[[], torch.Tensor]] | None

    def hook(self, a: Action, before: Callable[[], None], after: Callable[[], None]) -> None: ...


def reduction_points(sched: Schedule, rank: int) -> dict[Action, int]:
    """Per local stage, the compute action after which its gradients are final: the one before the
    program's ``reduce`` of that stage (its last W on a split-backward schedule, else its last B;
    action -> stage)."""
    points: dict[Action, int] = {}
    last: Action | None = None
    for x in sched.program(rank, dp=2):  # where the reductions start: the same for every dp > 1
        if isinstance(x, Action):
            last = x
        elif isinstance(x, Reduce) and last is not None:
            points[last] = x.stage
    missing = sorted(set(sched.stages_of(rank)) - set(points.values()))
    if missing:  # a schedule without a backward (forward_only) has nothing to reduce
        kind = Kind.W if sched.split_backward else Kind.B
        raise ValueError(f"schedule {sched.name!r} has no {kind.value} action for stages {missing}")
    return points


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
    numel: int
    dtype: torch.dtype
    device: torch.device
    itemsize: int
    flat: torch.Tensor | None = None  # allocated at the first use, kept: the gradients live in it
    views: list[torch.Tensor] = field(default_factory=list)  # each parameter's part of ``flat``
    reduced: torch.Tensor | None = None  # what this step's all-reduce works on
    work: Any = None
    ready: int = 0  # parameters whose gradient is final (while the stage is armed)
    launched: float = 0.0  # wall time; 0: not launched this step
    missing: list[int] = field(default_factory=list)  # params (by index) without a local gradient

    @property
    def single(self) -> bool:
        """A bucket of one parameter all-reduces its ``.grad`` itself (when contiguous)."""
        return len(self.params) == 1

    def view(self, k: int) -> torch.Tensor:
        """Parameter k's gradient slot in the flat buffer (allocated, zeroed, at the first call)."""
        if self.flat is None:
            self.flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            off = 0
            for p in self.params:
                self.views.append(self.flat[off : off + p.numel()].view(p.shape))
                off += p.numel()
        return self.views[k]


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
    are accumulated. A stage whose layers share a parameter is left out: a split
    backward accumulates such a parameter once per layer.

    Per step: ``begin_step``; ``start_rows`` once the replica's rows are known
    (``share`` then weighs the loss); per stage ``arm`` before its last gradient
    action and ``launch`` after it; ``wait``.
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
        self._early = set(early)
        self._group = f"replicas {list(replicas)}"
        self._rows: torch.Tensor | None = None  # (1,) float64: this replica's rows, then B
        self._rows_work: Any = None
        self._own_rows = 0
        self._share: torch.Tensor | None = None  # B_d / B, once the rows' all-reduce is done
        self._armed: int | None = None  # the stage in its last gradient action
        self._has: dict[int, tuple[torch.Tensor, Any]] = {}  # stage -> its "has a gradient" flags, work
        self._pending: list[int] = []  # stages whose buckets were all launched this step, in order
        self.record = False
        self.events: list[Reduction] = []
        self.exposed = 0.0  # seconds the last step's waits blocked the host
        # every accumulation: into the bucket's view; while armed, launch what is final. The hooks live
        # in autograd's C++ state, which the garbage collector cannot see into: they hold the reducer
        # weakly, so that a Pipeline dropped without close() frees its Comm (and its watchdog)
        me = weakref.ref(self)
        self._hooks = [
            p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                functools.partial(_on_accumulated, me, b, k)
            )
            for buckets in self.buckets.values()
            for b in buckets
            for k, p in enumerate(b.params)
        ]
        self._finalizer = weakref.finalize(self, _remove, self._hooks)

    def held(self) -> list[torch.Tensor]:
        """The flat buffers kept from step to step (the gradients live in them): alive at a step's
        start even when every ``.grad`` was set to None (``zero_grad``)."""
        return [b.flat for buckets in self.buckets.values() for b in buckets if b.flat is not None]

    # ---- the step

    def begin_step(self, record: bool) -> None:
        """A step begins: gradients ``.grad`` holds already move into the buckets, divided by the
        number of replicas (they are the same on every replica: see the module docstring)."""
        self.abandon()
        self.record, self.events, self.exposed = record, [], 0.0
        scale = 1.0 / self.comm.world_size
        with torch.no_grad():
            for buckets in self.buckets.values():
                for b in buckets:
                    for k, p in enumerate(b.params):
                        g = p.grad
                        if g is None:
                            continue
                        if b.single or g.data_ptr() == b.view(k).data_ptr():
                            g.mul_(scale)
                        else:
                            torch.mul(g, scale, out=b.view(k))
                            p.grad = b.view(k)

    def start_rows(self, rows: int) -> None:
        """This replica's rows in the step (B_d): launch their all-reduce, which gives B."""
        if self._rows_work is not None:
            raise RuntimeError(f"rank {self.rank}: the batch rows were all-reduced twice in one step")
        self._own_rows, self._share = rows, None
        self._rows = torch.full((1,), float(rows), dtype=REPLICA_DTYPE, device=self.comm.device)
        self._rows_work = self.comm.start_all_reduce(
            self._rows, dist.ReduceOp.SUM, f"the batch rows' all-reduce over {self._group}"
        )

    def share(self) -> torch.Tensor:
        """B_d / B (a float64 scalar on the group's device): the weight of this replica's loss."""
        if self._share is None:
            if self._rows_work is None or self._rows is None:
                raise RuntimeError(f"rank {self.rank}: share() before start_rows() in this step")
            self.comm.finish(self._rows_work, f"the batch rows' all-reduce over {self._group}")
            self._share = self._own_rows / self._rows[0]
        return self._share

    def arm(self, stage: int) -> None:
        """Stage ``stage`` starts its last gradient action: its buckets launch as their gradients
        become final."""
        if stage in self._pending:
            raise RuntimeError(f"rank {self.rank}: stage {stage}'s gradients were reduced twice in one step")
        for b in self.buckets[stage]:
            b.ready, b.launched = 0, 0.0
        self._armed = stage

    def _accumulated(self, b: _Bucket, k: int, param: torch.Tensor) -> None:
        g = param.grad
        if not b.single and g is not None and g.data_ptr() != b.view(k).data_ptr():  # a fresh tensor
            with torch.no_grad():
                b.view(k).copy_(g)
            param.grad = b.view(k)
        if self._armed != b.stage or b.stage not in self._early:
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
        flags = [float(p.grad is not None) for b in self.buckets[stage] for p in b.params]
        has = from_host(flags, torch.float32, self.comm.device)  # no host sync: the overlap happens here
        self._has[stage] = (has, self.comm.start_all_reduce(has, dist.ReduceOp.SUM, self._what_has(stage)))
        self._armed = None
        self._pending.append(stage)

    def _start(self, b: _Bucket) -> None:
        b.missing = []
        with torch.no_grad():
            for k, p in enumerate(b.params):
                g = p.grad
                if g is None:  # none here: zeros (the stage's flags say so)
                    b.view(k).zero_()
                    b.missing.append(k)
                elif (not b.single or not g.is_contiguous()) and g.data_ptr() != b.view(k).data_ptr():
                    b.view(k).copy_(g)  # set outside autograd during the step, or strided
                    p.grad = b.view(k)
        g = b.params[0].grad
        b.reduced = g if b.single and g is not None and not b.missing else b.flat
        assert b.reduced is not None
        b.launched = time.time()
        b.work = self.comm.start_all_reduce(b.reduced, dist.ReduceOp.SUM, self._what(b))

    def _what_has(self, stage: int) -> str:
        return f"the gradient flags of stage {stage} over {self._group}"

    def _what(self, b: _Bucket) -> str:
        mb = b.numel * b.itemsize / 1e6
        return (
            f"the gradient all-reduce of stage {b.stage} (bucket {b.index}, {mb:.1f} MB) over {self._group}"
        )

    def wait(self, stages: Iterable[int]) -> None:
        """Wait for the buckets of ``stages`` (each launched this step) and leave their reduced
        gradients in ``.grad``: the program's ``wait reduce``, stage by stage or all at once."""
        wanted = set(stages)
        unlaunched = sorted(wanted - set(self._pending))
        if unlaunched:
            raise RuntimeError(f"rank {self.rank}: stages {unlaunched} finished the step without launching "
                               "their gradient all-reduce")  # fmt: skip
        start = time.perf_counter()
        if self._rows_work is not None and self._share is None:  # every collective ends in its step
            self.share()
        for s in [s for s in self._pending if s in wanted]:  # in launch order
            for b in self.buckets[s]:
                self.comm.finish(b.work, self._what(b))
                b.work, b.reduced = None, None  # a zero_grad must be able to free the gradient
                if self.record:
                    nbytes = b.numel * b.itemsize
                    self.events.append(Reduction(self.rank, s, b.index, nbytes, b.launched, time.time()))
            has, work = self._has.pop(s)
            self.comm.finish(work, self._what_has(s))
            self._adopt(s, has)
            self._pending.remove(s)
        self.exposed += time.perf_counter() - start
        if not self._pending:
            self._rows_work = None

    def _adopt(self, stage: int, has: torch.Tensor) -> None:
        """A parameter without a gradient here gets the reduced one when another replica had one."""
        if not any(b.missing for b in self.buckets[stage]):
            return
        flags = has.tolist()  # a host sync, only when some gradient was missing here
        k0 = 0
        for b in self.buckets[stage]:
            for k in b.missing:
                if flags[k0 + k] > 0:
                    b.params[k].grad = b.view(k)
            k0 += len(b.params)

    def abandon(self) -> None:
        """After a failed step: forget the launched works (the group is unusable after a failure)."""
        for buckets in self.buckets.values():
            for b in buckets:
                b.work, b.launched, b.ready = None, 0.0, 0
        self._pending, self._rows_work, self._armed, self._share = [], None, None, None
        self._has = {}

    def close(self) -> None:
        """Remove the gradient hooks."""
        self._finalizer()


def _on_accumulated(reducer: weakref.ref[GradReducer], b: _Bucket, k: int, param: torch.Tensor) -> None:
    live = reducer()
    if live is not None:
        live._accumulated(b, k, param)


def _remove(hooks: list[Any]) -> None:
    for h in hooks:
        h.remove()
    hooks.clear()
