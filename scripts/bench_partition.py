"""Balance benchmark: bottleneck of our exact split vs torchgpipe's and equal counts, and solve time.

    python scripts/bench_partition.py            # about a minute on 2 cores
    python scripts/bench_partition.py --quick    # synthetic profiles only

    # n: layers, k: stages (p ranks x v stages per rank: what solve splits into)

Part 1, for synthetic cost profiles (n = 128) and the built-in models' measured profiles, and
k = 2 .. 64: the bottleneck of torchgpipe's ``balance_by_time`` (its ``blockpartition.solve`` on the
same per-layer costs) and of equal layer counts, as ratios to ours (>= 1 means ours is better).
Part 2: ``solve`` time for n up to 1000 and k up to 64, plain (probe search) and with cut costs
(the banded DP path), median of several runs; then the DP path at n = 1000, k = 64 with cut costs,
per-stage speeds and per-stage memory, against the issue's target of well under 50 ms.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable

from partitioner import layer_costs, profile, solve, stage_costs
from partitioner.baselines import equal_balance, torchgpipe_balance
from pipeline.reference import models

N_SYNTH = 128
STAGES = (2, 4, 8, 16, 32, 64)


def synthetic(name: str, n: int, rng: random.Random) -> list[float]:
    if name == "uniform+noise":
        return [1.0 + 0.1 * rng.gauss(0, 1) ** 2 for _ in range(n)]
    if name == "lognormal":
        return [rng.lognormvariate(0.0, 1.0) for _ in range(n)]
    if name == "transformer":  # heavy embedding and LM head around equal blocks
        return [6.0] + [1.0 + 0.02 * rng.random() for _ in range(n - 2)] + [9.0]
    if name == "widening-cnn":  # cost grows with width while resolution shrinks: a rising ramp
        return [0.5 + 2.0 * i / n + 0.05 * rng.random() for i in range(n)]
    if name == "hourglass":  # heavy at both ends, light in the middle
        return [1.0 + 4.0 * abs(2.0 * i / (n - 1) - 1.0) ** 2 for i in range(n)]
    raise ValueError(name)


SYNTHETIC = ("uniform+noise", "lognormal", "transformer", "widening-cnn", "hourglass")


def bottleneck(costs: list[float], balance: list[int]) -> float:
    if min(balance) < 1:
        return math.nan  # an empty stage: the split is unusable
    return max(stage_costs(costs, balance))


def quality_row(label: str, costs: list[float]) -> None:
    cells = []
    for k in STAGES:
        if k > len(costs):
            cells.append(f"{'-':>13}")
            continue
        ours = bottleneck(costs, solve(costs, k))
        gp = bottleneck(costs, torchgpipe_balance(costs, k)) / ours
        eq = bottleneck(costs, equal_balance(len(costs), k)) / ours
        cells.append(f"{gp:>6.3f}/{eq:<6.3f}")
    print(f"{label:<24}" + " ".join(cells))


def measured(names: list[str]) -> dict[str, list[float]]:
    out = {}
    for name in names:
        build: Callable[[], tuple[object, object]] = getattr(models, name)
        model, sample = build()
        prof = profile(model, sample, warmup=1, repeat=3)  # type: ignore[arg-type]
        out[f"{name} (measured)"] = layer_costs(prof, "time")[0]
    return out


def timing(n: int, k: int, cut: bool, rng: random.Random, runs: int, **kw: object) -> float:
    costs = [rng.lognormvariate(0.0, 1.0) for _ in range(n)]
    cuts = [rng.random() for _ in range(n)] if cut else None
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        solve(costs, k, cut_costs=cuts, **kw)  # type: ignore[arg-type]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dp_headline(rng: random.Random) -> None:
    n, k = 1000, 64
    mem = [rng.random() for _ in range(n)]
    cases: dict[str, dict[str, object]] = {
        "cut costs": {},
        "cut costs + per-stage speeds": {"speeds": [rng.choice([0.5, 1.0, 2.0]) for _ in range(k)]},
        "cut costs + per-stage memory limits": {
            "memory": mem,
            "memory_limit": [sum(mem) / k * rng.choice([2.0, 3.0]) for _ in range(k)],
        },
    }
    print(f"\nDP path, n = {n}, k = {k} (issue target: well under 50 ms), median of 7 runs:")
    for label, kw in cases.items():
        print(f"  {label:<38}{timing(n, k, True, rng, runs=7, **kw) * 1e3:>8.2f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="skip profiling the built-in models")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)

    print(f"bottleneck ratio to ours: torchgpipe/equal-counts (synthetic n = {N_SYNTH}; 1.000 = optimal)")
    print(f"{'profile':<24}" + " ".join(f"{f'k={k}':>13}" for k in STAGES))
    profiles = {name: synthetic(name, N_SYNTH, rng) for name in SYNTHETIC}
    if not args.quick:
        profiles.update(measured(["gpt", "resnet", "mlp"]))
    for label, costs in profiles.items():
        quality_row(label.replace(" (measured)", f" measured, n={len(costs)}"), costs)

    print("\nsolve time, ms (median of runs; lognormal costs): plain / with cut costs (DP)")
    ks = (2, 8, 32, 64)
    print(f"{'n':>6}" + "".join(f"{f'k={k}':>18}" for k in ks))
    for n in (100, 250, 500, 1000):
        cells = []
        for k in ks:
            plain = timing(n, k, False, rng, runs=7) * 1e3
            dp = timing(n, k, True, rng, runs=5) * 1e3
            cells.append(f"{plain:>8.2f} /{dp:>8.1f}")
        print(f"{n:>6}" + "".join(f"{c:>18}" for c in cells))
    dp_headline(rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
