"""Schedule efficiency, side by side: our executor against torch.distributed.pipelining.

    python scripts/bench_schedules.py                  # every case, 2-3 minutes on 2 cores
    python scripts/bench_schedules.py --cases coarse,zb --steps 20 --json runs/bench.json
    python scripts/bench_schedules.py --cases fine --trace runs/traces   # + Chrome traces, overheads
    python scripts/bench_schedules.py --quick          # tiny cases, 2 steps (the smoke test)
    python scripts/bench_schedules.py --tradeoff       # memory against step time (bench/tradeoff.py)
    python scripts/bench_schedules.py --v-sim          # the V orders, ours and torch's, simulated
    python scripts/bench_schedules.py --v-greedy       # zb-v against the greedy order it replaced

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
``--cases v-uneven`` sets our zb-v beside torch's ZBV with F, B, W = 4, 6, 2 ms per stage.
``--v-sim`` runs no process: it puts torch's orders for the same p and m (its
``pipeline_order``, ``torch_v_order``) through our simulator beside ours, bubble and peak;
``--v-greedy`` sets our zb-v beside the greedy order it replaced (``greedy_v_schedule``), simulated
at F = B = W, F = 2B = 2W and F = B = 2W.
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
from types import SimpleNamespace
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

from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.generators import _zb_v_listed, in_message_order
from pipeline.schedules.schedule import Schedule, schedule, unchecked
from pipeline.schedules.simulate import simulate
from pipeline.schedules.validate import validate

__all__ = [
    "V_TORCH",
    "VCase",
    "greedy_v_schedule",
    "main",
    "torch_v_order",
    "torch_v_schedule",
    "v_case",
    "v_greedy",
    "v_sim",
    "zb_v_uneven_case",
]

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


def zb_v_uneven_case(p: int, m: int, f: float, b: float, w: float) -> VCase:
    """zb-v beside torch's ZB-V with F, B, W unequal (seconds per stage; 2x per rank)."""
    runs = (Run("ours", "zb-v", 2), Run("torch", "zb-v", 2))
    return VCase(
        "v-uneven", "timed", p, m, (2 * f, 2 * b, 2 * w), runs=runs, rows=((0, 1),), input_grad=False
    )


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


def torch_v_order(name: str, p: int, m: int) -> list[list[Action]]:
    """torch's order (``pipeline_order``) of its counterpart of our V schedule ``name`` (``V_TORCH``),
    per rank, spelt as ours: its I (input gradient) our B, its unsplit B our B and W, an overlapped
    pair its F then its B; the slots it leaves empty for few micro-batches dropped."""
    from torch.distributed.pipelining import schedules as ts

    cls: Any = getattr(ts, V_TORCH[name])
    kinds = {"F": (Kind.F,), "I": (Kind.B,), "W": (Kind.W,), "B": (Kind.B, Kind.W)}
    rows = []
    for r in range(p):
        fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
        row = []
        for op in cls._calculate_single_rank_operations(fake, r):
            for a in (op.sub_actions or (op,)) if op is not None else ():
                row += [Action(a.stage_index, k, a.microbatch_index) for k in kinds[a.computation_type.value]]
        rows.append(row)
    return rows


def torch_v_schedule(name: str, p: int, m: int) -> Schedule:
    """torch's order for our ``name``, each rank pair's messages put in the order they are sent (our
    channels match them so, as NCCL does; torch's orders take some out of it: ``in_message_order``
    runs those forwards later), validated."""
    orders = in_message_order(torch_v_order(name, p, m), p, name)
    sched = Schedule(f"torch {name}", 2 * p, p, m, True, orders, "v")
    validate(sched)
    return sched


# (F, B, W) per stage: equal (the papers' case), the input gradient 3x the weights' and a third of it,
# a forward as long as the whole backward
V_COSTS = ((1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 0.5, 1.5), (2.0, 1.0, 1.0))
V_ORDERS = (("ours", "zb-v"), ("torch", "zb-v"), ("ours", "dualpipe-v"), ("torch", "dualpipe-v"))


def v_sim(ps: tuple[int, ...] = (2, 4, 6, 8)) -> list[dict[str, Any]]:
    """Per p and m (p, 2p, 4p), ours and torch's V orders simulated: the bubble, the step less a rank's
    work, per ``V_COSTS``; the most stage activations a rank holds (1F1B's rank 0: 2p of them)."""
    rows = []
    for p in ps:
        for m in (p, 2 * p, 4 * p):
            for who, name in V_ORDERS:
                if (who, name) == ("torch", "dualpipe-v") and m < 2 * p:
                    continue  # torch's DualPipeV refuses m < 2p
                sched = schedule(name, p, m) if who == "ours" else torch_v_schedule(name, p, m)
                row: dict[str, Any] = {"p": p, "m": m, "order": f"{who} {name}"}
                for f, b, w in V_COSTS:
                    t = simulate(sched, f, b, w)
                    row[f"bubble {f:g}/{b:g}/{w:g}"] = round(t.makespan - 2 * m * (f + b + w), 3)
                row["peak"] = max(t.peak_activations)
                row["1f1b peak"] = 2 * max(simulate(schedule("1f1b", p, m), 2, 2, 2).peak_activations)
                rows.append(row)
    return rows


def greedy_v_schedule(p: int, m: int) -> Schedule:
    """The greedy order zb-v ran before (commit 3498704): its list schedule with a cap of 2p + 1
    forwards at every m (from m = p on a rank held up to 3p - 1 stage activations). Not validated:
    only simulated, which refuses an order that cannot finish."""
    return Schedule("greedy zb-v", 2 * p, p, m, True, _zb_v_listed(p, m, cap=2 * p + 1), "v")


# (F, B, W) per stage: equal, a forward as long as the whole backward, the weights' half the rest
GREEDY_COSTS = ((1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (2.0, 2.0, 1.0))


def v_greedy(ps: tuple[int, ...] = tuple(range(2, 17))) -> list[dict[str, Any]]:
    """Per p and m (1 to 4p + 3), our zb-v beside the greedy order it replaced, per ``GREEDY_COSTS``:
    the bubble (the step less a rank's work) of each, and the most stage activations a rank holds
    (1F1B's rank 0: 2 min(p, m) of them)."""
    rows = []
    for p in ps:
        for m in range(1, 4 * p + 4):
            ours, greedy = unchecked("zb-v", p, m, 2), greedy_v_schedule(p, m)
            row: dict[str, Any] = {"p": p, "m": m}
            for f, b, w in GREEDY_COSTS:
                for who, sched in (("ours", ours), ("greedy", greedy)):
                    bubble = simulate(sched, f, b, w).makespan - 2 * m * (f + b + w)
                    row[f"{who} {f:g}/{b:g}/{w:g}"] = round(bubble, 3)
            for who, sched in (("ours", ours), ("greedy", greedy)):
                row[f"{who} peak"] = max(simulate(sched, 1, 1, 1).peak_activations)
            row["1f1b peak"] = 2 * min(p, m)
            rows.append(row)
    return rows


def _print_rows(rows: list[dict[str, Any]]) -> None:
    cells = [list(rows[0])] + [[str(v) for v in row.values()] for row in rows]
    widths = [max(len(r[c]) for r in cells) for c in range(len(cells[0]))]
    for r in cells:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


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
    parser.add_argument("--v-sim", action="store_true",
                        help="only the V orders, ours and torch's, simulated (no processes)")  # fmt: skip
    parser.add_argument("--v-greedy", action="store_true",
                        help="only zb-v beside the greedy order it replaced, simulated")  # fmt: skip
    args = parser.parse_args(argv)
    if args.v_sim or args.v_greedy:
        print("# bubble: the step less a rank's work, in F units, per (F, B, W) per stage; peak: stage "
              "activations per rank (1F1B's rank 0 holds 2 min(p, m))")  # fmt: skip
        _print_rows(v_sim() if args.v_sim else v_greedy())
        return Report()
    if args.tradeoff:
        from bench.tradeoff import tradeoff

        for p in (2, 4):  # at p = 2 each rank has a core of this machine to itself
            tradeoff(p, steps=args.steps or 8, warmup=args.warmup if args.warmup is not None else 2)
        return Report()
    steps = args.steps if args.steps is not None else (2 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if steps < 1 or warmup < 0:
        parser.error(f"--steps ({steps}) must be >= 1 and --warmup ({warmup}) >= 0")
    v_cases = [v_case(4, 8, 5e-3), zb_v_uneven_case(4, 8, 4e-3, 6e-3, 2e-3)]
    cases = all_cases(args.quick) + ([] if args.quick else v_cases)
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
