"""Stage balance of a model: its per-layer profile, then our split beside equal counts and torchgpipe.

    python scripts/profile_balance.py --model gpt --stages 4
    python scripts/profile_balance.py --model resnet --stages 2 --schedule gpipe --microbatches 8
    python scripts/profile_balance.py --model gpt --stages 2 --schedule interleaved-1f1b   # 2 ranks x 2
    python scripts/profile_balance.py --model mypkg.models:build --stages 4 --json plan.json --plot plan.png
    python scripts/profile_balance.py --model gpt --stages 2 --measure     # run the plan, time each rank
    python scripts/profile_balance.py --model gpt --stages 2 --dtype bf16 --measure
    python scripts/profile_balance.py --model gpt --stages 4 --bandwidth measure --memory-limit 2e8

    # p: ranks (--stages), v: stages per rank (--virtual), k = p * v stages

``--stages`` is the number of pipeline ranks (devices), as ``partition``'s ``n_ranks``; with
``--schedule interleaved-1f1b`` each rank holds ``--virtual`` stages (default 2). ``--model`` is a
built-in (gpt, resnet, mlp from ``pipeline.reference.models``) or ``module:function`` returning
``(nn.Sequential, sample)``; the sample is one micro-batch. All three splits use the same per-layer
costs, so the bottleneck ratios compare the algorithms, not the measurements.

The profile runs in the run's precision (``--dtype``: bf16 and fp16 are autocast, as in training)
and includes the loss that ``--measure`` trains with. ``--measure`` runs the plan where the profile
ran: gloo processes on CPU for a CPU profile, NCCL with a GPU per rank for a CUDA one, under the
same autocast; its header says which. ``--bandwidth measure`` times each link by ping-pong on that
backend first (``partitioner.measure_links``). torchgpipe's column needs ``pip install torchgpipe``
and is skipped, with a note, without it.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

from partitioner import COSTS, Links, Plan, Profile, layer_costs, measure_links, partition, plan_for, profile
from partitioner.baselines import equal_balance, torchgpipe_balance
from partitioner.partition import check_stage_count
from pipeline.reference import models
from pipeline.schedules.modes import check_mode
from pipeline.schedules.schedule import SCHEDULES, schedule_options

# The library's arguments behind this script's flags, to say which flag an error is about.
FLAGS = {
    "n_ranks": "--stages",
    "n_microbatches": "--microbatches",
    "n_virtual": "--virtual",
    "recompute": "--recompute",
    "memory_limit": "--memory-limit",
    "bandwidth": "--bandwidth",
    "latency": "--latency",
}

DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

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
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:  # the working directory's modules, as python -m
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not module_name.startswith(err.name):
            raise  # the user's module itself imports something missing: its own traceback says what
        parser.error(f"--model {spec!r}: no module {err.name!r}; the module must be importable from the "
                     f"working directory ({here}) or from PYTHONPATH")  # fmt: skip
    fn = getattr(module, func_name, None)
    if not callable(fn):
        parser.error(f"--model {spec!r}: module {module_name!r} ({module.__file__}) has no function "
                     f"{func_name!r}")  # fmt: skip
    built = fn()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Sequential)):
        parser.error(f"--model {spec!r} must return (nn.Sequential, sample)")
    return built[0], built[1]


def print_profile(prof: Profile) -> None:
    precision = f"autocast {prof.autocast}" if prof.autocast else "fp32"
    print(
        f"per-layer profile on {prof.device}, {precision} (one micro-batch; minimum of adaptive repeats); "
        f"profiling took {prof.seconds:.2f} s, {prof.peak_bytes / 1e6:.2f} MB at its peak"
    )
    print(
        f"{'l':>3} {'name':<6} {'kind':<18} {'fwd ms':>8} {'bwd ms':>8} {'B ms':>7} {'W ms':>7} "
        f"{'GFLOP':>7} {'params MB':>9} {'out MB':>7} {'saved MB':>8}  output"
    )
    rows = list(prof.layers) + ([prof.loss] if prof.loss is not None else [])
    for lp in rows:
        index = "-" if lp.index < 0 else str(lp.index)
        print(
            f"{index:>3} {lp.name:<6} {lp.kind[:18]:<18} "
            f"{lp.forward_time * 1e3:>8.3f} {lp.backward_time * 1e3:>8.3f} "
            f"{lp.input_time * 1e3:>7.3f} {lp.weight_time * 1e3:>7.3f} "
            f"{(lp.flops + lp.backward_flops) / 1e9:>7.3f} {lp.param_bytes / 1e6:>9.3f} "
            f"{lp.activation_bytes / 1e6:>7.3f} {lp.saved_bytes / 1e6:>8.3f}  "
            f"{list(lp.output_shape)} {lp.output_dtype}" + (" in-place" if lp.inplace else "")
        )


def require_matplotlib(parser: argparse.ArgumentParser) -> None:
    """``--plot`` draws with matplotlib: checked before any profiling, not after all of it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error(
            "--plot draws with matplotlib, which is not installed: pip install matplotlib, or drop --plot"
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


def _pipeline(model: nn.Sequential, plan: Plan, device: torch.device) -> Any:
    """``Pipeline`` running ``plan`` (its schedule, m, v and recomputation) on ``device``."""
    from pipeline import Pipeline

    options = inspect.signature(Pipeline).parameters
    mode: dict[str, Any] = {"recompute" if "recompute" in options else "checkpoint": plan.recompute}
    return Pipeline(
        model,
        plan,
        loss_fn=_square_loss,
        schedule=plan.schedule,
        n_microbatches=plan.n_microbatches,
        n_virtual=plan.n_virtual,
        device=device,
        **mode,
    )


def _measured_rank(spec: str, plan_json: str, steps: int, dtype: str) -> Any:
    import statistics
    import time

    import torch.distributed as dist

    torch.manual_seed(0)  # every rank builds the same model
    model, sample = load_model(spec, argparse.ArgumentParser())
    plan = Plan.from_json(plan_json)
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    batch = torch.cat([sample] * plan.n_microbatches)  # the sample is one micro-batch
    targets = torch.zeros(batch.shape[0])
    pipe = _pipeline(model, plan, device)
    ran = pipe.schedule
    amp = DTYPES[dtype]
    walls, busy = [], []
    for step in range(steps + 1):
        if nccl:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            pipe.step(batch, targets)
        if nccl:
            torch.cuda.synchronize(device)
        for t in pipe.parameters():
            t.grad = None
        if step > 0:  # the first step sets up shapes and buffers
            walls.append(time.perf_counter() - start)
            busy.append(pipe.busy_time)
    where = torch.cuda.get_device_name(device) if nccl else f"cpu, {torch.get_num_threads()} thread(s)"
    shape = (ran.name, ran.n_microbatches, ran.n_virtual)
    return statistics.median(walls), statistics.median(busy), shape, (dist.get_backend(), where)


def _backend(prof: Profile) -> str:
    """Where the profile ran decides where the measurement runs: gloo on CPU, NCCL on GPUs."""
    return "nccl" if "cuda" in prof.device else "gloo"


def _links_rank(size: int) -> Links:
    return measure_links(size=size)


def _measured_links(p: int, v: int, backend: str) -> Links:
    """Each link's latency and bandwidth, by ping-pong between p local processes on ``backend``;
    the last link (rank p - 1 -> 0) only when v > 1 uses it."""
    from pipeline import launch

    links: Links = launch(_links_rank, p, 1 << 22, backend=backend)[0]
    used = p if v > 1 else p - 1
    print(
        f"measured links on {backend} (ping-pong): latency "
        + ", ".join(f"{x * 1e6:.1f} us" for x in links.latency[:used])
        + "; bandwidth "
        + ", ".join(f"{x / 1e9:.3f} GB/s" for x in links.bandwidth[:used])
    )
    return Links(latency=links.latency[:used], bandwidth=links.bandwidth[:used])


def measure(spec: str, plan: Plan, steps: int, prof: Profile, dtype: str) -> str:
    """Per rank: the plan's predicted busy time beside the measured one, and the step times."""
    from pipeline import launch

    p = plan.n_ranks
    results = launch(_measured_rank, p, spec, plan.to_json(), steps, dtype, backend=_backend(prof))
    name, m, v = results[0][2]
    backend, where = results[0][3]
    ran = f"[{name}, m={m}, v={v}]"
    planned = f"[{plan.schedule}, m={plan.n_microbatches}, v={plan.n_virtual}]"
    lines = [
        f"== measured: {steps} steps after a warm-up, {p} processes on {backend} ({where} per rank), "
        f"{dtype}, ran {ran}"
        + ("" if ran == planned else f" -- NOT the plan's {planned}: the times below are not the plan's"),
        f"{'rank':>4}  {'stages':<8} {'predicted busy ms':>17} {'measured busy ms':>16} "
        f"{'measured/pred':>13}",
    ]
    for r, (result, pred) in enumerate(zip(results, plan.predicted_busy(), strict=True)):
        busy = result[1]
        stages = list(range(r, plan.n_stages, p))
        ratio = busy / pred if pred > 0 else float("nan")
        names = ",".join(map(str, stages))
        lines.append(f"{r:>4}  {names:<8} {pred * 1e3:>17.2f} {busy * 1e3:>16.2f} {ratio:>13.3f}")
    wall = max(result[0] for result in results)
    lines.append(
        f"step time: predicted {plan.step_time * 1e3:.2f} ms, measured {wall * 1e3:.2f} ms "
        f"({wall / plan.step_time:.3f}x the prediction)"
    )
    return "\n".join(lines)


def _numbers(text: str | None, flag: str, parser: argparse.ArgumentParser) -> float | list[float] | None:
    """One number, or comma-separated numbers (one per rank or link)."""
    if text is None:
        return None
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{flag} {text!r} must be a number or comma-separated numbers")
    return values[0] if len(values) == 1 else values


def _baselines(prof: Profile, k: int, costs: list[float], n_layers: int) -> list[tuple[str, list[int] | str]]:
    """(label, balance or why there is none) for equal counts and torchgpipe's balance."""
    out: list[tuple[str, list[int] | str]] = [("equal layer counts", equal_balance(n_layers, k))]
    try:
        out.append(("torchgpipe balance_by_time", torchgpipe_balance(costs, k)))
    except ImportError:
        out.append(
            ("torchgpipe balance_by_time", "skipped: torchgpipe is not installed (pip install torchgpipe)")
        )
    return out


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
    parser.add_argument(
        "--memory-limit", default=None, help="bytes per rank: one number, or one per rank (comma-separated)"
    )
    parser.add_argument(
        "--bandwidth",
        default=None,
        help="bytes/s per link: one number, one per link (comma-separated), or 'measure' (ping-pong)",
    )
    parser.add_argument("--latency", default=None, help="seconds per message per link, as --bandwidth")
    parser.add_argument("--cost", default="time", choices=COSTS)
    parser.add_argument(
        "--dtype", default="fp32", choices=tuple(DTYPES), help="the run's precision (autocast)"
    )
    parser.add_argument(
        "--profile-dtype",
        default=None,
        choices=tuple(DTYPES),
        help="profile in another precision than --dtype (to see what a mismatched profile predicts)",
    )
    parser.add_argument("--device", default=None, help="where to profile (default: where each layer lives)")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per layer, at least")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU intra-op threads (default 1, as each launched rank)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="save our plan as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="draw per-stage cost bars (matplotlib)")
    parser.add_argument(
        "--measure", action="store_true", help="run a few real steps of our plan and time each rank"
    )
    parser.add_argument("--measure-steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument(
        "--auto",
        action="store_true",
        help="search schedule, micro-batches, stages per rank and recomputation per stage under "
        "--memory-limit, and print the candidates table (the sample is any rows; see --batch-size)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="--auto: rows of one step (default: the sample's)"
    )
    args = parser.parse_args(argv)
    if args.plot:
        require_matplotlib(parser)
    if args.measure_steps < 1:
        parser.error(f"--measure-steps ({args.measure_steps}) must be >= 1")
    if args.threads < 1:
        parser.error(f"--threads ({args.threads}) must be >= 1")
    if args.repeat < 1:
        parser.error(f"--repeat ({args.repeat}) must be >= 1")
    memory_limit = _numbers(args.memory_limit, "--memory-limit", parser)
    latency = _numbers(args.latency, "--latency", parser)
    measure_bandwidth = args.bandwidth == "measure"
    bandwidth = None if measure_bandwidth else _numbers(args.bandwidth, "--bandwidth", parser)
    try:  # the schedule's options are the library's to check, before the slow profile
        v, _ = schedule_options(args.schedule, args.stages, args.microbatches, args.virtual)
        check_mode(args.recompute)
    except ValueError as err:
        _library_error(parser, err)
    model, sample = load_model(args.model, parser)
    try:  # the stage count too: a Sequential's layers are known before it is profiled
        check_stage_count(len(model), args.stages, v)
    except ValueError as err:
        _library_error(parser, err)
    opts: dict[str, Any] = {
        "schedule": args.schedule,
        "n_microbatches": args.microbatches,
        "n_virtual": args.virtual,
        "recompute": args.recompute,
        "cost": args.cost,
    }
    amp = DTYPES[args.profile_dtype or args.dtype]
    try:
        prof = profile(
            model,
            sample,
            device=args.device,
            autocast=amp,
            loss_fn=_square_loss,  # the loss --measure trains with: it runs on the last stage
            target=torch.zeros(_rows(sample)),
            repeat=args.repeat,
            threads=args.threads,  # each layer timed as a rank will run it
        )
        if measure_bandwidth:
            links = _measured_links(args.stages, 2 if args.auto else v, _backend(prof))
            bandwidth = links.bandwidth
            latency = links.latency if latency is None else latency
        net: dict[str, Any] = {"bandwidth": bandwidth, "latency": latency}
        if args.auto:
            return _auto(model, sample, prof, args, memory_limit, net)
        ours = partition(model, args.stages, sample, memory_limit=memory_limit, profile=prof, **net, **opts)
    except (ValueError, TypeError) as err:
        _library_error(parser, err)
    # the baselines split into the same k = p * v stages, priced with the costs ours minimised
    k, m = ours.n_stages, ours.n_microbatches
    split = ours.build_schedule().split_backward
    costs = layer_costs(prof, args.cost, recompute=args.recompute, n_microbatches=m, split_backward=split)
    plans = {"ours (exact)": ours}
    print_profile(prof)
    for label, balance in _baselines(prof, k, costs, len(model)):
        if isinstance(balance, str):
            print(f"\n== {label}\n{balance}")
        elif min(balance) < 1:
            print(f"\n== {label}\nbalance {balance} leaves a stage empty: no pipeline can run it")
        else:
            plans[label] = plan_for(prof, balance, **net, **opts)
    for label, plan in plans.items():
        print()
        print(plan.table(f"== {label}", reference=ours.bottleneck))
        for problem in plan.problems:
            print(f"cannot run: {problem}")
    if args.measure:
        print()
        print(measure(args.model, ours, args.measure_steps, prof, args.dtype))
    if args.json:
        with open(args.json, "w") as f:
            f.write(ours.to_json())
        print(f"\nsaved our plan to {args.json}")
    if args.plot:
        plot(plans, args.plot)
        print(f"saved the plot to {args.plot}")
    return 0


def _auto(
    model: nn.Sequential,
    sample: Any,
    prof: Profile,
    args: argparse.Namespace,
    memory_limit: float | list[float] | None,
    net: dict[str, Any],
) -> int:
    """--auto: the searched plan, its stage table and the candidates within 10 % of it."""
    batch = args.batch_size or _rows(sample)
    plan = partition(model, args.stages, sample, schedule="auto", batch_size=batch, memory_limit=memory_limit,
                     cost=args.cost, profile=prof, **net)  # fmt: skip
    print_profile(prof)
    print()
    print(plan.table(f"== auto: {plan.summary()}, micro-batches of {plan.micro_batch_rows} rows"))
    found = plan.search
    assert found is not None  # the search's plan records it
    print(
        f"\nsearched {found.grid} configurations in {found.seconds:.2f} s: simulated "
        f"{found.simulated}, pruned {found.pruned_group} by the time bound, {found.pruned_fit} by "
        f"memory, {found.pruned_balance} by their balance"
    )
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json())
        print(f"\nsaved the plan to {args.json}")
    return 0


def _rows(sample: Any) -> int:
    first = sample[0] if isinstance(sample, (tuple, list)) else sample
    return int(first.shape[0])


def _library_error(parser: argparse.ArgumentParser, err: ValueError | TypeError) -> NoReturn:
    """Exit with the library's message, naming the flag behind each argument it mentions."""
    text = str(err)
    named = [f"{flag} sets {arg}" for arg, flag in FLAGS.items() if arg in text]
    parser.error(text + (f" ({'; '.join(named)})" if named else ""))


if __name__ == "__main__":
    sys.exit(main())
