"""``Pipeline``: a model cut into stages over the ranks of a process group, trained one step at a time.

    # p: ranks, v: virtual stages per rank, m: micro-batches, i: a micro-batch, s: stage, B: batch rows

    plan = partition(model, 4, sample, schedule="1f1b", n_microbatches=8)   # or Plan(balance=[...], ...)
    pipe = Pipeline(model, plan, loss_fn=F.cross_entropy)    # on every rank
    opt = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(x, y)                   # the batch's mean loss, on every rank
    pipe.clip_grad_norm_(1.0)                # the norm over every stage's gradients
    opt.step(); opt.zero_grad()
    loss, logits = pipe.evaluate(x, y, return_outputs=True)   # eval mode, no autograd
    logits = pipe.predict(x)                 # the model's output for the whole batch
    state = pipe.gather_state_dict()         # the whole model's state dict on rank 0

The plan says the balance, schedule, m, v and recomputation mode; a plain
balance list with those as keywords works too (see options.py). Stage s
(``balance[s]`` consecutive layers of the ``nn.Sequential``) lives on rank
s % p. Only this rank's stages are kept.

Any other module works with a plan that ``partition`` made by tracing it: each
rank traces the model again (a meta-device model costs no memory), checks it
against the plan's graph, and builds its stages as graphs over the model's own
submodules (graph_stages.py, traced.py), passing every tensor live across a
cut; parameter names stay the model's (``blocks.3.attn.qkv.weight``). A
parameter several stages hold (a head tied to the embedding) is kept by each
rank that uses it: the copies start equal, their gradients are summed after
each step's backward, after the replicas' reduction (ties.py), so the optimizer
keeps them equal; ``clip_grad_norm_`` counts the weight once and
``gather_state_dict`` holds it once, by its first name::

    model = TiedGPT(...)                         # tok, pos, blocks in a loop, norm, head = tok
    plan = partition(model, 4, sample, loss_fn=gpt_loss, target=y0)
    pipe = Pipeline(model, plan, loss_fn=gpt_loss)

What a step computes. The batch's B rows are split into m micro-batches as
evenly as possible (any B >= m; the first B % m get one row more), and
micro-batch i's loss is weighted by rows_i / B (1/m when m divides B).
``step`` leaves in ``.grad`` the gradient of that weighted sum and returns the
sum: for a ``loss_fn`` that is a mean over rows (``F.cross_entropy``'s and
``F.mse_loss``'s default), the batch's mean loss and its gradient, as one
process computes them on the whole batch. What differs is what differs with
gradient accumulation, since every layer sees one micro-batch at a time:
BatchNorm normalises with each micro-batch's statistics, not the batch's, and
updates its running statistics m times per step (``num_batches_tracked`` grows
by m); a loss that is not a mean over rows (``reduction="sum"``) is weighted
all the same; and dropout draws its masks from each rank's own generator.
Gradients accumulate across steps as usual: call ``opt.zero_grad()`` between
steps.

Outputs. ``predict(x)`` and ``evaluate(x, y, return_outputs=True)`` run only
the forwards (eval mode, autograd off, modes restored) and return the last
stage's outputs concatenated in micro-batch order, which is the batch's row
order: ``model(x)`` of one process in eval mode. They reach every rank, or only
rank ``dst`` (None elsewhere; ``dst=pipe.last_loss_rank``, the last stage's
rank, which holds the targets too, moves nothing); see outputs.py.

Data only where it is used. Stage 0's rank needs the inputs
(``pipe.needs_inputs``), the last stage's rank the targets
(``pipe.needs_targets``); other ranks pass None, a middle rank just calls
``pipe.step()``. A data loader then runs only where its batches are used, and
the next batch's host-to-device copy can start early:

    uses_data = pipe.needs_inputs or pipe.needs_targets
    batches = iter(loader) if uses_data else itertools.repeat((None, None))   # middle: nothing
    batch = next(batches)
    for t in range(n_steps):                                   # the same count on every rank
        following = next(batches) if t + 1 < n_steps else None
        loss = pipe.step(*batch, prefetch=following)           # unused inputs / targets are ignored
        batch = following

``prefetch=(x_next, y_next)`` queues that batch's copy (pinned, non_blocking,
on the copy stream) once this step's own inputs are on their way, so that it
overlaps this step's compute; the next ``step`` / ``evaluate`` / ``predict``
given the same objects (``is``) uses the copy, and compute waits for it only
then (an event, no host sync). Other objects are copied as usual. On a CPU
device there is nothing to copy; the values are the same either way.

bf16. Wrap the calls that run the model (``step``, ``evaluate``, ``predict``)
in the same ``torch.autocast`` on every rank (a rank that differs fails the
step, naming both states), and partition for that precision, so that the plan
comes from bf16 timings and sizes (``partition`` sets the precision itself:
call it outside the region, with ``autocast=``)::

    plan = partition(model, p, sample, autocast=torch.bfloat16, ...)
    ...
    with torch.autocast("cuda", dtype=torch.bfloat16):     # "cpu" on a CPU run
        loss = pipe.step(x, y)                              # evaluate, predict alike

Parameters, gradients and optimizer state stay fp32; the tensors between
stages and the outputs are bf16 where autocast makes them so.

Replicas (data parallelism). A plan with ``dp`` > 1 runs dp copies of the
pipeline on a world of dp x p ranks, each on its own batch::

    plan = partition(model, 2, sample, schedule="1f1b", n_microbatches=8, dp=2)   # 4 ranks
    pipe = Pipeline(model, plan, loss_fn=F.cross_entropy)   # or mesh=init_device_mesh(..., ("dp", "pp"))
    loss = pipe.step(x_local, y_local)     # this replica's rows; the global mean loss, on every rank
    opt = ZeroRedundancyOptimizer(pipe.parameters(), torch.optim.AdamW, process_group=pipe.dp_group)

Global rank g = d * p + r holds pipeline rank r of replica d (``pipe.mesh``, a
DeviceMesh with dims ("dp", "pp"); ``pipe.pp_group`` / ``pipe.dp_group``;
``pipe.rank`` is r and ``pipe.replica`` d; see mesh.py for why pp is
innermost). At construction the replicas check that they run the same plan
and model, then take replica 0's parameters and buffers. In ``step`` each
stage's gradients are all-reduced over the "dp" group in buckets of
``bucket_mb`` that start during the stage's last backward (dp.py) and are
waited for before ``step`` returns: ``.grad`` is then, on every rank, what one
process computes on all replicas' rows together (each replica weighted by its
rows), and ``clip_grad_norm_`` / ``grads_finite`` count each parameter once
over the whole world. ``evaluate``'s loss is the global mean too; ``predict``,
``gather_state_dict`` and timelines are each replica's own. With dp = 1 and no
mesh nothing of this exists (``mesh`` and ``dp_group`` are None).

Stages larger than a device. A plan with ``shard`` > 1 or ``tp`` > 1 runs on the mesh
("dp_replicate", "dp_shard", "pp", "tp") of dp x shard x p x tp ranks (replicas/mesh.py): each stage
is wrapped with FSDP2's ``fully_shard`` on "dp_shard" (replicas/sharded.py: ZeRO-2 gathers it once per
step, ZeRO-3 per use; gradients reduce-scattered once, after its last backward), and split over "tp"
by ``parallelize_fn(stage_module, tp_mesh)`` (tensor/parallel.py; ``pipeline.parallelize_llama``)::

    plan = partition(model, 2, sample, shard=2, tp=2)         # 8 ranks
    pipe = Pipeline(model, plan, loss_fn=lm_loss, parallelize_fn=pipeline.parallelize_llama)
    loss = pipe.step(x[rows], y[rows])      # rows: data rank pipe.replica of pipe.dp (= dp x shard)

Parameters are then DTensors (``.full_tensor()`` gathers one); ``clip_grad_norm_``, ``grads_finite``,
``gather_state_dict``, checkpoints and ``load_pretrained`` take them as they are.

A failure on any rank (bad input, an exception in a stage, a timeout) is
published in the group's store before it is raised, and the other ranks, which
watch for it whenever they wait, raise within a fraction of a second, naming
the failed rank and the action they were waiting for (see p2p.py). A rank
killed without a word (SIGKILL, the OOM killer) is named by the peer that
notices, from its process being gone (watchdog.py). Every rank must call
``step`` / ``evaluate`` / ``predict`` in the same order: the step header
carries each call's kind and number, so a rank in another call fails at once,
naming both (metadata.py).

Devices. The stages live on the communication device unless ``device`` says
otherwise: this rank's CUDA device on NCCL, the CPU on gloo (a CPU run on a
GPU host never touches CUDA). Inputs are copied there by the executor (pinned
memory, a copy stream, ``non_blocking``); the loss, flags, norms and outputs
are made on it by the ``Comm``. Under the NCCL emulation
(``STAGEWISE_EMULATE_NCCL``) ``step``, ``evaluate``, ``predict``,
``clip_grad_norm_`` and ``grads_finite`` run with the default device set to
meta, so that a tensor made without an explicit device fails at once, as it
would on NCCL.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline import nccl_env
from pipeline.plan import Plan
from pipeline.runtime.comm import emulation, world
from pipeline.runtime.comm.agree import agree, summary
from pipeline.runtime.comm.arrival import arrive, creating
from pipeline.runtime.comm.p2p import Comm, PeerFailure, PipelineTimeout, world_store
from pipeline.runtime.comm.transport import process_group, transport_class
from pipeline.runtime.inputs import pretrained
from pipeline.runtime.inputs.microbatch import Batch
from pipeline.runtime.inputs.varlen import Packed, VarLen, step_costs
from pipeline.runtime.options import check_group, check_model, resolve
from pipeline.runtime.replicas import replicas
from pipeline.runtime.replicas.dp import DEFAULT_BUCKET_MB, Reduction, check_bucket_mb
from pipeline.runtime.replicas.gather import gather_state_dict
from pipeline.runtime.replicas.mesh import COMPOSED
from pipeline.runtime.step import grads, memory
from pipeline.runtime.step.compiled import CompileSpec, check_compile_plan
from pipeline.runtime.step.executor import Executor
from pipeline.runtime.step.metadata import begin_call
from pipeline.runtime.step.stage import LossFn, StageRuntime
from pipeline.runtime.step.steps import Inputs, StepRunner
from pipeline.runtime.tensor.parallel import ParallelizeFn, parallelize_stages
from pipeline.runtime.trace.graph_stages import plan_stages
from pipeline.runtime.trace.materialize import unset_message
from pipeline.runtime.trace.ties import TiedGrads
from pipeline.runtime.trace.tracing import first_names, is_constant
from pipeline.schedules.program import tie_groups
from pipeline.schedules.schedule import Schedule
from pipeline.schedules.timeline import Timeline
from pipeline.schedules.validate import validate

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
    ``init_fn``; a parameter or buffer that neither sets is an error naming it
    (materialize.py). ``model`` is an ``nn.Sequential``, or any module with a
    plan ``partition`` made for it (see the module docstring). ``mesh``: a
    DeviceMesh over the world with dims "dp" and "pp" for a replicated plan, or
    ("dp_replicate", "dp_shard", "pp", "tp") for a composed one (default: made
    from the plan when it has dp, shard or tp > 1);
    ``group`` is then not given. ``bucket_mb``: the size of the gradient
    all-reduce's buckets across replicas. ``parallelize_fn(stage_module, tp_mesh)``: with a plan of
    ``tp`` > 1, splits each local stage over its tensor-parallel ranks (see the module docstring).
    ``compile``: each layer of the stages through ``torch.compile`` (True: its defaults, a backend's
    name, or a dict of its keywords; step/compiled.py); the gradients are those of eager.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan | Sequence[int],
        *,
        loss_fn: LossFn | None,
        schedule: str | Schedule | None = None,
        n_microbatches: int | None = None,
        n_virtual: int | None = None,
        recompute: str | None = None,
        checkpoint: str | None = None,
        group: Any = None,
        mesh: Any = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        init_fn: Callable[[nn.Module], None] | None = None,
        varlen: VarLen | None = None,
        parallelize_fn: ParallelizeFn | None = None,
        compile: CompileSpec = False,
    ) -> None:
        options = resolve(
            plan,
            schedule=schedule,
            n_microbatches=n_microbatches,
            n_virtual=n_virtual,
            recompute=recompute,
            checkpoint=checkpoint,
            compile=compile,
        )
        check_model(model, options.balance, options.plan)
        if loss_fn is None:
            raise ValueError("loss_fn is required: pass loss_fn=f with f(output, target) -> scalar tensor")
        bucket_mb = check_bucket_mb(bucket_mb)
        distributed = dist.is_available() and dist.is_initialized()
        # on the NCCL path every group and communicator is made after all its ranks arrived (arrival.py)
        nccl = distributed and transport_class(dist.get_backend(group)).nccl
        pg = group if group is not None else dist.group.WORLD
        members = tuple(dist.get_process_group_ranks(pg)) if nccl else ()
        arrived = None  # the ranks that arrived, whose creation guard watches the communicators made next
        if nccl:
            nccl_env.check(_nccl_version())  # a LazyConnectWarning where NCCL may connect inside a step
            arrived = arrive(world_store(), members, dist.get_rank(), timeout, "the Pipeline's construction")
        dp = options.plan.dp if options.plan is not None else None if mesh is not None else 1
        shard = options.plan.shard if options.plan is not None else 1
        tp = options.plan.tp if options.plan is not None else 1
        self.zero = options.plan.zero if options.plan is not None else 2
        composed = shard > 1 or tp > 1 or tuple(getattr(mesh, "mesh_dim_names", None) or ()) == COMPOSED
        p = options.schedule.n_ranks
        with creating(arrived, "the pipeline's mesh and groups"):
            if composed:
                groups = replicas.resolve_composed(dp or 1, shard, p, tp, group, mesh, distributed, timeout)
            else:
                groups = replicas.resolve(dp, p, group, mesh, distributed, timeout)
        self.shard, self.tp = shard, tp
        check_compile_plan(options.compile, shard, tp)
        check_group(options, distributed, dist.get_world_size(groups.pp) if distributed else 1)
        self.plan: Plan | None = options.plan  # None when a Schedule object was given
        self.balance, self.schedule, self.recompute = options.balance, options.schedule, options.recompute
        self.n_microbatches = self.schedule.n_microbatches
        self.mesh, self.pp_group, self.dp_group = groups.mesh, groups.pp, groups.dp
        self.dp = groups.layout.dp if groups.layout is not None else 1
        self.replica = groups.layout.replica if groups.layout is not None else 0
        self.rank = dist.get_rank(groups.pp) if distributed else 0
        # a mesh spans the world: its pipelines' keys are counted there
        self._prefix = _store_prefix(None if self.mesh is not None else group, distributed)
        failure = (world_store(), f"{self._prefix}/failed") if self.mesh is not None else None
        pipelines = groups.layout.pipelines if groups.layout is not None else None
        self.comm: Comm | None = None
        if distributed:
            named = self.mesh is not None  # errors name global ranks
            with creating(arrived, "the pipeline's channels and communicators"):
                self.comm = Comm(groups.pp, self._prefix, timeout, failure=failure, pipelines=pipelines,
                                 global_names=named)  # fmt: skip
            if arrived is not None:
                arrived.board = self.comm.board
            if nccl:  # checkpoints run on the world group: its communicator, its pairs with rank 0
                with creating(arrived, "the world group's communicator and its pairs with rank 0"):
                    key = (self.comm.board.store, self.comm.board.key)  # the pipeline's failure key
                    world.connect(timeout, key, f"{self._prefix}/world")
        if device is None:  # where the backend communicates: CUDA on NCCL, else the CPU
            device = self.comm.device if self.comm is not None else torch.device("cpu")
        self.device = torch.device(device)
        n_stages = len(self.balance)
        self._stage_ids = self.schedule.stages_of(self.rank)
        shape = options.plan if options.plan is not None else Plan(balance=self.balance)
        self._unset: dict[int, str] = {}  # meta tensors nothing gave values yet: load_pretrained's to fill
        saved = set(model.state_dict(keep_vars=True))  # what a checkpoint of the whole model holds
        names = first_names(model)
        self._state_names = {n: first for n, first in names.items() if n in saved}  # name -> first name
        self._transient = set(names) - saved  # non-persistent buffers
        with self._publish_failure():  # a rank that cannot build its stages: its peers must not wait
            local, ties = plan_stages(model, shape, self._stage_ids, self.device, init_fn, self._unset)
        if (shard > 1 or tp > 1) and ties:
            raise ValueError(
                f"this plan shards (shard={shard}) or splits (tp={tp}) its stages, but the model ties "
                f"{ties[0].describe()}: a tied weight's copies on several "
                "ranks are not sharded yet; untie it (e.g. a separate head weight), or make the plan with "
                "shard=1 and tp=1"
            )
        # tensors nothing gave values yet, by place: sharding and splitting replace them by DTensors
        places = {
            id(t): (s, name)
            for s, mod in local.items()
            for name, t in itertools.chain(mod.named_parameters(), mod.named_buffers())
            if id(t) in self._unset
        }
        if tp > 1:
            with self._publish_failure():
                traced = shape.graph is not None
                parallelize_stages(local, groups.tp_mesh, parallelize_fn, traced)
        elif parallelize_fn is not None:
            raise ValueError(
                "parallelize_fn was given but the plan has tp=1, so nothing would call it; make the plan "
                "with tp > 1 (partition(..., tp=2)) or leave parallelize_fn out"
            )
        self._modules = [local[s] for s in self._stage_ids]
        self.fingerprint = shape.graph.fingerprint if shape.graph is not None else ""  # a traced model
        self.module: nn.Module = self._modules[0] if len(self._modules) == 1 else nn.ModuleList(self._modules)
        self.stages = {
            s: StageRuntime(
                s,
                mod,
                n_stages=n_stages,
                n_microbatches=self.n_microbatches,
                split_backward=self.schedule.split_backward,
                recompute=options.recompute_of(s),
                loss_fn=loss_fn,
                device=self.device,
                compile=options.compile,
            )
            for s, mod in zip(self._stage_ids, self._modules, strict=True)
        }
        self.executor = Executor(self.schedule, self.rank, self.stages, self.comm, self.device, self._prefix)
        # this rank's step as data; the executor runs its computes and messages, the runner its tail,
        # whose collectives every group must run in one order (the validator proves it, ties included)
        tie_stages = [tie.stages for tie in ties]
        if tie_groups(self.schedule.rank_of, tie_stages):  # the schedule was validated without them
            validate(self.schedule, dp=self.dp, ties=tie_stages)
        self.program = self.schedule.program(self.rank, dp=self.dp, ties=tie_stages)
        self._replicas: replicas.Replicas | None = None
        if varlen is not None and not isinstance(varlen, VarLen):
            raise TypeError(f"varlen must be a pipeline.VarLen or None, got {type(varlen).__name__}")
        self.varlen = varlen
        if self.dp > 1:
            assert failure is not None
            modules = dict(zip(self._stage_ids, self._modules, strict=True))
            config = f"{self.schedule.to_text()}|m={self.n_microbatches}|balance={self.balance}"
            with self._publish_failure(), creating(arrived, "the replicas' groups"):
                self._replicas = replicas.Replicas(
                    groups, self._prefix, failure, timeout, modules, self.schedule, self.rank,
                    self.executor, bucket_mb, config, self.zero,
                )  # fmt: skip
            sharded = self._replicas.sharded
            if sharded is not None:
                for st in self.stages.values():
                    st.sharded, st.gathered = True, sharded.gathered
        if places:  # the same places, now holding the DTensors that loads will fill
            now = {
                (s, name): t
                for s, mod in local.items()
                for name, t in itertools.chain(mod.named_parameters(), mod.named_buffers())
            }
            self._unset = {id(now[at]): self._unset[old] for old, at in places.items()}
        params = {(s, name): p for s in self._stage_ids for name, p in local[s].named_parameters()}
        shared = (self.comm.board.store, self.comm.board.key) if self.comm is not None else None
        at = "the tied weights' groups"
        tied_arrived = arrived
        if nccl and self.comm is not None and tie_groups(self.schedule.rank_of, tie_stages):
            tied_arrived = arrive(world_store(), members, dist.get_rank(), timeout, at, self.comm.board)
        with creating(tied_arrived, at):
            self.tied = TiedGrads(
                ties, params, self.schedule.rank_of, self.rank, group=groups.pp, timeout=timeout,
                key_prefix=f"{self._prefix}/ties", failure=shared, pipelines=pipelines,
            )  # fmt: skip
            with self._publish_failure():
                self.tied.sync()  # every copy of a tied weight starts as its lowest rank's
        for made in (arrived, tied_arrived):  # every communicator is made: the creation watches end
            if made is not None:
                made.close()  # a second close of the same one does nothing
        self._agreed = False
        self.measured_peak: int | None = None  # the last step's true peak, when it measured it
        self._gathers = itertools.count()  # gather_state_dict calls: a store key each
        self.runner = StepRunner(
            self.schedule, self.program, self.rank, self.stages, self._modules, self.executor, self.comm,
            self.device, self._prefix, self.tied, self._replicas, self.dp,
            functools.partial(_check_set, self._unset),  # not self.check_values: no cycle through self
        )  # fmt: skip
        if varlen is not None:
            self.runner.varlen = (varlen, step_costs(self.plan, self.schedule))
            self.runner.describer.shape_rules = True
            self.runner.describer.one_row = varlen.documents
        self.last_loss_rank = self.runner.last_loss_rank  # the last stage's rank

    # ---- construction

    def close(self) -> None:
        """Stop this rank's communication thread (also done when the Pipeline's last reference goes:
        no part of it is in a reference cycle, so it keeps no process group alive past
        ``dist.destroy_process_group``).

        Sends still in flight complete first; ``step`` and ``evaluate`` then raise.
        """
        if self.comm is not None:
            self.comm.close()
        if self._replicas is not None:
            self._replicas.close()
        self.tied.close()

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
        """The model's buffers, each once (not the constants a traced graph reads: tracing.is_constant)."""
        seen: set[int] = set()
        for mod in self._modules:
            for name, b in mod.named_buffers():
                if id(b) not in seen and not is_constant(name):
                    seen.add(id(b))
                    yield name, b

    def buffers(self) -> Iterator[torch.Tensor]:
        for _, b in self.named_buffers():
            yield b

    def _grads(self) -> list[torch.Tensor]:
        """The local gradients, each parameter's once (``named_parameters`` skips repeats)."""
        return [p.grad for p in self.parameters() if p.grad is not None]

    def load_pretrained(
        self, path: str | os.PathLike[str], *, prefix: str | None = None, strict: bool = True
    ) -> None:
        """Read this rank's parameters and persistent buffers from safetensors files (pretrained.py).

        ``path``: a ``save_pretrained`` folder (``model.safetensors``, or shards with
        ``model.safetensors.index.json``) or one ``.safetensors`` file. Only this rank's tensors' bytes
        are read (into their storage where it is CPU memory of the file's dtype, else through one
        buffer per tensor); every copy of a tied weight gets the file's one entry.
        ``prefix``: what the model's names have in front of the file's keys (``"model."`` for a
        wrapper holding the transformers model as ``self.model``); found when None. ``strict``: a
        key of the file that names nothing in the model is an error (else skipped). Call it on
        every rank: a rank that fails (a key its stages need is missing) is named on the others; a
        meta-device model's tensors that it fills need no ``init_fn``.
        """
        local = {  # a tied weight's copies on this rank are one tensor (materialize.py): one name
            self._state_names.get(name, name): t
            for mod in self._modules
            for name, t in mod.state_dict(keep_vars=True).items()
        }
        with self._publish_failure():
            pretrained.load(path, local, self._state_names, prefix, strict, self._transient)
        self.note_loaded(local.values())

    def note_loaded(self, tensors: Iterable[torch.Tensor]) -> None:
        """Loaders say which of this rank's tensors they gave values (load_pretrained, checkpointing):
        a meta model's tensors that nothing initialised are refused until then (``check_values``)."""
        for t in tensors:
            self._unset.pop(id(t), None)

    def check_values(self) -> None:
        """Raise a ValueError naming this rank's tensors that a meta-device model's materialisation
        left without values and no load has filled since (step, evaluate, predict, gather_state_dict
        and checkpointing.save call it: they would read uninitialised memory)."""
        _check_set(self._unset)

    def gather_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict (parameters and buffers, the model's names, CPU copies) on rank
        ``dst``, None on the others; call on every rank. Sharded or split stages: full tensors, on
        pipeline rank ``dst`` of each replica's first (shard 0, tp 0) pipeline (gather.py)."""
        world = self.comm.world_size if self.comm is not None else 1
        if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world:
            raise ValueError(f"dst ({dst!r}) must be a rank of the pipeline's group, 0 to {world - 1}")
        local = {s: mod.state_dict() for s, mod in zip(self._stage_ids, self._modules, strict=True)}
        key = f"{self._prefix}/state{next(self._gathers)}"
        with self._publish_failure(), self._stepping():
            self.check_values()
            return gather_state_dict(local, self.comm, dst, key, self._comm_device(), self.mesh)

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
        once = [p.grad for p in self.parameters() if p.grad is not None and self.tied.counted(p)]
        with self._publish_failure(), self._strict_devices(), self._stepping():  # tied copies count once
            total = grads.total_norm(once, norm_type, self.comm, self._comm_device(), self._dp_comm())
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

    def unscale_(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        """``scaler.unscale_(optimizer)`` for the whole pipeline: this rank's gradients divided by
        the scale, and whether any rank's (any replica's) overflowed agreed on every rank, so that
        ``scaler.step(optimizer)`` skips on every rank alike and ``scaler.update()`` backs off alike,
        as one process does. Call on every rank after ``step(..., scaler=scaler)``::

            loss = pipe.step(x, y, scaler=scaler)
            pipe.unscale_(scaler, opt)       # then, as usual:
            pipe.clip_grad_norm_(1.0)
            scaler.step(opt)
            scaler.update()
        """
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        scaler.unscale_(optimizer)
        if not scaler.is_enabled():
            return
        # the scaler's record of this optimizer's overflow, per device (what step() and update() read;
        # torch's own ShardedGradScaler agrees it over ranks the same way)
        state = scaler._per_optimizer_states[id(optimizer)]
        found: dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
        device = self._comm_device()
        with self._publish_failure(), self._strict_devices():
            local = [f.to(device, torch.float32) for f in found.values()]
            flag = torch.stack(local).amax() if local else torch.zeros((), device=device)
            name = "the scaler's overflow flag"
            with self._stepping():
                agreed = grads.any_flag(flag, self.comm, self._dp_comm(), name, "unscale_")
        for d, f in found.items():
            f.copy_(agreed.to(d, f.dtype))
        if not found:  # no gradient here: step() still needs this optimizer's record
            found[device] = agreed

    def grads_finite(self) -> bool:
        """True when no gradient of any stage holds an inf or NaN: the same answer on every rank."""
        gs = self._grads()
        with self._publish_failure(), self._strict_devices(), self._stepping():
            return grads.all_finite(gs, self.comm, self._comm_device(), self._dp_comm())

    # ---- the step

    @property
    def needs_inputs(self) -> bool:
        """True on the rank of stage 0: the only one whose ``inputs`` are used."""
        return self.runner.needs_inputs

    @property
    def needs_targets(self) -> bool:
        """True on the rank of the last stage: the only one whose ``targets`` are used."""
        return self.runner.needs_targets

    def step(
        self,
        inputs: Inputs | None = None,
        targets: Any = None,
        *,
        prefetch: Sequence[Any] | None = None,
        record: bool = False,
        measure_memory: bool = False,
        scaler: torch.amp.GradScaler | None = None,
    ) -> float:
        """One training step over the batch; the batch's mean loss as a float, on every rank.

        ``inputs`` are used on stage 0's rank and ``targets`` on the last stage's
        (``needs_inputs`` / ``needs_targets``); other ranks may pass None. Any
        B >= m rows (see the module docstring); with ``varlen=VarLen(...)``, a list of sequences
        (and of their targets), packed into micro-batches by tokens (varlen.py). ``prefetch=(x_next, y_next)``
        starts the next batch's copy to the device. ``record`` keeps this step's
        measured timeline (see ``timeline`` and ``write_trace``). ``measure_memory``
        counts every tensor storage the step allocates, from allocation to free, so that
        ``memory_stats()["peak"]`` is the true peak on CPU too (transients included; every
        op then pays a Python call: measure, do not train, with it). On CUDA the allocator's
        peak is measured at every step. ``scaler``: a ``torch.amp.GradScaler`` whose scale the
        backward runs with (``scaler.scale(loss)``; the loss returned is unscaled); then
        ``unscale_(scaler, optimizer)`` in place of ``scaler.unscale_(optimizer)``.
        """
        _check_prefetch(prefetch)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
        if not isinstance(measure_memory, bool):
            raise TypeError(f"measure_memory must be True or False, got {measure_memory!r}")
        begin_call(self.comm, "step")
        with self._publish_failure(), self._strict_devices():
            if not self._agreed:
                self._agree()
            if self.device.type == "cuda":  # memory_stats(): this step's peak
                torch.cuda.reset_peak_memory_stats(self.device)
            self.executor.meter.enabled = measure_memory  # counting what is held costs host time
            on = measure_memory and self.device.type != "cuda"
            # the replicas' gradient buckets persist from step to step, .grad set to None or not
            kept = self._replicas.reducer.held() if on and self._replicas is not None else []
            with memory.measured(self, on, kept), self._stepping():
                return self.runner.train(inputs, targets, prefetch, record, scaler)

    def evaluate(
        self,
        inputs: Inputs | None = None,
        targets: Any = None,
        *,
        return_outputs: bool = False,
        dst: int | None = None,
        prefetch: Sequence[Any] | None = None,
    ) -> Any:
        """The batch's mean loss without gradients, on every rank; call it on every rank.

        Runs only the forwards (stage order on each rank), with every stage in eval
        mode and autograd off, then restores the modes. Parameters and ``.grad``
        are untouched; nothing is kept for a backward. With ``return_outputs``:
        ``(loss, outputs)``, the outputs as ``predict`` returns them (on rank
        ``dst`` only when given, None elsewhere).
        """
        if not isinstance(return_outputs, bool):
            raise TypeError(f"return_outputs ({return_outputs!r}) must be True or False")
        loss, outputs = self._forward_only(inputs, targets, "evaluate", return_outputs, dst, prefetch)
        assert loss is not None
        return (loss, outputs) if return_outputs else loss

    def predict(
        self, inputs: Batch | None = None, *, dst: int | None = None, prefetch: Sequence[Any] | None = None
    ) -> Batch | None:
        """The model's output for the whole batch: the last stage's outputs in micro-batch order.

        Like ``evaluate`` (eval mode, no autograd, modes restored, any B >= m rows)
        without a loss: ``inputs`` on stage 0's rank, nothing on the others. The
        outputs (a tensor or tuple of tensors, on the communication device) are
        returned on every rank, or on rank ``dst`` only (None elsewhere). Call it
        on every rank.
        """
        return self._forward_only(inputs, None, "predict", True, dst, prefetch)[1]

    def _forward_only(
        self, inputs: Inputs | None, targets: Any, method: str, outputs: bool, dst: Any, prefetch: Any
    ) -> tuple[float | None, Batch | None]:
        """The forwards of one batch in eval mode: (the loss unless predicting, the outputs if asked)."""
        _check_prefetch(prefetch)
        begin_call(self.comm, method)
        with self._publish_failure(), self._strict_devices():
            if not self._agreed:
                self._agree()
            with self._stepping():
                return self.runner.forward_only(inputs, targets, method, outputs, dst, prefetch)

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

    def _stepping(self) -> contextlib.AbstractContextManager[Any]:
        """Under the NCCL emulation: the inside of a call, where no communicator may be made and no
        collective algorithm or pair connected (everything a call uses was, at construction)."""
        return (
            emulation.stepping() if self.comm is not None and self.comm.emulated else contextlib.nullcontext()
        )

    def _strict_devices(self) -> contextlib.AbstractContextManager[Any]:
        """Under the NCCL emulation: the default device is meta (see the module docstring)."""
        return emulation.strict_devices(self.comm is not None and self.comm.emulated)

    def _agree(self) -> None:
        """At the first step: every rank runs the same schedule, micro-batch count and balance."""
        if self.comm is not None and self.comm.world_size > 1:
            traced = f" (traced graph {self.fingerprint})" if self.fingerprint else ""
            mine = f"{self.schedule.to_text()}|m={self.n_microbatches}|balance={self.balance}{traced}"
            mine += f"|{self.varlen}" if self.varlen is not None else ""
            differs = agree(self.comm, f"{self._prefix}/config", mine)
            if differs is not None:
                q, theirs = differs
                raise ValueError(
                    f"ranks disagree about the pipeline: rank {self.rank} has {summary(mine)}, rank {q} "
                    f"has {summary(theirs)}; build the Pipeline with the same schedule, n_microbatches "
                    "and balance on every rank: make the plan once and give every rank that Plan "
                    "(e.g. partition before pipeline.launch(fn, p, plan)), rather than on each rank"
                )
            self.comm.board.learn_peers()  # every rank built its Comm: their processes, to name a dead one
        self._agreed = True

    def _dp_comm(self) -> Comm | None:
        return self._replicas.comm if self._replicas is not None else None

    def _comm_device(self) -> torch.device:
        """Where flags, norms and the loss travel: the Comm's device (the stages' one alone)."""
        return self.comm.device if self.comm is not None else self.device

    # ---- measurements of the last step

    @property
    def last_packing(self) -> Packed | None:
        """The last variable-length call's packing where this rank made it (stage 0's rank and the
        last stage's): its micro-batches' sequences in run order, padding and planning seconds."""
        return self.runner.last_packing

    @property
    def busy_time(self) -> float:
        """Seconds this rank spent in compute actions in the last step: GPU time from CUDA events
        on a GPU (a device synchronisation), host time on CPU."""
        return self.executor.busy

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """This rank's memory in the last ``step`` (bytes; see ``pipeline.runtime.step.memory``).

        ``peak``: the most bytes alive at once: on CUDA the allocator's peak; on CPU, after
        ``step(..., measure_memory=True)``, every tensor storage alive (parameters, buffers,
        gradients, optimizer state when ``optimizer`` is given, and all the step allocated,
        transients included); None after other CPU steps. ``source`` says which.
        ``counted_peak`` (after a step that measures): parameters + buffers + gradients +
        optimizer state + ``activations``, the most bytes held for backward at once (saved
        tensors, kept stage inputs and outputs, transfer buffers; each storage once), without
        transients. ``allocator_peak`` and
        ``allocated``: the CUDA allocator's (None on CPU); ``held``: per local stage, the most
        micro-batches whose activations it held at once.
        """
        return memory.memory_stats(self, optimizer)

    def peak_activations(self) -> dict[int, int]:
        """Per local stage: the most micro-batches whose activations it held at once in the last step."""
        return {s: st.peak for s, st in self.stages.items()}

    def reductions(self) -> list[Reduction]:
        """The gradient all-reduce's buckets in the last ``step(record=True)``: when each was launched
        and when its wait ended (wall clock, as ``timeline``'s); empty without replicas."""
        return list(self._replicas.events) if self._replicas is not None else []

    def timeline(self) -> Timeline:
        """This rank's events of the last ``step(record=True)``: compute, sends posted, receive waits."""
        return Timeline(list(self.executor.events), self.schedule.n_ranks)

    def gather_timeline(self) -> Timeline | None:
        """Every rank's events in one Timeline on the pipeline's rank 0 (each replica's, in a mesh; None
        elsewhere); call on every rank."""
        events, group = self.executor.events, self.comm.group if self.comm is not None else None
        if self.comm is None or self.comm.world_size == 1:
            return self.timeline()
        gathered: list[Any] = [None] * self.comm.world_size
        what = "the timelines' all-gather (gather_timeline)"
        with self._stepping():
            if self.comm.emulated:  # torch posts it: checked as if posted here
                emulation.uses(process_group(group), self.comm.world_size, dist.get_rank(), what)
            # an all-gather, not a gather: ProcessGroupNCCL sends a gather's parts to the root as
            # messages, each pair's first connecting it here; a collective's algorithms were connected
            # when the group's communicator was made (NCCL_RUNTIME_CONNECT=0)
            dist.all_gather_object(gathered, events, group=group)
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


def _check_set(unset: dict[int, str]) -> None:
    """``Pipeline.check_values`` on its record of unset tensors."""
    if unset:
        raise ValueError(unset_message(list(unset.values())))


def _nccl_version() -> tuple[int, ...] | None:
    """The NCCL torch was built with, None where unknown (a CPU build: the emulation)."""
    try:
        return tuple(int(v) for v in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
    except Exception:
        return None


def _check_prefetch(prefetch: object) -> None:
    if prefetch is not None and not (isinstance(prefetch, tuple | list) and len(prefetch) == 2):
        got = f"{type(prefetch).__name__} of {len(prefetch)}" if isinstance(prefetch, tuple | list) else ""
        raise TypeError(
            f"prefetch must be the next call's (inputs, targets) pair, e.g. prefetch=(x_next, y_next) "
            f"(None for what this rank does not use; a DataLoader's [x, y] batch will do), or None; got "
            f"{got or type(prefetch).__name__}"
        )


def _store_prefix(group: Any, distributed: bool) -> str:
    """This Pipeline's store keys: the n-th Pipeline on the group's ranks."""
    members: tuple[int, ...] = ()
    if distributed:
        members = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    return f"stagewise/pipe{next(_instances.setdefault(members, itertools.count()))}"
