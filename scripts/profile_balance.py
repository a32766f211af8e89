"""Stage balance of a model: its per-layer profile, then our split beside equal counts and torchgpipe.

    python scripts/profile_balance.py --model gpt --stages 4
    python scripts/profile_balance.py --model resnet --stages 2 --schedule gpipe --microbatches 8
    python scripts/profile_balance.py --model gpt --stages 2 --schedule interleaved-1f1b   # 2 ranks x 2
    python scripts/profile_balance.py --model mypkg.models:build --stages 4 --json plan.json --plot plan.png
    python scripts/profile_balance.py --model gpt --stages 2 --measure     # run the plan, time each rank

    # p: ranks (--stages), v: stages per rank (--virtual), k = p * v stages

``--stages`` is the number of pipeline ranks (devices), as ``partition``'s ``n_ranks``; with
``--schedule interleaved-1f1b`` each rank holds ``--virtual`` stages (default 2). ``--model`` is a
built-in (gpt, resnet, mlp from ``pipeline.reference.models``) or ``module:function`` returning
``(nn.Sequential, sample)``; the sample is one micro-batch. All three splits use the same per-layer
costs, so the bottleneck ratios compare the algorithms, not the measurements.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

from partitioner import COSTS, Plan, layer_costs, partition, plan_for, profile
from partitioner.baselines import equal_balance, torchgpipe_balance
from pipeline.reference import models
from pipeline.schedules.schedule import SCHEDULES, schedule_options

# The library's arguments behind this script's flags, to say which flag an error is about.
FLAGS = {
    "n_ranks": "--stages",
    "n_microbatches": "--microbatches",
    "n_virtual": "--virtual",
    "recompute": "--recompute",
    "memory_limit": "--memory-limit",
}

BUILT_IN: dict[str, Callable[[], tuple[nn.Sequential, Any]]] = {
    "gpt": models.gpt,
    "resnet": models.resnet,
    "mlp": models.mlp,
}


def load_model(spec: str, parser: argparse.ArgumentParser) -> tuple[nn.Sequential, Any]:
    if spec in BUILT_IN:
        return BUILT_IN[spec]()
    if ":" not in spec:
        parser.error(f"--model {spec!r} is neither a built-in ({', '.join(BUILT_IN)}) nor module:function")
    module_name, func_name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as err:
        parser.error(f"--model {spec!r}: cannot load it ({err})")
    built = fn()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Sequential)):
        parser.error(f"--model {spec!r} must return (nn.Sequential, sample)")
    return built[0], built[1]


def print_profile(prof: Any) -> None:
    print(f"per-layer profile on {prof.device} (one micro-batch; times are medians)")
    print(
        f"{'l':>3} {'name':<6} {'kind':<18} {'fwd ms':>8} {'bwd ms':>8} {'MFLOP':>9} "
        f"{'params MB':>9} {'out MB':>7} {'saved MB':>8}  output"
    )
    for lp in prof.layers:
        print(
            f"{lp.index:>3} {lp.name:<6} {lp.kind:<18} "
            f"{lp.forward_time * 1e3:>8.3f} {lp.backward_time * 1e3:>8.3f} "
            f"{lp.flops / 1e6:>9.1f} {lp.param_bytes / 1e6:>9.3f} {lp.activation_bytes / 1e6:>7.3f} "
            f"{lp.saved_bytes / 1e6:>8.3f}  {list(lp.output_shape)} {lp.output_dtype}"
        )


def plot(plans: dict[str, Plan], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(plans)
    for shift, (label, plan) in enumerate(plans.items()):
        xs = [s + shift * width for s in range(len(plan.stages))]
        ax.bar(xs, [st.cost for st in plan.stages], width=width, label=label)
    ax.set_xlabel("stage")
    ax.set_ylabel(f"stage cost ({next(iter(plans.values())).cost})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


# -- --measure: the plan run for real, one process per rank ----------------------------------------


def _square_loss(output: Any, target: Any) -> Any:
    # Any scalar will do for timing: a backward costs the same whatever the loss.
    return output.float().square().mean()


def _measured_rank(spec: str, plan_json: str, steps: int) -> Any:
    import statistics
    import time

    import torch

    from pipeline import Pipeline

    torch.manual_seed(0)  # every rank builds the same model
    model, sample = load_model(spec, argparse.ArgumentParser())
    plan = Plan.from_json(plan_json)
    batch = torch.cat([sample] * plan.n_microbatches)  # the sample is one micro-batch
    targets = torch.zeros(batch.shape[0])
    pipe = Pipeline(model, plan, loss_fn=_square_loss)  # the schedule, m and v come from the plan
    ran = pipe.schedule
    walls, busy = [], []
    for step in range(steps + 1):
        start = time.perf_counter()
        pipe.step(batch, targets)
        for t in pipe.parameters():
            t.grad = None
        if step > 0:  # the first step sets up shapes and buffers
            walls.append(time.perf_counter() - start)
            busy.append(pipe.busy_time)
    return statistics.median(walls), statistics.median(busy), (ran.name, ran.n_microbatches, ran.n_virtual)


def measure(spec: str, plan: Plan, steps: int) -> str:
    """Per rank: the plan's predicted busy time beside the measured one, and the step times."""
    from pipeline import launch

    p = plan.n_ranks
    results = launch(_measured_rank, p, spec, plan.to_json(), steps)
    name, m, v = results[0][2]
    ran = f"[{name}, m={m}, v={v}]"
    planned = f"[{plan.schedule}, m={plan.n_microbatches}, v={plan.n_virtual}]"
    lines = [
        f"== measured: {steps} steps after a warm-up, {p} processes (gloo, 1 thread each), ran {ran}"
        + ("" if ran == planned else f" -- NOT the plan's {planned}: the times below are not the plan's"),
        f"{'rank':>4}  {'stages':<8} {'predicted busy ms':>17} {'measured busy ms':>16} "
        f"{'measured/pred':>13}",
    ]
    for r, ((_, busy, _), pred) in enumerate(zip(results, plan.predicted_busy(), strict=True)):
        stages = list(range(r, plan.n_stages, p))
        ratio = busy / pred if pred > 0 else float("nan")
        names = ",".join(map(str, stages))
        lines.append(f"{r:>4}  {names:<8} {pred * 1e3:>17.2f} {busy * 1e3:>16.2f} {ratio:>13.3f}")
    wall = max(w for w, _, _ in results)
    lines.append(
        f"step time: predicted {plan.step_time * 1e3:.2f} ms, measured {wall * 1e3:.2f} ms "
        f"({wall / plan.step_time:.3f}x the prediction)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt", help="gpt | resnet | mlp | module:function")
    parser.add_argument(
        "--stages",
        type=int,
        default=4,
        help="pipeline ranks (devices), p; each holds --virtual stages, so the split has p x v stages",
    )
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--microbatches", type=int, default=None, help="default: one per rank")
    parser.add_argument(
        "--virtual", type=int, default=None, help="stages per rank (default: 2 for interleaved-1f1b, else 1)"
    )
    parser.add_argument("--recompute", default="never", help="never | except_last | always")
    parser.add_argument("--memory-limit", type=float, default=None, help="bytes per rank")
    parser.add_argument("--cost", default="time", choices=COSTS)
    parser.add_argument("--device", default=None, help="where to profile (default: the model's device)")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU intra-op threads (default 1, as each launched rank)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="save our plan as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="draw per-stage cost bars (matplotlib)")
    parser.add_argument(
        "--measure", action="store_true", help="run a few real steps of our plan and time each rank"
    )
    parser.add_argument("--measure-steps", type=int, default=3, help="timed steps after one warm-up step")
    args = parser.parse_args(argv)
    if args.measure_steps < 1:
        parser.error(f"--measure-steps ({args.measure_steps}) must be >= 1")
    if args.threads < 1:
        parser.error(f"--threads ({args.threads}) must be >= 1")
    try:  # the schedule's options are the library's to check, before the slow profile
        schedule_options(args.schedule, args.stages, args.microbatches, args.virtual)
    except ValueError as err:
        _library_error(parser, err)
    torch.set_num_threads(args.threads)  # profile each layer as a rank will run it
    model, sample = load_model(args.model, parser)
    opts: dict[str, Any] = {
        "schedule": args.schedule,
        "n_microbatches": args.microbatches,
        "n_virtual": args.virtual,
        "recompute": args.recompute,
        "cost": args.cost,
    }
    try:
        prof = profile(model, sample, device=args.device)
        ours = partition(model, args.stages, sample, memory_limit=args.memory_limit, profile=prof, **opts)
    except ValueError as err:
        _library_error(parser, err)
    # the baselines split into the same k = p * v stages, priced with the costs ours minimised
    k, m = ours.n_stages, ours.n_microbatches
    costs, _ = layer_costs(prof, args.cost, recompute=args.recompute, n_microbatches=m)
    plans = {"ours (exact)": ours}
    print_profile(prof)
    for label, balance in (
        ("equal layer counts", equal_balance(len(model), k)),
        ("torchgpipe balance_by_time", torchgpipe_balance(costs, k)),
    ):
        if min(balance) < 1:
            print(f"\n== {label}\nbalance {balance} leaves a stage empty: no pipeline can run it")
            continue
        plans[label] = plan_for(prof, balance, **opts)
    for label, plan in plans.items():
        print()
        print(plan.table(f"== {label}", reference=ours.bottleneck))
    if args.measure:
        print()
        print(measure(args.model, ours, args.measure_steps))
    if args.json:
        with open(args.json, "w") as f:
            f.write(ours.to_json())
        print(f"\nsaved our plan to {args.json}")
    if args.plot:
        plot(plans, args.plot)
        print(f"saved the plot to {args.plot}")
    return 0


def _library_error(parser: argparse.ArgumentParser, err: ValueError) -> NoReturn:
    """Exit with the library's message, naming the flag behind each argument it mentions."""
    text = str(err)
    named = [f"{flag} sets {arg}" for arg, flag in FLAGS.items() if arg in text]
    parser.error(text + (f" ({'; '.join(named)})" if named else ""))


if __name__ == "__main__":
    sys.exit(main())
