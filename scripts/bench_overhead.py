"""The runtime's own cost per step and per action, beside torch.distributed.pipelining and a plain loop.

    python scripts/bench_overhead.py                 # every case: 1, 2 and 4 ranks; tiny and real layers
    python scripts/bench_overhead.py --quick         # tiny layers on 1 and 2 ranks, 3 steps (the test's run)
    python scripts/bench_overhead.py --cases mlp,gpt --ranks 2 --steps 40 --json runs/overhead.json
    python scripts/bench_overhead.py --repeats 3      # each rank count launched 3 times, steps pooled

    # p: ranks, m: micro-batches, v: stages per rank, a: a compute action (F or B) of a rank

Workloads (``--cases``), each at p = 1, 2 and 4 (``--ranks``):

    tiny   an MLP of 8 layers 16 wide, 2 rows per micro-batch, m = 8: nearly all host time is runtime
    mlp    an MLP of 12 layers 768 wide, 8 rows per micro-batch, m = 6 (m = 8 at p = 4: interleaved
           needs m to be a multiple of p)
    gpt    the reference GPT (pipeline.reference.models.gpt), width 128, 6 blocks, 2 rows of 64 tokens
           per micro-batch, m = 8

Runs: at p = 1, ours (1F1B, GPipe) against a plain loop over the same micro-batches (forward,
backward of loss / m, accumulating) and against torch.distributed.pipelining on one stage; at
p = 2 and 4, ours against torch's, for 1F1B, GPipe and interleaved 1F1B (v = 2). The layers are
spread evenly over the stages, the same for both runtimes. Every run of a workload lives in the
same processes (``pipeline.launch``, gloo, one intra-op thread per rank) and they step in turn, the
order alternating, each step from a barrier to the last rank's end (scripts/bench/runners.py), so a
load spike hits both. ``ours/rival`` is the median over steps of the ratio of the two runs' steps
at that step (the quartiles beside it); cpu is each rank's process time per step (all its threads).

Then the split: ours again, its functions timed in place (scripts/bench/tally.py), each category its
own time only, per compute action of a rank (the median over steps, the mean over ranks):

    header      the step header and the shape setup (describe.py, metadata.py)
    meter       the memory meter (memory.py): its per-step list of what it skips, its hooks
    clock       the busy-time clock and the events of a trace (clock.py)
    post/take   posting sends and receives, taking an input, freeing sends (executor.py), comm
                checks (transport.py); the waits inside are "wait"
    loop+hooks  the executor's loop over the program: lookups, hooks, run-ahead
    data        splitting the batch, placing it (prepare.py, place.py)
    loss        the loss's weighting and broadcast set-up (steps.py), its wait aside
    facade      Pipeline.step and StepRunner.train themselves
    runtime     the sum of the above: the host time that is ours, not the model's or a peer's
    backend     inside the backend's post calls (gloo's send and recv take their pair's lock, which
                its I/O thread holds while it reads: under load a post can wait there for ms)

The split's own timers cost about a microsecond a call; ``tally.calibrate`` measures that and takes
it off. ``compute`` (the stages' forward and backward: torch's and autograd's time, the stage's own
Python in it) and ``wait`` (blocked on a peer or the store) are shown as µs per action too.

Run it on two versions of the runtime for a before / after: ``PYTHONPATH=<checkout> python3
scripts/bench_overhead.py`` imports that checkout's ``pipeline`` (functions one version lacks are
skipped in the split, named in a note).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # finds the bench package beside this file
from bench import runners
from bench.cases import Case, Run
from bench.report import table
from bench.tally import CATEGORIES, RUNTIME, Tally

from pipeline.launch import launch

__all__ = ["SplitRow", "StepRow", "cases", "main"]

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
SHOWN = (*RUNTIME, "runtime", "backend", "compute", "wait")  # the split's columns, µs per action


def _workload(key: str, p: int, quick: bool) -> tuple[str, int, dict[str, int]]:
    """(the runners' workload, m, its builder's arguments) of case ``key`` at ``p`` ranks."""
    if key == "tiny":
        m = 4 if quick else 8
        return "mlp", m, {"width": 16, "depth": 8, "batch_size": 2 * m}
    if key == "mlp":
        m = 8 if p == 4 else 6
        return "mlp", m, {"width": 768, "depth": 12, "batch_size": 8 * m}
    m = 8
    return "gpt", m, {"width": 128, "n_layers": 6, "n_heads": 4, "max_seq_len": 64, "batch_size": 2 * m}


def cases(keys: list[str], ranks: list[int], quick: bool) -> list[Case]:
    """One ``Case`` per (workload, p): its runs, and each row's (ours, rival) pair."""
    out = []
    for key in keys:
        for p in ranks:
            workload, m, model = _workload(key, p, quick)
            if p == 1:
                runs: tuple[Run, ...] = (
                    Run("ours", "1f1b"), Run("single", "micro"), Run("torch", "1f1b"),
                    Run("ours", "gpipe"), Run("torch", "gpipe"),
                )  # fmt: skip
                rows: tuple[tuple[int, int], ...] = ((0, 1), (0, 2), (3, 1), (3, 4))
            else:
                runs = tuple(
                    Run(impl, s, 2 if s == "interleaved-1f1b" else 1)
                    for s in SCHEDULES
                    for impl in ("ours", "torch")
                )
                rows = tuple((2 * k, 2 * k + 1) for k in range(len(SCHEDULES)))
            out.append(Case(f"{key} p={p}", workload, p, m, model=model, runs=runs, rows=rows))  # type: ignore[arg-type]
    return out


# ---- on every rank


@dataclass
class _Measured:
    """One case on one rank: per run, each measured step's (start, end, cpu seconds); the split per
    ours run (its index -> seconds per step by category, compute actions per step, step seconds)."""

    steps: list[list[tuple[float, float, float]]]
    split: dict[int, dict[str, Any]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)


def _timed_steps(case: Case, steps: int, warmup: int) -> list[list[tuple[float, float, float]]]:
    steppers = [runners._BUILDERS[run.impl](case, run) for run in case.runs]
    out: list[list[tuple[float, float, float]]] = [[] for _ in steppers]
    for k in range(warmup + steps):
        order = range(len(steppers)) if k % 2 == 0 else range(len(steppers) - 1, -1, -1)
        for j in order:  # alternate who goes first, so that neither always follows the other
            for param in steppers[j].params:
                param.grad = None
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            steppers[j].step()
            end, cpu = time.perf_counter(), time.process_time() - cpu
            if k >= warmup:
                out[j].append((start, end, cpu))
    del steppers
    dist.barrier()
    return out


def _split(case: Case, run: Run, steps: int) -> tuple[dict[str, Any], list[str]]:
    """Ours on ``run``, built and stepped with its functions timed (tally.py)."""
    tally = Tally()
    try:
        tally.calibrate()
        stepper = runners._ours(case, run)
        for _ in range(2):
            stepper.step()
        per_step: list[dict[str, float]] = []
        took: list[float] = []
        actions = 0.0
        for _ in range(steps):
            for param in stepper.params:
                param.grad = None
            dist.barrier()
            tally.reset()
            start = time.perf_counter()
            stepper.step()
            took.append(time.perf_counter() - start)
            per_step.append(tally.per_step(1))
            actions = tally.calls["compute"]
        # medians over the steps: a step that the load stalled does not move them
        seconds = {c: statistics.median(s[c] for s in per_step) for c in CATEGORIES}
        split = {"seconds": seconds, "actions": actions, "step": statistics.median(took)}
        return split, tally.missing
    finally:
        tally.restore()
        dist.barrier()


def _rank_main(todo: list[Case], steps: int, warmup: int, split_steps: int) -> dict[str, _Measured]:
    out = {}
    for case in todo:
        measured = _Measured(_timed_steps(case, steps, warmup))
        for j, run in enumerate(case.runs):
            if run.impl == "ours" and split_steps > 0:
                measured.split[j], measured.missing = _split(case, run, split_steps)
        out[case.key] = measured
    return out


# ---- the report (the parent)


@dataclass(frozen=True)
class StepRow:
    """Ours against one rival on one case, over every repeat's steps: median steps, the median of the
    per-step ratios and its quartiles, each repeat's median ratio, cpu ms per rank and step (mean over
    ranks)."""

    case: str
    ours: str
    rival: str
    ours_ms: float
    rival_ms: float
    ratio: float
    ratio_q1: float
    ratio_q3: float
    repeats: list[float]
    cpu_ours_ms: float
    cpu_rival_ms: float

    @property
    def spread(self) -> str:
        return f"{min(self.repeats):.3f}-{max(self.repeats):.3f}"


@dataclass(frozen=True)
class SplitRow:
    """Ours on one case: compute actions per rank and step, µs per action by category (the median over
    repeats of the mean over ranks), the runtime's share of the (instrumented) step."""

    case: str
    ours: str
    actions: float
    us: dict[str, float]
    runtime_share: float


# per rank count: per repeat, per rank, per case key
Results = dict[int, list[list[dict[str, _Measured]]]]


def _step_times(per_rank: list[_Measured], j: int) -> list[float]:
    steps = [r.steps[j] for r in per_rank]
    return [max(s[k][1] for s in steps) - min(s[k][0] for s in steps) for k in range(len(steps[0]))]


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4)
    return q1, q2, q3


def _split_row(title: str, run: Run, splits: list[list[dict[str, Any]]]) -> SplitRow:
    """``splits``: per repeat, each rank's split of ``run``."""
    actions = statistics.mean(s["actions"] for rep in splits for s in rep)
    per_step = {c: statistics.median(statistics.mean(s["seconds"][c] for s in rep) for rep in splits)
                for c in CATEGORIES}  # fmt: skip
    per_step["runtime"] = sum(per_step[c] for c in RUNTIME)
    step = statistics.median(statistics.mean(s["step"] for s in rep) for rep in splits)
    return SplitRow(title, run.label, actions, {c: per_step[c] / actions * 1e6 for c in SHOWN},
                    per_step["runtime"] / step)  # fmt: skip


def report(todo: list[Case], results: Results) -> tuple[list[StepRow], list[SplitRow]]:
    step_rows, split_rows = [], []
    for case in todo:
        repeats = [[r[case.key] for r in rep] for rep in results[case.p]]  # per repeat, per rank
        n = len(case.runs)
        times = [[_step_times(per_rank, j) for j in range(n)] for per_rank in repeats]  # per repeat, run
        cpu = [statistics.mean(statistics.median(c for rep in repeats for _, _, c in rep[q].steps[j])
                               for q in range(case.p)) for j in range(n)]  # fmt: skip
        title = f"{case.key} m={case.m}"
        for i, r in case.rows:
            ratios = [[a / b for a, b in zip(t[i], t[r], strict=True)] for t in times]
            q1, ratio, q3 = _quartiles([x for rep in ratios for x in rep])
            step_rows.append(StepRow(
                title, case.runs[i].label, case.runs[r].label,
                statistics.median(x for t in times for x in t[i]) * 1e3,
                statistics.median(x for t in times for x in t[r]) * 1e3,
                ratio, q1, q3, [statistics.median(rep) for rep in ratios], cpu[i] * 1e3, cpu[r] * 1e3,
            ))  # fmt: skip
        for j, run in enumerate(case.runs):
            splits = [[m.split[j] for m in rep if j in m.split] for rep in repeats]
            if any(splits):
                split_rows.append(_split_row(title, run, [rep for rep in splits if rep]))
    return step_rows, split_rows


STEP_COLUMNS = [
    ("case", "case", "{}"), ("ours", "ours", "{}"), ("rival", "rival", "{}"),
    ("ours ms", "ours_ms", "{:.2f}"), ("rival ms", "rival_ms", "{:.2f}"), ("ours/rival", "ratio", "{:.3f}"),
    ("q1", "ratio_q1", "{:.3f}"), ("q3", "ratio_q3", "{:.3f}"), ("repeats", "spread", "{}"),
    ("cpu ours", "cpu_ours_ms", "{:.1f}"), ("cpu rival", "cpu_rival_ms", "{:.1f}"),
]  # fmt: skip


@dataclass(frozen=True)
class _Flat:
    """A SplitRow with its categories as attributes, for ``table``."""

    values: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        return self.values[name]


def split_table(rows: list[SplitRow]) -> str:
    columns = [("case", "case", "{}"), ("ours", "ours", "{}"), ("a/step", "actions", "{:.0f}")]
    columns += [(c, c, "{:.1f}") for c in SHOWN]
    columns += [("runtime %", "share", "{:.1%}")]
    flat = [_Flat({"case": r.case, "ours": r.ours, "actions": r.actions, "share": r.runtime_share, **r.us})
            for r in rows]  # fmt: skip
    return table(flat, columns)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> tuple[list[StepRow], list[SplitRow]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny layers on 1 and 2 ranks, 3 steps (smoke test)"
    )
    parser.add_argument("--cases", default="", help="comma-separated: tiny, mlp, gpt (default: all)")
    parser.add_argument("--ranks", default="", help="comma-separated rank counts (default 1,2,4; quick 1,2)")
    parser.add_argument("--steps", type=int, help="measured steps per run (default 20, quick 3)")
    parser.add_argument("--warmup", type=int, help="unmeasured steps first (default 3, quick 1)")
    parser.add_argument(
        "--split-steps", type=int, help="instrumented steps for the split (default 10, quick 2)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="launches per rank count, steps pooled")
    parser.add_argument("--json", default=None, help="write the rows and raw step times to this path")
    args = parser.parse_args(argv)
    keys = args.cases.split(",") if args.cases else (["tiny"] if args.quick else ["tiny", "mlp", "gpt"])
    unknown = sorted(set(keys) - {"tiny", "mlp", "gpt"})
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from tiny, mlp, gpt")
    try:
        ranks = (
            [int(p) for p in args.ranks.split(",")] if args.ranks else ([1, 2] if args.quick else [1, 2, 4])
        )
    except ValueError:
        parser.error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    if any(p not in (1, 2, 4) for p in ranks):
        parser.error(f"--ranks takes 1, 2 and 4, got {ranks}")
    steps = args.steps if args.steps is not None else (3 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    split_steps = args.split_steps if args.split_steps is not None else (2 if args.quick else 10)
    repeats = args.repeats
    if steps < 1 or warmup < 0 or split_steps < 0 or repeats < 1:
        parser.error(
            f"--steps ({steps}) and --repeats ({repeats}) must be >= 1, --warmup ({warmup}) and "
            f"--split-steps ({split_steps}) >= 0"
        )

    todo = cases(keys, ranks, args.quick)
    began = time.perf_counter()
    results: Results = {p: [] for p in sorted({c.p for c in todo})}
    for _ in range(repeats):  # every rank count once per repeat: a drift in the load spreads over all
        for p, per in results.items():
            per.append(launch(_rank_main, p, [c for c in todo if c.p == p], steps, warmup, split_steps,
                              backend="gloo"))  # fmt: skip
    step_rows, split_rows = report(todo, results)
    import pipeline

    print(f"# torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, gloo, "
          f"1 thread per rank, {repeats} x {steps} steps after {warmup} warm-up; pipeline from "
          f"{os.path.dirname(os.path.dirname(os.path.abspath(pipeline.__file__)))}")  # fmt: skip
    print(
        "\nStep time, ours against each rival (ours/rival: median over steps of the paired ratio; repeats: "
        "the range of each repeat's median)"
    )
    print(table(step_rows, STEP_COLUMNS))  # type: ignore[arg-type]
    if split_rows:
        print(
            f"\nOurs, host µs per compute action by where it goes (median over {split_steps} instrumented "
            "steps, mean over ranks, median over repeats; runtime % of the instrumented step)"
        )
        print(split_table(split_rows))
    missing = sorted(
        {n for per in results.values() for rep in per for r in rep for m in r.values() for n in m.missing}
    )
    if missing:
        print(f"note: not in this runtime, so not timed: {', '.join(missing)}")
    print(f"\n# total {time.perf_counter() - began:.0f} s")
    if args.json:
        raw = {
            "steps": [asdict(r) for r in step_rows],
            "split": [asdict(r) for r in split_rows],
            "times": {  # per case, per repeat, per run: each step's seconds
                c.key: [
                    [_step_times([r[c.key] for r in rep], j) for j in range(len(c.runs))]
                    for rep in results[c.p]
                ]
                for c in todo
            },
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(raw, fh, indent=1)
    return step_rows, split_rows


if __name__ == "__main__":
    main()
