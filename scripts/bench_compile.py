"""``Pipeline(compile=...)`` against eager: step time and compile time, side by side on 2 ranks.

    python scripts/bench_compile.py                        # the reference GPT, inductor, 1f1b and zb-h1
    python scripts/bench_compile.py --backend aot_eager --schedules zb-h1 --json runs/compile.json
    python scripts/bench_compile.py --quick                # a tiny model, 2 steps: that it runs

    # p = 2 ranks (gloo, one intra-op thread each), m micro-batches

For each schedule, an eager and a compiled ``Pipeline`` of the same model (the reference GPT of
``pipeline/reference/models.py``, the same initial weights) and data are built in the same two
processes, then stepped in turn, one step each, alternating who goes first, so that a load spike
hits both. Reported per schedule and run:

    first step s    the first step: for the compiled run, dynamo's tracing, AOTAutograd and the
                    backend's code generation of every kind of layer, plus one step (a later
                    schedule reuses the code an earlier one compiled: only new kinds compile)
    compile s       the compiled run's first step less the eager run's (the same round)
    step ms         the median step after the warm-up, each step's slowest rank
    ratio           compiled / eager: the median over rounds of the two runs' step ratio, so that
                    a load that drifts over the rounds cancels
    F / B / W ms    per step, the compute actions' time of each kind, both ranks' summed (median
                    over the steps): where the work is (a compiled split stage computes its weight
                    gradients in B, and its W only adds them to .grad)
    loss / grads    the compiled run's loss and gradients against the eager run's after the first
                    step (relative error: max |a - b| / max |b| per tensor, the worst tensor)

Gradients are zeroed between steps, no optimizer steps: every step computes the same thing.
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
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, uninstalled

from partitioner import equal_balance
from pipeline.launch import launch
from pipeline.reference.models import gpt, gpt_loss
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.registry import REGISTRY

__all__ = ["Config", "main"]

P = 2
RUNS = ("eager", "compiled")
KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class Config:
    backend: str = "inductor"
    schedules: tuple[str, ...] = ("1f1b", "zb-h1")
    width: int = 256
    layers: int = 6  # transformer blocks; the model has layers + 3 (embedding, final norm, head)
    heads: int = 4
    seq: int = 128
    vocab: int = 512
    rows: int = 4  # per micro-batch
    m: int = 4
    steps: int = 12
    warmup: int = 2


QUICK = Config(backend="aot_eager", schedules=("zb-h1",), width=16, layers=2, heads=2, seq=8, vocab=16,
               rows=2, m=2, steps=2, warmup=1)  # fmt: skip


def _build(cfg: Config, sched: str, compiled: bool) -> tuple[Pipeline, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model, _ = gpt(cfg.vocab, cfg.width, cfg.layers, cfg.heads, cfg.seq, cfg.rows * cfg.m)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab, (cfg.rows * cfg.m, cfg.seq), generator=g)
    y = torch.randint(0, cfg.vocab, (cfg.rows * cfg.m, cfg.seq), generator=g)
    v = REGISTRY[sched].default_virtual
    pipe = Pipeline(model, equal_balance(len(model), P * v), schedule=sched, n_microbatches=cfg.m,
                    n_virtual=v, loss_fn=gpt_loss,
                    compile={"backend": cfg.backend} if compiled else False)  # fmt: skip
    return pipe, x, y


def _timed(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, dict[str, float]]:
    """(loss, seconds, seconds per kind of compute action): one recorded step from a barrier to this
    rank's end (the loss reaches every rank)."""
    for p in pipe.parameters():
        p.grad = None
    dist.barrier()
    start = time.perf_counter()
    loss = pipe.step(x, y, record=True)
    seconds = time.perf_counter() - start
    kinds = {k: 0.0 for k in KINDS}
    for e in pipe.timeline().events:
        if e.action.kind.is_compute:
            kinds[e.action.kind.value] += e.duration
    return loss, seconds, kinds


def _rank_main(cfg: Config) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {}
    for sched in cfg.schedules:
        runs = {name: _build(cfg, sched, name == "compiled") for name in RUNS}
        times: dict[str, list[float]] = {name: [] for name in RUNS}
        kinds: dict[str, list[dict[str, float]]] = {name: [] for name in RUNS}
        first: dict[str, tuple[float, float, dict[str, torch.Tensor]]] = {}
        frames = int(counters["frames"]["total"])
        gc.disable()  # collected between steps, outside the timing
        for k in range(1 + cfg.warmup + cfg.steps):
            gc.collect()
            for name in RUNS if k % 2 == 0 else reversed(RUNS):
                pipe, x, y = runs[name]
                loss, seconds, spent = _timed(pipe, x, y)
                if k == 0:
                    grads = {n: t.grad.clone() for n, t in pipe.named_parameters() if t.grad is not None}
                    first[name] = (loss, seconds, grads)
                elif k > cfg.warmup:
                    times[name].append(seconds)
                    kinds[name].append(spent)
        gc.enable()
        (loss_e, _, grads_e), (loss_c, _, grads_c) = first["eager"], first["compiled"]
        grad_err = max(
            float((grads_c[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads_e.items()
        )
        out[sched] = {
            "first_s": {name: first[name][1] for name in RUNS},
            "steps_s": times,
            "kinds_s": kinds,
            "loss": (loss_e, loss_c),
            "grad_rel_err": grad_err,
            "frames": int(counters["frames"]["total"]) - frames,
        }
        for pipe, _, _ in runs.values():
            pipe.close()
    dist.barrier()
    return out


def _report(cfg: Config, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    print(f"# torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, gloo, "
          f"p={P} (1 thread per rank); GPT width {cfg.width}, {cfg.layers} blocks, {cfg.heads} heads, "
          f"seq {cfg.seq}, vocab {cfg.vocab}; m={cfg.m} x {cfg.rows} rows; backend {cfg.backend}; median of "
          f"{cfg.steps} steps after {cfg.warmup} (and the first)")  # fmt: skip
    kinds = "".join(f"{kind + ' ms':>8}" for kind in KINDS)
    print(f"{'schedule':<10}{'run':<10}{'first step s':>13}{'compile s':>11}{'step ms':>10}{'ratio':>7}"
          f"{kinds}{'loss rel err':>14}{'grad rel err':>14}{'frames':>8}")  # fmt: skip
    report: dict[str, Any] = {"config": asdict(cfg), "schedules": {}}
    for sched in cfg.schedules:
        rows = [r[sched] for r in per_rank]
        # a step lasts until its last rank ends: per step the slowest rank, then the median
        step = {name: statistics.median(max(r["steps_s"][name][k] for r in rows) for k in range(cfg.steps))
                for name in RUNS}  # fmt: skip
        first = {name: max(r["first_s"][name] for r in rows) for name in RUNS}
        compile_s = first["compiled"] - first["eager"]
        ratios = [max(r["steps_s"]["compiled"][k] for r in rows) / max(r["steps_s"]["eager"][k] for r in rows)
                  for k in range(cfg.steps)]  # fmt: skip
        ratio = statistics.median(ratios)
        spent = {name: {kind: statistics.median(sum(r["kinds_s"][name][k][kind] for r in rows)
                                                for k in range(cfg.steps)) for kind in KINDS}
                 for name in RUNS}  # fmt: skip
        loss_e, loss_c = rows[-1]["loss"]
        loss_err = abs(loss_c - loss_e) / abs(loss_e)
        grad_err = max(r["grad_rel_err"] for r in rows)
        frames = sum(r["frames"] for r in rows)
        for name in RUNS:
            extra = f"{compile_s:11.2f}" if name == "compiled" else f"{'':>11}"
            extra += f"{step[name] * 1e3:10.1f}{ratio if name == 'compiled' else 1.0:7.2f}"
            extra += "".join(f"{spent[name][kind] * 1e3:8.1f}" for kind in KINDS)
            if name == "compiled":
                extra += f"{loss_err:14.1e}{grad_err:14.1e}{frames:8d}"
            print(f"{sched:<10}{name:<10}{first[name]:13.2f}{extra}")
        report["schedules"][sched] = {
            "step_s": step, "first_s": first, "compile_s": compile_s, "ratio": ratio, "ratios": ratios,
            "kinds_s": spent,
            "loss_rel_err": loss_err, "grad_rel_err": grad_err, "frames": frames,
            "steps_s": [r["steps_s"] for r in rows],
        }  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    d = Config()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default=None, help=f"torch.compile's backend (default {d.backend})")
    parser.add_argument("--schedules", nargs="+", choices=list(REGISTRY), default=None)
    for name in ("width", "layers", "heads", "seq", "vocab", "rows", "m", "steps", "warmup"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model on aot_eager, 2 steps: that it runs"
    )
    parser.add_argument("--json", help="also write the numbers here")
    a = parser.parse_args(argv)
    base = QUICK if a.quick else d
    given = {k: v for k, v in vars(a).items() if k not in ("quick", "json") and v is not None}
    if "schedules" in given:
        given["schedules"] = tuple(given["schedules"])
    cfg = Config(**{**asdict(base), **given})
    if cfg.steps < 1 or cfg.warmup < 0:
        parser.error(f"--steps {cfg.steps} --warmup {cfg.warmup}: give --steps >= 1 and --warmup >= 0")
    per_rank = launch(_rank_main, P, cfg, backend="gloo", timeout=1800.0)
    report = _report(cfg, per_rank)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
