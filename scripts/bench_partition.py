"""Balance benchmark: bottleneck of our exact split vs torchgpipe's and equal counts, solve and
partition time, and what profiling costs.

    python scripts/bench_partition.py            # a few minutes on 2 cores
    python scripts/bench_partition.py --quick    # synthetic profiles only, no profiling
    python scripts/bench_partition.py --profiling-only

    # n: layers, k: stages (p ranks x v stages per rank: what solve splits into)

Part 1, for synthetic cost profiles (n = 128) and the built-in models' measured profiles, and
k = 2 .. 64: the bottleneck of torchgpipe's ``balance_by_time`` (its ``blockpartition.solve`` on the
same per-layer costs) and of equal layer counts, as ratios to ours (>= 1 means ours is better).
Part 2: ``solve`` time for n up to 1000 and k up to 64, plain (probe search) and with cut costs
(the banded DP path), median of several runs.
Part 3: what ``partition()`` runs at n = 1000 layers, p = 64 ranks (1F1B, m = 64), on a given
profile: costs, per-link cut costs, one memory row per stage, the solve and the simulated
prediction; with a memory limit that fits, and one that does not (the issue's target: under 100 ms).
Part 4: profiling time and its own peak memory for 8 .. 128 equal layers (peak flat in n).
Part 5 (``--graphs``, alone): models that are not an nn.Sequential, split on their traced layer
graph, against equal counts, torchgpipe and evenly placed SplitPoints (bottleneck, bytes sent),
and the partition time for a traced graph of several thousand nodes (see ``_graph_bench``).
Part 6 (``--planning``, alone): planning speed, cold. Each figure is the CPU time
(``time.process_time``) of one ``partition`` call in a FRESH process (this script again, its
imports done before the clock starts), the median over ``--repeats`` processes, on Part 3's
profile (n = 1000, p = 64): 1F1B at m = 64 refused at 1 MiB (below the weights, gradients and
optimizer state alone), and at the static floor that refusal names (the walk runs: the exact
smallest limit); then ``schedule="auto"`` (m = 64, batch_size = 64) at ``--auto-limit``, between
the static bytes and the smallest fit, where the search names the smallest fit.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from partitioner import (
    LayerProfile,
    Profile,
    layer_costs,
    layer_graph,
    partition,
    profile,
    solve,
    stage_costs,
)
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
        out[f"{name} (measured)"] = layer_costs(prof, "time")
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


def headline_profile(rng: random.Random) -> tuple[Profile, nn.Sequential]:
    """Part 3's profile: n = 1000 random layers (given: nothing is measured), and its model."""
    n = 1000
    layers = [
        LayerProfile(
            index=i,
            name=str(i),
            kind="Block",
            forward_time=rng.lognormvariate(-7.0, 0.5),
            backward_time=rng.lognormvariate(-6.3, 0.5),
            flops=0,
            param_bytes=rng.randint(1 << 20, 1 << 24),
            activation_bytes=rng.randint(1 << 18, 1 << 22),
            saved_bytes=rng.randint(1 << 20, 1 << 23),
            output_shape=(1,),
            output_dtype="bfloat16",
        )
        for i in range(n)
    ]
    prof = Profile(layers, "cpu", layer_graph(layers), input_bytes=1 << 20)
    return prof, nn.Sequential(*[nn.Identity() for _ in range(n)])


def partition_headline(rng: random.Random) -> None:
    n, p = 1000, 64
    prof, model = headline_profile(rng)
    opts = {"profile": prof, "bandwidth": 5e10, "latency": 1e-5}
    start = time.perf_counter()  # the process's first partition: every rank's program derived here
    with contextlib.suppress(ValueError):
        partition(model, p, None, memory_limit=1 << 20, **opts)  # type: ignore[arg-type]
    cold = time.perf_counter() - start
    peak = max(st.memory_bytes for st in partition(model, p, None, **opts).stages)  # type: ignore[arg-type]

    def timed(limit: float) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            with contextlib.suppress(ValueError):  # the limit that does not fit raises
                partition(model, p, None, memory_limit=limit, **opts)  # type: ignore[arg-type]
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    print(f"\npartition() at n = {n} layers, p = {p} ranks (1f1b, m = {p}; links, a memory row per stage),")
    print("median of 5 runs:")
    print(f"  {'no memory limit':<44}{timed(math.inf) * 1e3:>8.1f} ms")
    print(f"  {'a limit that fits (1.5x the free plan peak)':<44}{timed(1.5 * peak) * 1e3:>8.1f} ms")
    raises = timed(peak / 8) * 1e3
    print(f"  {'a limit that does not (peak / 8): raises':<44}{raises:>8.1f} ms  (target < 100 ms)")
    print(f"  {'the same, cold (1 MiB, the first call)':<44}{cold * 1e3:>8.1f} ms  (target < 200 ms)")


CASES = ("refuse-1mib", "refuse-at-floor", "auto-p64")


def planning_child(case: str, auto_limit: float) -> None:
    """One case of Part 6 in this (fresh) process: prints CPU and wall seconds, then the answer."""
    prof, model = headline_profile(random.Random(0))
    opts: dict[str, Any] = {"profile": prof, "bandwidth": 5e10, "latency": 1e-5}
    kw: dict[str, Any] = {"memory_limit": float(1 << 20)}
    if case == "refuse-at-floor":
        kw = {"memory_limit": _static_floor_of(model, opts)}
    elif case == "auto-p64":
        kw = {"schedule": "auto", "n_microbatches": 64, "batch_size": 64, "memory_limit": auto_limit}
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        plan = partition(model, 64, None, **opts, **kw)
        answer = f"a plan: {plan.schedule}, m = {plan.n_microbatches}, v = {plan.n_virtual}"
    except ValueError as err:
        answer = str(err)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"{cpu:.6f} {wall:.6f} {answer}")


def _static_floor_of(model: nn.Sequential, opts: dict[str, Any]) -> float:
    """The static floor the 1 MiB refusal names, found in a process of its own (so that the timed
    call is this process's first walk); a tree without that refusal: 1 MiB."""
    cmd = [sys.executable, __file__, "--planning-child", "refuse-1mib"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    if "a limit of at least " not in text:
        return float(1 << 20)
    return float(text.split("a limit of at least ")[1].split(" ")[0])


def planning_table(repeats: int, auto_limit: float, auto_repeats: int, timeout: float) -> None:
    """Part 6: each case in fresh processes, the median of their CPU seconds."""
    print("planning speed, cold: CPU seconds of one partition() call in a fresh process (n = 1000, p = 64)")
    print(f"{'case':<18}{'runs':>5}{'CPU median':>12}{'CPU min':>10}{'CPU max':>10}{'wall median':>13}")
    for case in CASES:
        cpu, wall, answer = [], [], ""
        for _ in range(auto_repeats if case == "auto-p64" else repeats):
            cmd = [sys.executable, __file__, "--planning-child", case, "--auto-limit", repr(auto_limit)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout
            except subprocess.TimeoutExpired:
                print(f"{case:<18} killed after the {timeout:g} s timeout")
                break
            c, w, answer = out.strip().split(" ", 2)
            cpu.append(float(c))
            wall.append(float(w))
        if cpu:
            print(f"{case:<18}{len(cpu):>5}{statistics.median(cpu):>11.3f}s{min(cpu):>9.3f}s{max(cpu):>9.3f}s"
                  f"{statistics.median(wall):>12.3f}s")  # fmt: skip
            print(f"{'':<18}-> {answer[:220]}")


def profiling_table() -> None:
    """Profiling time and the profile's own peak memory for n equal layers (peak flat in n)."""
    import torch

    width, rows = 512, 64
    print(f"\nprofiling n equal layers (Linear {width} + GELU, {rows} rows, fp32, warmup 1, repeat 3):")
    print(f"{'n':>5} {'model MB':>9} {'seconds':>8} {'s/layer':>8} {'peak MB':>8} {'peak/layer':>10}")
    for n in (8, 16, 32, 64, 128):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n)])
        prof = profile(model, torch.randn(rows, width), warmup=1, repeat=3)
        model_mb = sum(t.numel() * 4 for t in model.parameters()) / 1e6
        one = model_mb / n
        print(
            f"{n:>5} {model_mb:>9.1f} {prof.seconds:>8.2f} {prof.seconds / n:>8.3f} "
            f"{prof.peak_bytes / 1e6:>8.2f} {prof.peak_bytes / 1e6 / one:>10.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="skip profiling the built-in models")
    parser.add_argument("--profiling-only", action="store_true", help="only part 4: profiling cost")
    parser.add_argument("--graphs", action="store_true", help="only part 5: non-Sequential models")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--planning", action="store_true", help="only part 6: cold planning, fresh processes")
    parser.add_argument("--repeats", type=int, default=7, help="part 6: fresh processes per refusal case")
    parser.add_argument("--auto-repeats", type=int, default=3, help="part 6: fresh processes, auto case")
    parser.add_argument(
        "--auto-limit", type=float, default=5.5e8, help="part 6: the auto case's memory_limit"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="part 6: seconds before a run is killed")
    parser.add_argument("--planning-child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    if args.planning_child:
        planning_child(args.planning_child, args.auto_limit)
        return 0
    if args.planning:
        planning_table(args.repeats, args.auto_limit, args.auto_repeats, args.timeout)
        return 0
    if args.profiling_only:
        profiling_table()
        return 0
    if args.graphs:
        from _graph_bench import graph_tables  # beside this script, on the path when run as one

        graph_tables()
        return 0

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
    partition_headline(rng)
    if not args.quick:
        profiling_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
