"""Predicted against measured memory: each rank's peak in a step, every schedule and recompute mode.

    python scripts/bench_memory.py              # 2 and 4 ranks (a few minutes on 2 cores)
    python scripts/bench_memory.py --ranks 2 --models mlp
    python scripts/bench_memory.py --ranks 2 --models gpt resnet --schedules zb-h1 v-half v-min

Per case, on every rank: the true peak of a training step, measured
(``step(..., measure_memory=True)``: every tensor storage from allocation to free, transients
included, plus parameters, buffers and gradients; the second step, a run's steady state) beside
the peak the plan predicts for that rank (``partitioner.memory.rank_peaks`` on the profile,
what ``partition`` and the auto search decide by). Models: the reference MLP, GPT and ResNet,
and an MLP whose one wide layer's activations dominate its stage. The last line is the largest
error of all.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partitioner import Profile, profile
from partitioner.memory import rank_peaks, saved_io, stage_bytes
from pipeline.launch import launch
from pipeline.plan import Plan
from pipeline.reference.models import gpt, gpt_loss, mlp, resnet
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.registry import REGISTRY

M = 4
SCHEDULES = tuple((name, e.default_virtual) for name, e in REGISTRY.items())  # every registered one
CASES = [(s, v, mode) for s, v in SCHEDULES for mode in ("never", "except_last", "always")]
MODELS = ("mlp", "gpt", "resnet", "wide")
ERROR = 0.10  # the prediction is an upper bound of the measured peak, at most this far above it
RESNET_BALANCE = {(2, 1): [4, 2], (2, 2): [1, 2, 1, 2], (4, 1): [2, 2, 2, 2], (4, 2): [1] * 8}


def build(name: str, p: int) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, Any]:
    torch.manual_seed(0)
    if name in ("mlp", "wide"):
        if name == "mlp":
            model, x = mlp(width=32, depth=8, batch_size=8 * M)
        else:  # the fourth layer 8x wider than the rest
            model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 256), nn.GELU(),
                                  nn.Linear(256, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())  # fmt: skip
            x = torch.randn(8 * M, 32)
        return model, x, torch.randn(8 * M, 32), nn.functional.mse_loss
    if name == "resnet":
        model, x = resnet(widths=(4, 8), blocks_per_width=1 if p == 2 else 2, image_size=8, batch_size=2 * M)
        return model, x, torch.randint(0, 10, (2 * M,)), nn.functional.cross_entropy
    model, x = gpt(vocab_size=32, width=32, n_layers=5, n_heads=2, max_seq_len=16, batch_size=2 * M)
    return model, x, torch.randint(0, 32, x.shape), gpt_loss


def plan_of(name: str, n: int, p: int, sched: str, v: int, mode: str) -> Plan:
    k = p * v
    balance = [n // k + (1 if s < n % k else 0) for s in range(k)]
    if name == "resnet":
        balance = RESNET_BALANCE[(p, v)]
    return Plan(balance=balance, schedule=sched, n_microbatches=M, n_virtual=v, recompute=mode)


def measure(
    p: int, models: list[str], cases: list[tuple[str, int, str]] = CASES
) -> dict[tuple[str, str, str], int]:
    """On each rank: the measured peak per (model, schedule, mode)."""
    out = {}
    for name in models:
        model, x, y, loss_fn = build(name, p)
        for sched, v, mode in cases:
            pipe = Pipeline(model, plan_of(name, len(model), p, sched, v, mode), loss_fn=loss_fn)
            pipe.step(x, y)
            pipe.step(x, y, measure_memory=True)
            out[(name, sched, mode)] = int(pipe.memory_stats()["peak"])
            pipe.close()
    return out


@functools.cache
def _profiled(name: str, p: int) -> tuple[Profile, list[tuple[int, int]], int]:
    """The model's profile of one micro-batch (bytes only: one untimed repeat), what its layers save,
    and its number of layers."""
    model, x, y, loss_fn = build(name, p)
    xm, ym = x[: len(x) // M], y[: len(y) // M]
    prof = profile(model, xm, loss_fn=loss_fn, target=ym, warmup=0, repeat=1)
    return prof, saved_io(model, xm, loss_fn, ym), len(model)


def predict(name: str, p: int, sched: str, v: int, mode: str) -> list[float]:
    prof, io, n = _profiled(name, p)
    plan = plan_of(name, n, p, sched, v, mode)
    figures = stage_bytes(prof, plan.balance, 0.0, io)
    return rank_peaks(plan.build_schedule(), figures, plan.recompute)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument(
        "--schedules", nargs="+", default=[s for s, _ in SCHEDULES], choices=[s for s, _ in SCHEDULES]
    )
    args = parser.parse_args(argv)
    cases = [(s, v, mode) for s, v, mode in CASES if s in args.schedules]
    worst, under, cells_in_all = 0.0, [], 0
    print(
        f"{'p':>2} {'model':7} {'schedule':17} {'recompute':12} per rank: measured kB / predicted kB (error)"
    )
    for p in args.ranks:
        with tempfile.TemporaryDirectory() as folder:
            measured = launch(measure, p, p, args.models, cases, store_dir=Path(folder), timeout=600.0)
        for name in args.models:
            for sched, v, mode in cases:
                predicted = predict(name, p, sched, v, mode)
                cells = []
                for r in range(p):
                    got = measured[r][(name, sched, mode)]
                    err = predicted[r] / got - 1
                    worst, cells_in_all = max(worst, abs(err)), cells_in_all + 1
                    if predicted[r] < got:  # to the byte: a plan at its limit would not fit
                        under.append(f"{p} {name} {sched} {mode} rank {r}: {predicted[r] - got:+.0f} bytes")
                    cells.append(f"{got / 1e3:7.1f} / {predicted[r] / 1e3:7.1f} ({err:+.1%})")
                print(f"{p:>2} {name:7} {sched:17} {mode:12} " + "  ".join(cells))
    print(
        f"under the measured peak: {len(under)} of {cells_in_all} cells" + "".join(f"\n  {u}" for u in under)
    )
    print(f"largest error: {worst:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
