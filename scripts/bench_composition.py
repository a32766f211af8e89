"""FSDP2 under the pipeline, side by side: ours (``Plan(shard=2)``) against torchtitan's composition.

    python scripts/bench_composition.py                     # MLP, 1F1B m=8, 10 steps: ~1.5 min on 2 cores
    python scripts/bench_composition.py --quick             # tiny, 2 steps (the test's run): 15-25 s
    python scripts/bench_composition.py --model gpt --m 4 --steps 10 --json runs/composition.json
    python scripts/bench_composition.py --zero 3            # ours gathers at every use instead

    # p = 2 pipeline ranks ("pp"), S = 2 FSDP shards ("dp_shard"), m micro-batches, r: pp rank, h: shard

Four gloo processes (one intra-op thread each) on one DeviceMesh of shape (dp_replicate 1, dp_shard 2,
pp 2, tp 1), global rank g = h * p + r; each (h) runs a pipeline of 2 ranks on its own rows, the same
rows for both runs:

    ours    Pipeline(model, Plan(balance, "1f1b", m, shard=2, zero=2), mesh=mesh): under ZeRO-2 each
            stage is one FSDP unit on "dp_shard" (its layers too under ZeRO-3), gathered once at the
            step's start and reduce-scattered once after the stage's last backward
    torch   torch.distributed.pipelining's PipelineStage + Schedule1F1B on the "pp" group, the stage's
            layers then the stage wrapped with fully_shard(mesh["dp_shard"], reshard_after_forward=False)
            as torchtitan does under PP (the stage gathers each unit at its first forward and keeps it
            to its last backward, then reduce-scatters)

One step of each in turn (the order alternating), each from a barrier to its rank's end; a step is its
slowest rank, ``ours/torch`` the median over steps of the two steps' ratio. Parameters do not change
(no optimizer): every step computes the same loss and gradients, checked between the two stacks.

Collectives: ``torch.distributed.all_gather_single`` and ``reduce_scatter_single`` (what FSDP2 calls,
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py; also their older names) are wrapped in every
rank: calls per step and per stage, and the seconds inside them. A unit is one FSDP parameter group (ours:
the stage under ZeRO-2; torch: a layer with parameters); "per unit" is calls / units: 1 means each
parameter once per step, not m times. The same bytes move either way; ours in fewer calls.

Reduce-scatter hidden: on gloo a collective runs on the host and the call returns when it is done, so
a rank computes nothing while its own reduce-scatter runs; "RS share" is the time inside it over the
step. On CUDA FSDP issues it on its own reduce-scatter stream, where it can overlap later compute; this
bench does not measure that. "after RS" is measured: from the end of a stage's last reduce-scatter to
the step's end (the last rank's), time.perf_counter (CLOCK_MONOTONIC, one clock for the processes).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, uninstalled

from pipeline.launch import launch
from pipeline.plan import Plan
from pipeline.reference.models import gpt, gpt_loss, mlp
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.replicas.mesh import COMPOSED

__all__ = ["main"]

P, SHARD = 2, 2
RUNS = ("ours", "torch")


@dataclass(frozen=True)
class Config:
    model: str = "mlp"
    width: int = 1024
    layers: int = 8  # the MLP's layers, the GPT's blocks
    rows: int = 32  # per micro-batch (GPT: sequences of ``seq`` tokens)
    seq: int = 64
    m: int = 8
    steps: int = 10
    warmup: int = 3
    zero: int = 2


QUICK = Config(width=256, layers=4, rows=8, seq=16, m=4, steps=2, warmup=1)


# --- counting FSDP's collectives: calls, elements out, seconds inside, the last reduce-scatter's end ---

_KINDS = {"all_gather_single": "ag", "all_gather_into_tensor": "ag",
          "reduce_scatter_single": "rs", "reduce_scatter_tensor": "rs"}  # fmt: skip
TALLY = dict.fromkeys(("ag", "rs", "ag_numel", "rs_numel", "ag_s", "rs_s", "rs_end", "async"), 0.0)


def _counted(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        work = original(*args, **kwargs)
        end = time.perf_counter()
        out = kwargs.get("output", kwargs.get("output_tensor", args[0] if args else None))
        TALLY[kind] += 1
        TALLY[f"{kind}_numel"] += out.numel() if isinstance(out, torch.Tensor) else 0
        TALLY[f"{kind}_s"] += end - start
        TALLY["async"] += work is not None  # async_op=True: the time inside is the launch only
        TALLY["rs_end"] = end if kind == "rs" else TALLY["rs_end"]
        return work

    return wrapper


def _count_collectives() -> None:
    for name, kind in _KINDS.items():
        setattr(dist, name, _counted(kind, getattr(dist, name)))


# --- the model, the data, the two stacks ------------------------------------------------------------

Batch = tuple[torch.Tensor, torch.Tensor]


def _model(cfg: Config) -> tuple[nn.Sequential, Callable[..., torch.Tensor], Batch]:
    """The model (seeded), its loss and the global batch of S * m * rows rows (the same on every rank)."""
    torch.manual_seed(0)
    n, g = SHARD * cfg.m * cfg.rows, torch.Generator().manual_seed(1)
    if cfg.model == "gpt":
        model, _ = gpt(vocab_size=96, width=cfg.width, n_layers=cfg.layers, n_heads=4, max_seq_len=cfg.seq)
        tokens = torch.randint(0, 96, (2, n, cfg.seq), generator=g)
        return model, gpt_loss, (tokens[0], tokens[1])
    model, _ = mlp(width=cfg.width, depth=cfg.layers)
    data = torch.randn(2, n, cfg.width, generator=g)
    return model, nn.functional.mse_loss, (data[0], data[1])


def _rows(batch: Batch, h: int) -> Batch:
    """Shard ``h``'s rows of the global batch."""
    n = len(batch[0]) // SHARD
    return batch[0][h * n : (h + 1) * n], batch[1][h * n : (h + 1) * n]


def _units(module: nn.Module) -> int:
    """FSDP units of a stage that hold parameters of their own: each is gathered and reduced as one."""

    def own(unit: nn.Module) -> set[int]:
        inner = {id(p) for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)
                 for p in sub.parameters()}  # fmt: skip
        return {id(p) for p in unit.parameters()} - inner

    return sum(1 for m in module.modules() if isinstance(m, FSDPModule) and own(m))


@dataclass
class Stack:
    step: Callable[[], float | None]
    loss: Callable[[float | None], float]  # the step's result -> the global batch's loss, on every rank
    params: list[nn.Parameter]
    units: int


def _ours(cfg: Config, mesh: Any, model: nn.Sequential, loss_fn: Any, batch: Batch) -> Stack:
    n = len(model)
    plan = Plan(
        balance=[n // 2, n - n // 2], schedule="1f1b", n_microbatches=cfg.m, shard=SHARD, zero=cfg.zero
    )
    pipe = Pipeline(model, plan, loss_fn=loss_fn, mesh=mesh)
    x, y = _rows(batch, pipe.replica)  # the data group's rank: h, as dp_replicate is 1
    return Stack(lambda: pipe.step(x, y), _given, list(pipe.parameters()), _units(pipe.module))


def _given(loss: float | None) -> float:
    assert loss is not None  # ours: the global batch's mean loss, on every rank
    return loss


def _mean_over_shards(loss: float | None) -> float:
    """torch: the last stage's ranks hold their rows' mean; the global batch's is the shards' mean."""
    total = torch.tensor(0.0 if loss is None else loss, dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / SHARD


def _torch(cfg: Config, mesh: Any, model: nn.Sequential, loss_fn: Any, batch: Batch) -> Stack:
    from torch.distributed import pipelining

    r, n = mesh["pp"].get_local_rank(), len(model)
    part = nn.Sequential(*(list(model)[: n // 2] if r == 0 else list(model)[n // 2 :]))
    for layer in part:  # torchtitan: each block, then the stage's module
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh["dp_shard"], reshard_after_forward=False)
    fully_shard(part, mesh=mesh["dp_shard"], reshard_after_forward=False)
    stage = pipelining.PipelineStage(part, r, P, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = pipelining.Schedule1F1B(stage, cfg.m, loss_fn=loss_fn)
    x, y = _rows(batch, mesh["dp_shard"].get_local_rank())

    def step() -> float | None:
        if r == 0:
            sched.step(x)
            return None
        losses: list[torch.Tensor] = []
        sched.step(target=y, losses=losses)
        return float(torch.stack(losses).detach().mean())  # equal micro-batches: the rows' mean

    return Stack(step, _mean_over_shards, list(part.parameters()), _units(part))


def _grad_norm(params: list[nn.Parameter]) -> float:
    """The whole model's gradient norm: each rank's local shards, summed over the world (each element
    is on one rank in both stacks: the stages split over "pp", the shards over "dp_shard")."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            sq += g.double().pow(2).sum()
    dist.all_reduce(sq)
    return float(sq.sqrt())


# --- one rank ---------------------------------------------------------------------------------------


def _rank_main(cfg: Config) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, SHARD, P, 1), mesh_dim_names=COMPOSED)
    model, loss_fn, batch = _model(cfg)
    twin = copy.deepcopy(model)  # the same weights for torch's stack
    stacks = {
        "ours": _ours(cfg, mesh, model, loss_fn, batch),
        "torch": _torch(cfg, mesh, twin, loss_fn, batch),
    }
    _count_collectives()
    rec: dict[str, list[dict[str, Any]]] = {name: [] for name in RUNS}
    gc.disable()  # collected between steps, outside the timing, as torchtitan's training loop does
    for k in range(cfg.warmup + cfg.steps):
        gc.collect()
        for name in RUNS if k % 2 == 0 else RUNS[::-1]:  # alternate who goes first
            stack = stacks[name]
            for p in stack.params:
                p.grad = None
            dist.barrier()
            TALLY.update(dict.fromkeys(TALLY, 0.0))
            start = time.perf_counter()
            out = stack.step()
            end = time.perf_counter()
            tally = dict(TALLY)
            loss = stack.loss(out)  # outside the timing: torch's needs an all-reduce
            if k >= cfg.warmup:
                rec[name].append({"s": end - start, "end": end, "tally": tally, "units": stack.units,
                                  "loss": loss, "grad_norm": _grad_norm(stack.params)})  # fmt: skip
    gc.enable()
    alone = _rs_alone(int(rec["ours"][0]["tally"]["rs_numel"]), mesh["dp_shard"].get_group())
    return {"rank": dist.get_rank(), "stage": mesh["pp"].get_local_rank(), "steps": rec, "rs_alone": alone}


def _rs_alone(numel: int, group: Any, repeats: int = 5) -> float:
    """Seconds of one reduce-scatter of a stage's whole gradient (``numel`` out per rank) with nothing
    else running, both shards starting together: the collective's own cost, no peer's lateness."""
    out, inp, times = torch.empty(numel), torch.ones(numel * SHARD), []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.reduce_scatter_single(out, inp, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- the report -------------------------------------------------------------------------------------

COLUMNS = (  # per run and stage: header, width, format, the row's key (medians over steps)
    ("units", 6, "d", "units"), ("AG/step", 8, "g", "ag"), ("per unit", 9, ".2f", "ag_per_unit"),
    ("AG MB", 7, ".1f", "ag_mb"), ("AG ms", 7, ".1f", "ag_ms"), ("RS/step", 8, "g", "rs"),
    ("per unit", 9, ".2f", "rs_per_unit"), ("RS ms", 7, ".1f", "rs_ms"), ("alone", 7, ".1f", "rs_alone_ms"),
    ("RS share", 9, ".1%", "rs_share"), ("after RS ms", 12, ".1f", "after_rs_ms"),
)  # fmt: skip


def _stage_row(
    cfg: Config, per_rank: list[dict[str, Any]], name: str, s: int, step_s: float
) -> dict[str, Any]:
    """Stage ``s``'s collectives in run ``name``: per step the mean over its shard ranks, then the median."""
    ranks, n = [r for r in per_rank if r["stage"] == s], cfg.steps

    def med(key: str) -> float:
        return float(statistics.median(statistics.mean(r["steps"][name][k]["tally"][key] for r in ranks)
                                       for k in range(n)))  # fmt: skip

    ends = [
        max(r["steps"][name][k]["end"] for r in per_rank) for k in range(n)
    ]  # the step's end: its last rank's
    after = statistics.median(
        ends[k] - max(r["steps"][name][k]["tally"]["rs_end"] for r in ranks) for k in range(n)
    )
    units = ranks[0]["steps"][name][0]["units"]
    return {"stage": s, "units": units, "ag": med("ag"), "ag_per_unit": med("ag") / units,
            "ag_mb": med("ag_numel") * 4 / 1e6, "ag_ms": med("ag_s") * 1e3, "rs": med("rs"),
            "rs_per_unit": med("rs") / units, "rs_ms": med("rs_s") * 1e3, "rs_share": med("rs_s") / step_s,
            "rs_alone_ms": statistics.mean(r["rs_alone"] for r in ranks) * 1e3, "after_rs_ms": after * 1e3,
            "async": med("async")}  # fmt: skip


def _report(cfg: Config, per_rank: list[dict[str, Any]], command: str) -> dict[str, Any]:
    step = {n: [max(r["steps"][n][k]["s"] for r in per_rank) for k in range(cfg.steps)] for n in RUNS}
    step_s = {name: statistics.median(times) for name, times in step.items()}
    first = per_rank[0]["steps"]
    loss, norm = ({name: first[name][0][key] for name in RUNS} for key in ("loss", "grad_norm"))
    out = {
        "config": asdict(cfg), "command": command, "step_s": step_s, "steps_s": step,
        "ratio": statistics.median(o / t for o, t in zip(step["ours"], step["torch"], strict=True)),
        "loss": loss, "grad_norm": norm,
        "loss_rel_diff": abs(loss["ours"] - loss["torch"]) / abs(loss["torch"]),
        "grad_norm_rel_diff": abs(norm["ours"] - norm["torch"]) / abs(norm["torch"]),
        "stages": {n: [_stage_row(cfg, per_rank, n, s, step_s[n]) for s in range(P)] for n in RUNS},
    }  # fmt: skip
    what = f"{cfg.layers} x (Linear({cfg.width}, {cfg.width}) + ReLU), {cfg.rows} rows per micro-batch"
    if cfg.model == "gpt":
        what = f"GPT of {cfg.layers} blocks, width {cfg.width}, {cfg.rows} x {cfg.seq} tokens per micro-batch"
    print(f"$ {command}")
    print(f"# torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, gloo, "
          f"4 processes (1 thread each), mesh (dp_replicate 1, dp_shard {SHARD}, pp {P}, tp 1)\n# 1F1B "
          f"m={cfg.m}; {what}; ours ZeRO-{cfg.zero}, torch reshard_after_forward=False; median of "
          f"{cfg.steps} steps after {cfg.warmup}")  # fmt: skip
    print(f"{'run':<6}{'step ms':>9}{'loss':>12}{'grad norm':>12}")
    for name in RUNS:
        print(f"{name:<6}{step_s[name] * 1e3:9.1f}{loss[name]:12.6f}{norm[name]:12.6f}")
    print(f"ours/torch {out['ratio']:.3f} (median of the steps' ratios); relative difference: loss "
          f"{out['loss_rel_diff']:.1e}, grad norm {out['grad_norm_rel_diff']:.1e}")  # fmt: skip
    print(f"{'run':<6}{'stage':>6}" + "".join(f"{head:>{w}}" for head, w, _, _ in COLUMNS))
    for name in RUNS:
        for row in out["stages"][name]:
            cells = "".join(f"{row[key]:>{w}{fmt}}" for _, w, fmt, key in COLUMNS)
            print(f"{name:<6}{row['stage']:>6}{cells}")
    if any(row["async"] for rows in out["stages"].values() for row in rows):
        print("# some collectives were async (async_op=True): their ms is the launch only")
    print("# gloo: a collective blocks its rank until it is done (RS ms: the time inside, waiting for the "
          "other shard included;\n# alone: the same bytes with both shards ready), so none overlaps its own "
          "rank's compute; on CUDA FSDP runs it on its own stream: not measured here")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    d = Config()
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--model", choices=("mlp", "gpt"), default=None)
    for name in ("width", "layers", "rows", "seq", "m", "steps", "warmup"):
        parser.add_argument(f"--{name}", type=int, default=None, help=f"default {getattr(d, name)}")
    parser.add_argument("--zero", type=int, choices=(2, 3), default=None, help="ours: ZeRO-2 (default) or 3")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 steps after 1 (the smoke test)")
    parser.add_argument("--json", help="also write the numbers here")
    a = parser.parse_args(argv)
    base = QUICK if a.quick else d
    given = {k: v for k, v in vars(a).items() if k in Config.__dataclass_fields__ and v is not None}
    cfg = Config(**(asdict(base) | given))
    if cfg.steps < 1 or cfg.warmup < 0 or cfg.m < P:
        parser.error(f"--steps {cfg.steps} --warmup {cfg.warmup} --m {cfg.m}: give --steps >= 1, "
                     f"--warmup >= 0 and --m >= {P} (1F1B on {P} ranks)")  # fmt: skip
    if cfg.layers < P:
        parser.error(f"--layers {cfg.layers}: give at least {P} (each stage needs a layer with parameters)")
    args = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "scripts/bench_composition.py", *args])
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 32))  # freed gradients stay in the heap
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 36))
    per_rank = launch(_rank_main, P * SHARD, cfg, backend="gloo", timeout=300.0)
    out = _report(cfg, per_rank, command)
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
