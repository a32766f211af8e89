"""Auto-plan benchmark: the plan ``partition(schedule="auto")`` picks, measured against every configuration.

    python scripts/bench_autoplan.py                   # 3 models x 2 memory limits, a few minutes
    python scripts/bench_autoplan.py --models gpt --steps 8 --json runs/autoplan.json --detail
    python scripts/bench_autoplan.py --quick           # tiny models, batch 2 (the smoke test)

    # p: ranks (2 here), v: stages per rank, k = p * v stages, m: micro-batches, B: batch rows

For each model (``_autoplan_models``: the reference GPT, a ResNet-like CNN, an MLP with one very
heavy layer) and two per-rank memory limits (bytes of a rank's peak as ``partitioner.memory``
predicts it: weights, gradients, Adam state, buffers, held activations):

    grid     gpipe, 1f1b, zb-h1, interleaved-1f1b (v = 2 .. n / p)  x  m dividing B  x  one
             recompute mode for every stage, plus the search's per-stage choice of each
             (schedule, v, m); each with the exact balance ``partition`` finds under the limit
             (what cannot fit is left out), all from the two profiles the search takes (B rows
             and the smallest micro-batch, 1 row: ``second_rows``), priced at B / m rows the
             way it does (``partitioner.scaling``), with the runtime's own seconds per action
             and per message measured first on the same 2 ranks (``measure_runtime``)
    auto     what partition(model, p, x, schedule="auto", n_microbatches="auto", memory_limit=...,
             batch_size=B) returns: ``partitioner.auto.search`` given those same two profiles
             (so that profiling noise cannot set it apart from the grid); timed (the search time)
    default  what a user would pick: 1f1b, m = p, no recomputation, equal layer counts

    loose limit   2 x the largest predicted peak of any configuration's unconstrained plan
    tight limit   30 % of the way from the smallest limit any configuration fits to the
                  default's peak: the default does not fit, the search must choose otherwise

Every plan of a model (both limits' grids, the auto plans, the default; each distinct plan once:
plans with the same lowered actions per rank, balance and recomputation, such as gpipe and 1f1b at
m = 1, are one plan) then runs in the SAME two processes (``pipeline.launch``, gloo, one thread per
rank), round-robin:
each round steps every plan once, in a fresh random order (the same on both ranks), so a load
spike hits all of them alike. A step is timed from the barrier before it to the last rank's end
(Adam's step follows, untimed); the peak is ``memory_stats(optimizer)["peak"]`` per rank::

    warm-up rounds | screening rounds: every plan | final rounds: auto, default, each limit's
                                                    fastest few by screening (--top)

The best measured configuration is the fastest finalist by the final rounds' median: picking the
minimum of many noisy screenings would favour whichever plan got lucky. Steps of 10-20 ms vary by
several per cent from round to round here, so the finals take 40 rounds (with 10, two identical
plans measured apart came out up to 12 % apart). The table gives, per
model and limit, the auto plan's median step against the best (goal: within 5 %) and against the
default, its measured peak against the limit (never above), and the search time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from pipeline.launch import launch
from pipeline.plan import Plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _autoplan_models, autoplan_bench beside it
from _autoplan_models import MODELS
from autoplan_bench.measure import (
    Measured,
    Result,
    _job,
    _measure_runtime,
    _rank_main,
    collate,
    finalists,
    step_times,
)
from autoplan_bench.plans import (
    Case,
    Config,
    P,
    choose_limits,
    grid,
    microbatch_counts,
    plan_key,
    plan_model,
    rank_peaks,
    recompute_choices,
    smallest_fit,
    virtual_counts,
)
from autoplan_bench.report import Row, _detail, _plan_record, _print, build_row, table

__all__ = [
    "Case",
    "Config",
    "Measured",
    "Result",
    "Row",
    "build_row",
    "choose_limits",
    "collate",
    "finalists",
    "grid",
    "main",
    "microbatch_counts",
    "plan_key",
    "rank_peaks",
    "recompute_choices",
    "smallest_fit",
    "step_times",
    "table",
    "virtual_counts",
]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny models, batch 2, 2 + 2 rounds (smoke test)"
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--batch", type=int, help="rows per step, B (default 8, quick 2)")
    parser.add_argument("--warmup", type=int, help="unmeasured rounds first (default 2, quick 1)")
    parser.add_argument("--steps", type=int, help="screening rounds, every plan (default 5, quick 2)")
    parser.add_argument("--final", type=int, help="final rounds, the finalists (default 40, quick 2)")
    parser.add_argument("--top", type=int, help="finalists per limit besides auto and default (default 3)")
    parser.add_argument(
        "--per-stage",
        action="store_true",
        help="also every per-stage recomputation (one mode per stage; a much larger grid)",
    )
    parser.add_argument(
        "--max-virtual", type=int, help="interleaved-1f1b: v at most this (default: all of 2 .. n / p)"
    )
    parser.add_argument("--detail", action="store_true", help="also list every plan measured, per model")
    parser.add_argument("--json", default=None, help="write the rows and every measurement to this path")
    args = parser.parse_args(argv)
    batch = args.batch if args.batch is not None else (2 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    final = args.final if args.final is not None else (2 if args.quick else 40)
    top = args.top if args.top is not None else 3
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown or not names:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if min(batch, steps, final, top) < 1 or warmup < 0:
        parser.error(
            f"--batch ({batch}), --steps ({steps}), --final ({final}) and --top ({top}) must be >= 1, "
            f"--warmup ({warmup}) >= 0"
        )

    began = time.perf_counter()
    runtime = launch(_measure_runtime, P, args.quick, backend="gloo")[0]
    cases: list[Case] = []
    jobs: dict[str, list[Plan]] = {}
    for name in names:
        mine, jobs[name] = plan_model(name, args.quick, batch, args.per_stage, args.max_virtual, runtime)
        cases += mine
    planned = time.perf_counter() - began
    work = [_job(name, plans, cases) for name, plans in jobs.items()]
    per_rank = launch(_rank_main, P, work, args.quick, batch, (warmup, steps, final), top, backend="gloo")
    results = collate(jobs, per_rank)
    rows = [build_row(case, results[case.model]) for case in cases]
    source = per_rank[0][0][0][0].source
    _print(
        rows,
        (batch, warmup, steps, final, top),
        source,
        planned,
        runtime,
        [
            f"# {model}: the profile found layers {list(noisy)} too noisy to trust (-1: the loss)"
            for model, noisy in sorted({(c.model, tuple(c.noisy)) for c in cases if c.noisy})
        ],
    )
    if args.detail:
        for name, plans in jobs.items():
            print()
            print(_detail(name, plans, results[name], cases))
    print(f"\n# total {time.perf_counter() - began:.0f} s")
    report = {
        "rows": [asdict(row) for row in rows],
        "plans": {
            name: [
                _plan_record(plan, results[name][plan_key(plan)], [c for c in cases if c.model == name])
                for plan in plans
            ]
            for name, plans in jobs.items()
        },
        "batch": batch,
        "warmup": warmup,
        "steps": steps,
        "final": final,
        "top": top,
        "memory_source": source,
        "runtime": asdict(runtime),
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return report


if __name__ == "__main__":
    main()
