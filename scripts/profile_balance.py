"""Stage balance of a model: its per-layer profile, then our split beside equal counts and torchgpipe.

    python scripts/profile_balance.py --model gpt --stages 4
    python scripts/profile_balance.py --model resnet --stages 2 --schedule gpipe --microbatches 8
    python scripts/profile_balance.py --model mypkg.models:build --stages 4 --json plan.json --plot plan.png
    python scripts/profile_balance.py --model gpt --stages 2 --measure     # run the plan, time each stage

``--model`` is a built-in (gpt, resnet, mlp from ``pipeline.models``) or ``module:function`` returning
``(nn.Sequential, sample)``; the sample is one micro-batch. All three splits use the same per-layer
costs, so the bottleneck ratios compare the algorithms, not the measurements.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from partitioner import COSTS, Plan, layer_costs, partition, plan_for, profile
from partitioner.baselines import equal_balance, torchgpipe_balance
from partitioner.memory import SCHEDULE_NAMES
from pipeline.reference import models

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
        f"{'i':>3} {'name':<6} {'kind':<18} {'fwd ms':>8} {'bwd ms':>8} {'MFLOP':>9} "
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
    for n, (label, p) in enumerate(plans.items()):
        xs = [j + n * width for j in range(len(p.stages))]
        ax.bar(xs, [s.cost for s in p.stages], width=width, label=label)
    ax.set_xlabel("stage")
    ax.set_ylabel(f"stage cost ({next(iter(plans.values())).cost})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


# -- --measure: the plan run for real, one process per rank ----------------------------------------


def _square_loss(output: Any, target: Any) -> Any:
    # Any scalar will do for timing: a backward costs the same whatever the loss.
    return output.float().square().mean()


def _measured_rank(spec: str, balance: list[int], schedule: str, m: int, n_virtual: int, steps: int) -> Any:
    import statistics
    import time

    import torch

    from pipeline import Pipeline

    torch.manual_seed(0)  # every rank builds the same model
    model, sample = load_model(spec, argparse.ArgumentParser())
    batch = torch.cat([sample] * m)  # the sample is one micro-batch
    targets = torch.zeros(batch.shape[0])
    pipe = Pipeline(
        model, balance, schedule=schedule, n_microbatches=m, n_virtual=n_virtual, loss_fn=_square_loss
    )
    walls, busy = [], []
    for step in range(steps + 1):
        start = time.perf_counter()
        pipe.step(batch, targets)
        for t in pipe.parameters():
            t.grad = None
        if step > 0:  # the first step sets up shapes and buffers
            walls.append(time.perf_counter() - start)
            busy.append(pipe.busy_time)
    return statistics.median(walls), statistics.median(busy)


def measure(spec: str, plan: Plan, steps: int) -> str:
    """Per rank: the plan's predicted busy time beside the measured one, and the step times."""
    from pipeline import launch

    n_virtual = plan.n_virtual
    n_ranks = len(plan.balance) // n_virtual
    results = launch(
        _measured_rank, n_ranks, spec, plan.balance, plan.schedule, plan.n_microbatches, n_virtual, steps
    )
    m = plan.n_microbatches
    lines = [
        f"== measured: {steps} steps after a warm-up, {n_ranks} processes (gloo, 1 thread each), "
        f"{plan.schedule}, m={m}",
        f"{'rank':>4}  {'stages':<8} {'predicted busy ms':>17} {'measured busy ms':>16} "
        f"{'measured/pred':>13}",
    ]
    for r, ((_, busy), pred) in enumerate(zip(results, plan.predicted_busy(), strict=True)):
        stages = list(range(r, len(plan.balance), n_ranks))
        ratio = busy / pred if pred > 0 else float("nan")
        names = ",".join(map(str, stages))
        lines.append(f"{r:>4}  {names:<8} {pred * 1e3:>17.2f} {busy * 1e3:>16.2f} {ratio:>13.3f}")
    wall = max(w for w, _ in results)
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
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES)
    parser.add_argument("--microbatches", type=int, default=None, help="default: one per rank")
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
    if args.stages < 1:
        parser.error(f"--stages ({args.stages}) must be >= 1")
    if args.measure_steps < 1:
        parser.error(f"--measure-steps ({args.measure_steps}) must be >= 1")
    if args.microbatches is not None and args.microbatches < 1:
        parser.error(f"--microbatches ({args.microbatches}) must be >= 1")

    if args.threads < 1:
        parser.error(f"--threads ({args.threads}) must be >= 1")
    torch.set_num_threads(args.threads)  # profile each layer as a rank will run it
    model, sample = load_model(args.model, parser)
    if args.stages > len(model):
        parser.error(f"--stages ({args.stages}) must be at most the model's {len(model)} layers")
    try:
        prof = profile(model, sample, device=args.device)
        opts: dict[str, Any] = {
            "schedule": args.schedule,
            "n_microbatches": args.microbatches,
            "cost": args.cost,
        }
        ours = partition(model, args.stages, sample, profile=prof, **opts)
    except ValueError as err:
        parser.error(str(err))
    costs, _ = layer_costs(prof, args.cost)
    plans = {
        "ours (exact)": ours,
        "equal layer counts": plan_for(prof, equal_balance(len(model), args.stages), **opts),
        "torchgpipe balance_by_time": plan_for(prof, torchgpipe_balance(costs, args.stages), **opts),
    }
    print_profile(prof)
    for label, p in plans.items():
        print()
        print(p.table(f"== {label}", reference=ours.bottleneck))
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


if __name__ == "__main__":
    sys.exit(main())
