"""Data parallelism over pipeline replicas: how much of the gradient all-reduce the schedule hides.

    python scripts/bench_dp.py                       # dp = 2 x 2 pipeline ranks: 4 processes, ~3 min
    python scripts/bench_dp.py --bucket-mb 25 --json runs/dp.json
    python scripts/bench_dp.py --workload linear --layers 8 --bucket-mb 25 --steps 12 --warmup 6

    # p = 2 ranks per pipeline, dp = 2 replicas, m micro-batches, B rows per replica

In the same 4 processes (gloo, one intra-op thread each), one step of each run in
turn, so that a load spike hits them all. Every replica trains on its own B rows,
the same B in every run:

    ours dp=1     our pipeline on each replica's rows, no reduction (two pipelines side by side)
    (a) overlap   ours, dp = 2: each stage's buckets launched during its last backward
    (b) after     ours dp=1, then the same buckets all-reduced once the step is done (the naive way)
    torch dp=1    torch.distributed.pipelining, Schedule1F1B, no reduction
    (c) torch+DDP torch.distributed.pipelining stages wrapped in DistributedDataParallel, as torchtitan
                  composes them (DDP reduces during the last micro-batch's backward)
    all-reduce    our buckets alone, launched and waited with no compute: what there is to hide

A step's time runs from a barrier to the last rank's end. The all-reduce costs a run
its step time minus its dp=1 run's, and the share hidden is
``1 - (T_run - T_dp1) / T_allreduce``.

``--methods a`` measures only (a), with its baseline and the all-reduce alone.

The host is kept from adding noise larger than the all-reduce, for every run alike: Python's garbage
collector runs between steps, not during them (as torchtitan's training loop does); the ranks keep
freed memory in the heap (glibc's ``MALLOC_MMAP_THRESHOLD_``) as a GPU's caching allocator does; and
the timed layers' backward hands autograd the same zeros every time (see ``TimedLayer``): a fresh
9.4 MB of zeros per layer and micro-batch fragmented the heap, and in one step in three of (a) the
ranks page-faulted 10-60 MB in anew, 100-250 ms slower.

Workloads: ``timed`` (the default), layers with the parameters of a Linear(width, width)
(at width 1536, 9.4 MB of fp32 gradients each, 8 per stage) that sleep their forward and backward
(``--fwd-ms``, ``--bwd-ms``) and leave the cores free, as an accelerator leaves the host while it
computes: what the schedule can hide, apart from a host's contention; ``linear``, real
Linear(width, width) layers, whose compute needs the same CPU cores as gloo's reduction.

What no schedule hides: the first stage's last gradients are final at the very end of the step (its
last backward is the rank's last action), so its last bucket is reduced after everything else, about
1 / (layers per stage) of the all-reduce with a bucket per layer, 2 / (layers per stage) with 25 MB
buckets of two: a quarter by default.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, uninstalled

from pipeline.launch import launch
from pipeline.plan import Plan
from pipeline.runtime.comm.p2p import Comm
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.replicas.dp import GradReducer, assign_parameters, reduction_points

__all__ = ["main"]

P, DP = 2, 2
RUNS = ("ours dp=1", "(a) overlap", "(b) after", "torch dp=1", "(c) torch+DDP", "all-reduce")
METHODS = {"a": "(a) overlap", "b": "(b) after", "c": "(c) torch+DDP"}
BASELINE = {"(a) overlap": "ours dp=1", "(b) after": "ours dp=1", "(c) torch+DDP": "torch dp=1"}


@dataclass(frozen=True)
class Config:
    width: int = 1536
    layers: int = 16
    rows: int = 8  # per micro-batch
    m: int = 4
    steps: int = 16
    warmup: int = 8
    bucket_mb: float = 5.0  # one layer's 9.4 MB per bucket, for (a), (b) and (c) alike
    workload: str = "timed"
    fwd_ms: float = 10.0
    bwd_ms: float = 20.0
    methods: str = "abc"  # which of (a), (b), (c); their dp=1 baselines and the all-reduce always run

    @property
    def runs(self) -> tuple[str, ...]:
        """The runs measured, in RUNS order."""
        chosen = {METHODS[k] for k in self.methods} | {"all-reduce"}
        chosen |= {BASELINE[name] for name in chosen if name in BASELINE}
        return tuple(name for name in RUNS if name in chosen)


class _Sleep(torch.autograd.Function):
    """x -> x, sleeping ``t_f``; backward sleeps ``t_b`` and gives the weight ``grad_w`` (zeros, kept)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, grad_w: torch.Tensor, t_f: float, t_b: float
    ) -> torch.Tensor:
        time.sleep(t_f)
        ctx.t_b, ctx.grad_w = t_b, grad_w
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        time.sleep(ctx.t_b)
        return grad, ctx.grad_w, None, None, None


class TimedLayer(nn.Module):
    """As many parameters as Linear(width, width), costing ``t_f`` / ``t_b`` of sleep, no CPU.

    Its backward returns the same zeros every time (autograd copies them into a fresh ``.grad`` and
    adds them in place after): a fresh 9.4 MB tensor per layer and micro-batch made the host allocate
    and fill memory that an accelerator's compute would have produced on the device.
    """

    def __init__(self, width: int, t_f: float, t_b: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width * (width + 1)))
        self.grad_w = torch.zeros_like(self.weight)  # not a buffer: not state, not broadcast
        self.t_f, self.t_b = t_f, t_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Sleep.apply(x, self.weight, self.grad_w, self.t_f, self.t_b)  # type: ignore[no-untyped-call]
        return out


_TIMED_WIDTH = 16  # the timed workload's activations: small messages


def _model(cfg: Config) -> nn.Sequential:
    torch.manual_seed(0)
    if cfg.workload == "timed":
        t_f, t_b = cfg.fwd_ms / 1e3, cfg.bwd_ms / 1e3
        return nn.Sequential(*[TimedLayer(cfg.width, t_f, t_b) for _ in range(cfg.layers)])
    layers = [nn.Sequential(nn.Linear(cfg.width, cfg.width), nn.Tanh()) for _ in range(cfg.layers)]
    return nn.Sequential(*layers)


def _batch(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1 + dist.get_rank() // P)  # each replica its own rows
    n, width = cfg.m * cfg.rows, _TIMED_WIDTH if cfg.workload == "timed" else cfg.width
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


Step = Callable[[], None]


def _ours(cfg: Config, dp: int, groups: Any) -> tuple[Step, list[nn.Parameter], Pipeline]:
    model, (x, y) = _model(cfg), _batch(cfg)
    plan = Plan(balance=[cfg.layers // 2] * 2, schedule="1f1b", n_microbatches=cfg.m, dp=dp)
    if dp > 1:
        pipe = Pipeline(model, plan, loss_fn=_mse, bucket_mb=cfg.bucket_mb, mesh=groups.mesh)
    else:
        pipe = Pipeline(model, plan, loss_fn=_mse, group=groups.pp)

    def step() -> None:
        pipe.step(x, y)

    return step, list(pipe.parameters()), pipe


def _reducer(cfg: Config, pipe: Pipeline, groups: Any) -> GradReducer:
    """Our buckets for ``pipe``'s stages, on the "dp" group, launched whenever asked."""
    points = reduction_points(pipe.schedule, pipe.rank)
    lowered = list(pipe.schedule.lowered()[pipe.rank])
    owned = assign_parameters(dict(zip(pipe.stages, pipe._modules, strict=True)), points, lowered)
    comm = Comm(groups.dp, "bench/dp", 60.0)
    return GradReducer(owned, comm, int(cfg.bucket_mb * 1e6), dist.get_rank(), groups.replicas)


def _after(cfg: Config, groups: Any) -> tuple[Step, list[nn.Parameter]]:
    inner, params, pipe = _ours(cfg, 1, groups)
    reducer = _reducer(cfg, pipe, groups)

    def step() -> None:
        reducer.begin_step(False)
        inner()  # the gradients land in the buckets, as in (a)
        reducer.start_rows(cfg.m * cfg.rows)
        for s in pipe.stages:
            reducer.arm(s)
            reducer.launch(s)
        reducer.wait(pipe.stages)

    return step, params


def _allreduce(cfg: Config, groups: Any) -> tuple[Step, list[nn.Parameter]]:
    inner, _, pipe = _ours(cfg, 1, groups)
    reducer = _reducer(cfg, pipe, groups)
    inner()  # gradients in the buckets
    flats = []
    for b in (b for s in pipe.stages for b in reducer.buckets[s]):
        b.view(0)  # allocates the flat buffer
        assert b.flat is not None
        flats.append(b.flat)

    def step() -> None:  # the same buckets, all-reduced with nothing else running
        works = [reducer.comm.start_all_reduce(f, dist.ReduceOp.SUM, "the all-reduce alone") for f in flats]
        for w in works:
            reducer.comm.finish(w, "the all-reduce alone")

    return step, []


def _torch(cfg: Config, ddp: bool, groups: Any) -> tuple[Step, list[nn.Parameter]]:
    from torch.distributed import pipelining as tp
    from torch.nn.parallel import DistributedDataParallel

    model, (x, y) = _model(cfg), _batch(cfg)
    r, half = dist.get_rank() % P, cfg.layers // 2
    part: nn.Module = model[r * half : (r + 1) * half]
    if ddp:
        part = DistributedDataParallel(part, process_group=groups.dp, bucket_cap_mb=cfg.bucket_mb)
    stage = tp.PipelineStage(part, r, P, torch.device("cpu"), group=groups.pp)
    sched = tp.Schedule1F1B(stage, cfg.m, loss_fn=_mse)

    def step() -> None:
        if r == 0:
            sched.step(x)
        else:
            sched.step(target=y)

    return step, list(part.parameters())


@dataclass
class _Groups:
    mesh: Any
    pp: Any
    dp: Any
    replicas: list[int]


def _rank_main(cfg: Config) -> dict[str, list[float]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, P), mesh_dim_names=("dp", "pp"))
    dp_group = mesh.get_group("dp")
    groups = _Groups(mesh, mesh.get_group("pp"), dp_group, dist.get_process_group_ranks(dp_group))
    makers: dict[str, Callable[[], tuple[Step, list[nn.Parameter]]]] = {
        "ours dp=1": lambda: _ours(cfg, 1, groups)[:2],
        "(a) overlap": lambda: _ours(cfg, DP, groups)[:2],
        "(b) after": lambda: _after(cfg, groups),
        "torch dp=1": lambda: _torch(cfg, False, groups),
        "(c) torch+DDP": lambda: _torch(cfg, True, groups),
        "all-reduce": lambda: _allreduce(cfg, groups),
    }
    runs = {name: makers[name]() for name in cfg.runs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    gc.disable()  # collected between steps, outside the timing, as torchtitan's training loop does
    for k in range(cfg.warmup + cfg.steps):
        gc.collect()
        for name in names if k % 2 == 0 else reversed(names):  # alternate who goes first
            step, params = runs[name]
            for p in params:
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            step()
            if k >= cfg.warmup:
                times[name].append(time.perf_counter() - start)
    dist.barrier()
    return times


def _report(cfg: Config, per_rank: list[dict[str, list[float]]]) -> dict[str, Any]:
    # a step lasts until its last rank ends: per step the slowest rank, then the median over steps
    per_step = {name: [max(r[name][k] for r in per_rank) for k in range(cfg.steps)] for name in cfg.runs}
    step = {name: statistics.median(times) for name, times in per_step.items()}
    ar = step["all-reduce"]
    hidden = {name: 1 - (step[name] - step[base]) / ar for name, base in BASELINE.items() if name in step}
    mb = 4 * cfg.width * (cfg.width + 1) * cfg.layers // 2 / 1e6
    layer = f"Linear({cfg.width}, {cfg.width})"
    if cfg.workload == "timed":
        layer = f"timed layers of {cfg.width * (cfg.width + 1) / 1e6:.2f}M parameters, F {cfg.fwd_ms:g} ms " \
                f"B {cfg.bwd_ms:g} ms (sleeps)"  # fmt: skip
    print(f"# torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, gloo, "
          f"dp={DP} x p={P} (4 processes, 1 thread each); 1F1B, m={cfg.m}, {cfg.m * cfg.rows} rows per "
          f"replica; {cfg.layers} x {layer}; {mb:.1f} MB of gradients per stage; "
          f"buckets {cfg.bucket_mb:g} MB; median of {cfg.steps} steps after {cfg.warmup}")  # fmt: skip
    print(f"{'run':<16}{'step ms':>10}{'vs dp=1 ms':>12}{'hidden':>9}")
    for name in cfg.runs:
        extra = f"{(step[name] - step[BASELINE[name]]) * 1e3:12.1f}" if name in hidden else f"{'':>12}"
        share = f"{hidden[name]:9.0%}" if name in hidden else ""
        print(f"{name:<16}{step[name] * 1e3:10.1f}{extra}{share}")
    return {"config": cfg.__dict__, "step_s": step, "hidden": hidden, "steps_s": per_step}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    d = Config()
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    for name in ("width", "layers", "rows", "m", "steps", "warmup"):
        parser.add_argument(f"--{name}", type=int, default=getattr(d, name))
    parser.add_argument("--bucket-mb", type=float, default=d.bucket_mb)
    parser.add_argument("--workload", choices=("linear", "timed"), default=d.workload)
    parser.add_argument("--fwd-ms", type=float, default=d.fwd_ms, help="timed: each layer's forward")
    parser.add_argument("--bwd-ms", type=float, default=d.bwd_ms, help="timed: each layer's backward")
    methods = "which of (a) overlap, (b) after, (c) torch+DDP, e.g. 'a' (their baselines always run)"
    parser.add_argument("--methods", default=d.methods, help=methods)
    parser.add_argument("--json", help="also write the numbers here")
    a = parser.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        parser.error(f"--steps {a.steps} --warmup {a.warmup}: give --steps >= 1 and --warmup >= 0")
    if a.layers % 2 or a.layers < 2:
        parser.error(f"--layers {a.layers} must be even: half on each pipeline rank")
    if not a.methods or set(a.methods) - set(METHODS):
        parser.error(f"--methods {a.methods!r}: give some of the letters a, b and c, e.g. --methods ab")
    cfg = Config(
        a.width, a.layers, a.rows, a.m, a.steps, a.warmup, a.bucket_mb, a.workload, a.fwd_ms, a.bwd_ms,
        methods="".join(sorted(set(a.methods))),
    )  # fmt: skip
    # glibc returns freed blocks this large to the kernel, so every step's gradients page-fault in anew
    # (a few ms per 9.4 MB, varying): keep them in the heap, as a GPU's caching allocator keeps its own
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 32))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 36))
    per_rank = launch(_rank_main, P * DP, cfg, backend="gloo", timeout=600.0)
    out = _report(cfg, per_rank)
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
