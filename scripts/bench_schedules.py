"""Schedule efficiency, side by side: our executor against torch.distributed.pipelining.

    python scripts/bench_schedules.py                  # every case, 2-3 minutes on 2 cores
    python scripts/bench_schedules.py --cases coarse,zb --steps 20 --json runs/bench.json
    python scripts/bench_schedules.py --cases fine --trace runs/traces   # + Chrome traces, overheads
    python scripts/bench_schedules.py --quick          # tiny cases, 2 steps (the smoke test)
    python scripts/bench_schedules.py --tradeoff       # memory against step time (bench/tradeoff.py)

Cases: coarse, fine, fine-p8 (GPipe and 1F1B), interleaved, zb (timed layers); mlp, gpt (real).

    # p: ranks, v: virtual stages per rank, m: micro-batches, F / B / W: forward / input-grad / weight-grad

Both runtimes run in the same processes (``pipeline.launch``, gloo, one thread per
rank), on the same model and micro-batches, one step each in turn, so a load spike
hits both. A step's time is from the barrier before it to the last rank's end.

Workload A, timed layers (``bench.workloads.TimedLayer``): a stage sleeps its
costs, so the ideal step is known exactly and the rest is runtime and
communication overhead. The bench also measures, in the same processes, how long
the layers' sleeps really last and the one-way latency of a small gloo message,
and gives both to ``pipeline.simulate``: its prediction is the best step this
machine allows for the schedule. Efficiency is ideal / measured.

Workload B, real compute: a model split into 2 stages against the same model in
one process with one thread; speed-up against the ideal 2m / (m + 1). The CPU
columns (process time of each rank, all threads, per step) show each runtime's
own cost, which the step times hide when the ranks do not contend for cores.

torch's ``ScheduleInterleavedZeroBubble`` runs in the zb case twice: with one
stage per rank ("interleaved-zb", the order closest to our ZB-H1, same model)
and with v = 2 on the same work per rank.

The v case (``--cases v``; timed, p = 4, m = 8, two stages per rank in a V) sets
our dualpipe-v beside torch's ``ScheduleDualPipeV`` and our zb-v beside its
``ScheduleZBVZeroBubble``, on the same V (rank r holds stages r and 2p - 1 - r);
our v-half and v-min (no torch counterpart) are measured against torch's ZBV.
Its pieces are here, registered at import, so that every spawned rank (which
imports this file again) has them too.

The pieces live in ``scripts/bench/`` (cases, runners, report, traces; see its
``__init__``); this file is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # finds the bench package beside this file
from bench import runners
from bench.cases import Case, Run, all_cases
from bench.report import REAL_COLUMNS, TIMED_COLUMNS, build_report, table
from bench.results import RankResult, Report
from bench.runners import run_cases
from bench.traces import write_traces

__all__ = ["V_TORCH", "VCase", "main", "v_case"]

V_TORCH = {"dualpipe-v": "ScheduleDualPipeV", "zb-v": "ScheduleZBVZeroBubble"}  # ours -> torch's class


@dataclass(frozen=True)
class VCase(Case):
    """A timed case of V schedules (2 stages per rank): ideal and torch's runs for the V."""

    def ideal(self, run: Run) -> float:
        """Each rank's work, m * v * (F + B + W) per stage, plus rank p - 1's wait for its first
        input, p - 1 stage forwards (dualpipe-v and zb-v reach it at F = B = W)."""
        f, b, w = self.layer_costs(run.v)
        return self.m * run.v * (f + b + w) + (self.p - 1) * f


def v_case(p: int, m: int, t: float) -> VCase:
    """Ours beside torch on the V; F = B = W = t per stage (2t per rank and micro-batch)."""
    runs = (
        Run("ours", "dualpipe-v", 2), Run("torch", "dualpipe-v", 2), Run("ours", "zb-v", 2),
        Run("torch", "zb-v", 2), Run("ours", "v-half", 2), Run("ours", "v-min", 2),
    )  # fmt: skip
    return VCase("v", "timed", p, m, (2 * t, 2 * t, 2 * t), runs=runs, rows=((0, 1), (2, 3), (4, 3), (5, 3)),
                 input_grad=False)  # fmt: skip


_plain_torch = runners._BUILDERS["torch"]


def _torch_v(case: Case, run: Run) -> Any:
    """torch's run of ``run``: its V classes on stages r and 2p - 1 - r, else the bench's own."""
    if run.schedule not in V_TORCH:
        return _plain_torch(case, run)
    from torch.distributed import pipelining as tp

    w = runners._workload(case, run.v)
    rank, n_stages = dist.get_rank(), len(w.balance)
    bounds = [sum(w.balance[:s]) for s in range(n_stages + 1)]
    stages = [
        tp.PipelineStage(w.model[bounds[s] : bounds[s + 1]], s, n_stages, torch.device("cpu"))
        for s in (rank, n_stages - 1 - rank)
    ]
    sched = getattr(tp, V_TORCH[run.schedule])(stages, case.m, loss_fn=w.loss_fn)

    def step() -> float | None:
        if rank == 0:  # the first stage and the last, the V's two ends
            losses: list[torch.Tensor] = []
            sched.step(w.x, target=w.y, losses=losses)
            return float(torch.stack(losses).detach().mean())
        sched.step()
        return None

    return runners._Stepper(step, [p for s in stages for p in s.submod.parameters()])


runners._BUILDERS["torch"] = _torch_v  # here and in every spawned rank, which imports this file again


def _print(cases: list[Case], results: dict[int, list[RankResult]], report: Report, steps: int, warmup: int
           ) -> None:  # fmt: skip
    print(f"# torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"gloo, 1 thread per rank, {steps} steps after {warmup} warm-up, median step")  # fmt: skip
    for case in cases:
        if case.timed:
            cal = results[case.p][0].cases[case.key]
            sleep = ", ".join(f"{t * 1e3:g} -> {d * 1e3:.3f}" for t, d in cal.sleep.items())
            print(f"# {case.key}: p2p latency {cal.latency * 1e6:.0f} us one way; "
                  f"rank 0's sleeps (nominal -> real ms) {sleep}")  # fmt: skip
    if report.timed:
        print(
            "\nWorkload A, timed layers (ms; work = the busiest rank's sleeps per step; eff = ideal / "
            "measured;\n  sim = simulator with the measured sleeps and p2p latency; cpu = CPU ms per rank "
            "and step)"
        )
        print(table(report.timed, TIMED_COLUMNS))
    if report.real:
        print(
            "\nWorkload B, real compute, 2 stages against one process (x = speed-up over the whole batch"
            " in one process;\n  x m = over the same m micro-batches in one process, accumulating)"
        )
        print(table(report.real, REAL_COLUMNS))
    for note in report.notes:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny cases on 2 ranks, 2 steps (smoke test)")
    parser.add_argument("--cases", default="", help="comma-separated case keys (default: all)")
    parser.add_argument("--steps", type=int, help="measured steps per run (default 10, quick 2)")
    parser.add_argument("--warmup", type=int, help="unmeasured steps first (default 2, quick 1)")
    parser.add_argument(
        "--json", default=None, help="write raw results and the tables to this path (folders are made)"
    )
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="after measuring, record one step of ours per run: Chrome traces (measured "
                             "next to simulated) in DIR, and where the time went")  # fmt: skip
    parser.add_argument("--tradeoff", action="store_true",
                        help="only memory against step time (1f1b, zb-h1 and the V schedules)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.tradeoff:
        from bench.tradeoff import tradeoff

        for p in (2, 4):  # at p = 2 each rank has a core of this machine to itself
            tradeoff(p, steps=args.steps or 8, warmup=args.warmup if args.warmup is not None else 2)
        return Report()
    steps = args.steps if args.steps is not None else (2 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if steps < 1 or warmup < 0:
        parser.error(f"--steps ({steps}) must be >= 1 and --warmup ({warmup}) >= 0")
    cases = all_cases(args.quick) + ([] if args.quick else [v_case(4, 8, 5e-3)])
    if args.cases:
        wanted = args.cases.split(",")
        unknown = sorted(set(wanted) - {c.key for c in cases})
        if unknown:
            parser.error(f"unknown case(s) {unknown}; choose from {[c.key for c in cases]}")
        cases = [c for c in cases if c.key in wanted]

    began = time.perf_counter()
    results = run_cases(cases, steps, warmup, args.trace is not None)
    report = build_report(cases, results, steps)
    if args.trace is not None:
        report.notes += write_traces(cases, results, args.trace)
    _print(cases, results, report, steps, warmup)
    print(f"\n# total {time.perf_counter() - began:.0f} s")
    if args.json:
        raw = {
            "cases": [asdict(c) for c in cases],
            "steps": steps,
            "warmup": warmup,
            "results": {str(p): [asdict(r) for r in rs] for p, rs in results.items()},
            **asdict(report),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(raw, fh, indent=1)
    return report


if __name__ == "__main__":
    main()
