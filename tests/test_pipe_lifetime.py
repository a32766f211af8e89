"""A dropped Pipeline is freed at once, with its groups' gloo threads: no part of it may be in a cycle.

    rank: pipe = Pipeline(...) ... run ... return         (a training script's function)
          dist.destroy_process_group()                   (its finally)
          exit

A Pipeline in a reference cycle outlives its function until a garbage collection, and keeps its
groups' gloo backends, with their worker threads, alive past ``destroy_process_group``. The first
collection may then be the interpreter's own, as it finalizes. A gloo worker still releasing the
last collective's work then (it holds tensors whose Python objects need the GIL) is ended by
CPython, and the process aborts after a run that succeeded ("terminate called without an active
exception", exit status -6; seen under torchrun, 1 run in 5 on a loaded host). So every Pipeline
here, whatever it ran (a step that failed too), is checked to be freed with the garbage collector
off; and after a Pipeline on a group of its own is dropped and that group destroyed, the process has
no more threads than before the group was made. (The mesh of replicated pipelines outlives them by
design, until its world is destroyed: test_mesh.py.)
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from partitioner import partition, profile
from pipeline import checkpointing
from pipeline.plan import Plan
from pipeline.reference.graph_models import gpt_tied
from pipeline.reference.models import gpt_loss
from pipeline.runtime.inputs.varlen import VarLen
from pipeline.runtime.pipe import Pipeline
from tests.dist import job
from tests.pipe_common import BATCH, M, balance_of, build

_THREADS_S = 5.0  # how long the dropped Pipeline's watchdog thread may take to stop (it wakes every 50 ms)


# a case's Pipeline's parts by name, and its model, which the caller keeps (as a script keeps its
# model after its Pipeline): what the model holds (gradient hooks) must not hold the Pipeline either
Ran = tuple[list[tuple[str, Any]], nn.Module]


def _parts(pipe: Pipeline) -> list[tuple[str, Any]]:
    """The Pipeline and the parts that hold its groups, by name."""
    parts: list[tuple[str, Any]] = [("Pipeline", pipe), ("executor", pipe.executor)]
    if pipe.runner.eval_executor is not None:
        parts.append(("evaluation executor", pipe.runner.eval_executor))
    comms = [("", pipe.comm)] if pipe.comm is not None else []
    if pipe._replicas is not None:  # the replicas' group: the gradient reducer's
        comms += [("replicas' ", pipe._replicas.comm)]
        parts.append(("gradient reducer", pipe._replicas.reducer))
    comms += [(f"tied weight's {ranks} ", comm) for comm, ranks, _ in pipe.tied._groups]
    for which, comm in comms:
        parts += [(f"{which}Comm", comm), (f"{which}transport", comm.transport)]
    return parts


def _sequential(schedule: str, v: int, recompute: str, dp: int, folder: str | None) -> Ran:
    """Every call a training script makes, on an nn.Sequential."""
    name = "gpt" if recompute == "always" else "mlp"
    model, x, y, loss_fn = build(name)
    p = dist.get_world_size() // dp
    plan = Plan(balance=balance_of(len(model), p * v), schedule=schedule, n_microbatches=M, n_virtual=v,
                recompute=recompute, dp=dp)  # fmt: skip
    pipe = Pipeline(model, plan, loss_fn=loss_fn, timeout=60.0)
    rows = slice(pipe.replica * (BATCH // dp), (pipe.replica + 1) * (BATCH // dp))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    pipe.step(x[rows], y[rows], prefetch=(x[rows], y[rows]))
    pipe.step(x[rows], y[rows])
    pipe.clip_grad_norm_(1.0)
    pipe.grads_finite()
    opt.step()
    pipe.evaluate(x[rows], y[rows], return_outputs=True)
    pipe.predict(x[rows])
    pipe.gather_state_dict()
    if folder is not None:
        checkpointing.save(folder, 1, pipe=pipe, optimizer=opt)
    return _parts(pipe), model


def _traced(plan_json: str) -> Ran:
    """A traced model with a tied weight across ranks (graph stages, the tie's group)."""
    model, x, y, loss_fn = _gpt_tied()
    pipe = Pipeline(model, Plan.from_json(plan_json), loss_fn=loss_fn, timeout=60.0)
    pipe.step(x, y)
    pipe.clip_grad_norm_(1.0)
    pipe.evaluate(x, y)
    return _parts(pipe), model


def _varlen() -> Ran:
    """Sequences of several lengths, packed per step (the runner's packing state)."""
    model, _, _, loss_fn = build("gpt")
    balance = balance_of(len(model), dist.get_world_size())
    pipe = Pipeline(
        model, balance, n_microbatches=M, loss_fn=loss_fn, varlen=VarLen(token_budget=64), timeout=60.0
    )
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 16, (n,), generator=gen) for n in (3, 8, 5, 2, 7, 4)]
    ys = [torch.randint(0, 16, (len(x),), generator=gen) for x in xs]
    pipe.step(xs if pipe.needs_inputs else None, ys if pipe.needs_targets else None)
    return _parts(pipe), model


def _failed(group: Any) -> Ran:
    """A step that failed: the last rank's loss raises, the other rank gets a PeerFailure; each catches
    its error (a group of their own: the failure closes its connections)."""
    model, x, y, _ = build("mlp")

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a failure planted in the loss")

    plan = Plan(balance=balance_of(len(model), dist.get_world_size()), n_microbatches=M)
    pipe = Pipeline(model, plan, loss_fn=loss_fn, group=group, timeout=60.0)
    with pytest.raises(RuntimeError):  # PeerFailure on the first rank
        pipe.step(x, y)
    return _parts(pipe), model


def _gpt_tied() -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    torch.manual_seed(0)
    model, x = gpt_tied(vocab_size=16, width=16, n_layers=4, n_heads=2, max_seq_len=8, batch_size=BATCH)
    return model, x, torch.randint(0, 16, x.shape), gpt_loss


def _freed(cases: list[tuple[str, Any, tuple[Any, ...]]]) -> dict[str, list[str]]:
    """Per case: the parts of its Pipeline still alive once the function that ran it returned, with
    the garbage collector off (none, when nothing is in a cycle)."""
    gc.collect()
    gc.disable()
    try:
        out = {}
        for name, fn, args in cases:
            parts, model = fn(*args)
            refs = [(part, weakref.ref(obj)) for part, obj in parts]
            del parts
            out[name] = [part for part, ref in refs if ref() is not None]
            del model
        return out
    finally:
        gc.enable()


def _threads() -> int:
    """This process's threads, native ones included (gloo's are not Python threads)."""
    return len(os.listdir("/proc/self/task"))


def _settled_threads() -> int:
    """The thread count once it held still for 0.2 s (at most ``_THREADS_S``)."""
    deadline = time.monotonic() + _THREADS_S
    count, since = _threads(), time.monotonic()
    while time.monotonic() - since < 0.2 and time.monotonic() < deadline:
        time.sleep(0.01)
        if _threads() != count:
            count, since = _threads(), time.monotonic()
    return count


def _threads_end_with_the_group() -> tuple[int, int]:
    """(threads before a group of its own was made, threads once a Pipeline on it was dropped and the
    group destroyed)."""
    gc.collect()
    before = _settled_threads()  # the last case's watchdog thread may still be stopping
    group = dist.new_group(backend="gloo")
    model, x, y, loss_fn = build("mlp")
    plan = Plan(balance=balance_of(len(model), dist.get_world_size()), n_microbatches=M)
    pipe = Pipeline(model, plan, loss_fn=loss_fn, group=group, timeout=60.0)
    pipe.step(x, y)
    pipe.clip_grad_norm_(1.0)  # a collective on the group last, as a script's last step ends
    gc.disable()  # the Pipeline must go with its last reference, not with a collection
    try:
        del pipe
        dist.destroy_process_group(group)
        del group
        deadline = time.monotonic() + _THREADS_S
        while _threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        return before, _threads()
    finally:
        gc.enable()


def _two_ranks(folder: str, traced_plan: str) -> dict[str, Any]:
    cases = [
        ("1f1b", _sequential, ("1f1b", 1, "never", 1, folder)),
        ("interleaved-zb, recompute always", _sequential, ("interleaved-zb", 2, "always", 1, None)),
        ("zb-v", _sequential, ("zb-v", 2, "never", 1, None)),
        ("traced, tied weight", _traced, (traced_plan,)),
        ("variable lengths", _varlen, ()),
    ]
    group = dist.new_group(backend="gloo")
    cases.append(("a step that failed", _failed, (group,)))
    freed = _freed(cases)
    dist.destroy_process_group(group)
    return {"freed": freed, "threads": _threads_end_with_the_group()}


def _emulated() -> dict[str, Any]:
    return {"freed": _freed([("nccl-emulated 1f1b", _sequential, ("1f1b", 1, "never", 1, None))])}


def _four_ranks() -> dict[str, Any]:
    cases = [
        ("dp=2 1f1b", _sequential, ("1f1b", 1, "never", 2, None)),
        ("dp=2 interleaved-1f1b", _sequential, ("interleaved-1f1b", 2, "never", 2, None)),
    ]
    return {"freed": _freed(cases)}


def _two_ranks_args(factory: pytest.TempPathFactory) -> tuple[str, str]:
    model, x, _, _ = _gpt_tied()
    prof = profile(model, x[: BATCH // 2], warmup=0, repeat=1)
    plan = partition(model, 2, x[: BATCH // 2], profile=prof, cost="flops", n_microbatches=2)
    return str(factory.mktemp("lifetime")), plan.to_json()


_TWO = job(2, _two_ranks, make_args=_two_ranks_args, timeout=120.0, batch="c")
_EMULATED = job(2, _emulated, backend="nccl-emulated", timeout=60.0, batch="c")
_FOUR = job(4, _four_ranks, timeout=120.0, batch="b")


@pytest.mark.parametrize(
    "ranks", [_TWO, _EMULATED, _FOUR], ids=["2-ranks", "2-ranks-nccl-emulated", "4-ranks-dp"]
)
def test_a_pipeline_is_freed_with_its_last_reference_whatever_it_ran(
    tmp_path_factory: pytest.TempPathFactory, ranks: Any
) -> None:
    for rank, result in enumerate(ranks.results(tmp_path_factory)):
        assert result["freed"], rank
        for case, alive in result["freed"].items():
            assert alive == [], f"rank {rank}, {case}: {alive} outlived the function that ran it (a cycle)"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_destroying_the_group_of_a_dropped_pipeline_ends_its_threads(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    for rank, result in enumerate(_TWO.results(tmp_path_factory)):
        before, after = result["threads"]
        assert after <= before, (
            f"rank {rank}: {before} threads before the group, {after} after it was destroyed"
        )
