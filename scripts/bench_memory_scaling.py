"""The plan's memory at other micro-batch sizes against the measured true peak (issue 46).

    python scripts/bench_memory_scaling.py                  # 2048 rows, width 256 (a few minutes)
    python scripts/bench_memory_scaling.py --rows 256 --width 128

An activation-heavy MLP (three Linear + GELU) is profiled as ``partition(schedule="auto")`` does:
at its whole batch and at the smallest micro-batch the search tries (``second_rows``), and scaled
to each m (``scale_profile``). Per m = 2..64 (1F1B on 2 ranks, balance [4, 3], recompute never and
always): each rank's true peak of a step with AdamW's state alive (``memory_stats(optimizer=)``)
beside the plan's prediction (``plan_for(...).rank_peaks``). Last, the smallest memory limit the
auto search (1F1B, every m) names when nothing fits, and the measured peak of its plan there.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partitioner import Profile, profile
from partitioner.auto import search
from partitioner.partition import plan_for
from partitioner.scaling import scale_profile, second_rows
from pipeline.launch import launch
from pipeline.plan import Plan
from pipeline.runtime.pipe import Pipeline

MS = (2, 4, 8, 16, 32, 64)
MODES = ("never", "always")
BALANCE = [4, 3]


def build(rows: int, width: int) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, width), nn.GELU(), nn.Linear(width, 32))  # fmt: skip
    return model, torch.randn(rows, 32), torch.randn(rows, 32)


def profiles(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> tuple[Profile, tuple[Profile, int]]:
    """The profile at the whole batch and the second one the auto search takes (``second_rows``)."""
    rows, loss = len(x), nn.functional.mse_loss
    prof = profile(model, x, loss_fn=loss, target=y, warmup=0, repeat=1)
    other = second_rows(rows, rows, [m for m in range(1, rows + 1) if rows % m == 0])
    return prof, (profile(model, x[:other], loss_fn=loss, target=y[:other], warmup=0, repeat=1), other)


def auto(prof: Profile, second: tuple[Profile, int], rows: int, limit: float) -> Plan:
    """``partition(schedule="auto")``'s search on these profiles: 1F1B, every m, 2 ranks."""
    return search(prof, 2, batch_size=rows, sample_rows=rows, memory_limit=limit, second=second,
                  schedules=["1f1b"])  # fmt: skip


def named_limit(err: ValueError) -> float | None:
    """The smallest memory limit a refusal of the search names (None: it names none)."""
    found = re.search(r"smallest memory_limit that fits is ([0-9.e+]+) bytes", str(err))
    return float(found.group(1)) if found else None


def peak(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, plan: Plan) -> int:
    """This rank's true peak of a plan's second step (the steady state's), AdamW's state alive."""
    pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.AdamW(pipe.parameters())
    pipe.step(x, y)
    opt.step()
    opt.zero_grad()
    pipe.step(x, y, measure_memory=True)
    out = int(pipe.memory_stats(optimizer=opt)["peak"])
    pipe.close()
    return out


def measure(rows: int, width: int, plans: dict[Any, Plan]) -> dict[Any, int]:
    """On each rank: ``peak`` of each plan."""
    model, x, y = build(rows, width)
    return {key: peak(model, x, y, plan) for key, plan in plans.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)
    rows = args.rows
    model, x, y = build(rows, args.width)
    prof, second = profiles(model, x, y)
    plans: dict[Any, Plan] = {}
    predicted: dict[Any, list[float]] = {}
    for m in MS:
        scaled = scale_profile(prof, rows, rows // m, second)
        for mode in MODES:
            plan = plan_for(scaled, BALANCE, schedule="1f1b", n_microbatches=m, recompute=mode)
            plans[(m, mode)], predicted[(m, mode)] = plan, plan.rank_peaks
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        auto(prof, second, rows, 2.05 * weights)  # the static bytes of one rank, about: nothing fits
        named = None
    except ValueError as err:
        named = named_limit(err)
    if named is not None:
        plans["smallest"] = auto(prof, second, rows, named)
        predicted["smallest"] = plans["smallest"].rank_peaks
    with tempfile.TemporaryDirectory() as folder:
        measured = launch(measure, 2, rows, args.width, plans, store_dir=Path(folder), timeout=900.0)
    print(f"{'m':>4} {'recompute':9} per rank: measured MB / predicted MB (error)")
    worst, under = 0.0, 0
    for key in plans:
        cells = []
        for r in range(2):
            got, pred = measured[r][key], predicted[key][r]
            worst, under = max(worst, abs(pred / got - 1)), under + (pred < got)
            cells.append(f"{got / 1e6:7.3f} / {pred / 1e6:7.3f} ({pred / got - 1:+.1%})")
        plan = plans[key]
        label = (
            f"{key[0]:>4} {key[1]:9}"
            if key != "smallest"
            else f"auto's smallest fit {(named or 0.0) / 1e6:.3f} MB: "
            f"{plan.n_microbatches} micro-batches, recompute {plan.recompute}"
        )
        print(f"{label} " + "  ".join(cells))
    print(f"under the measured peak: {under} cells; largest error: {worst:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
