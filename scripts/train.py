"""Train a character-level GPT on real text across pipeline ranks.

    python scripts/train.py     # 2 ranks, 1F1B, 1500 steps: ~2.5 min on 2 idle cores, 6-12 on busy ones
    python scripts/train.py --stages 4 --schedule zb-h1 --microbatches 8 --trace runs/zb.json
    python scripts/train.py --checkpoint-dir runs/ckpt --checkpoint-every 100   # the same command resumes
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 scripts/train.py --checkpoint-dir runs/ckpt
    python scripts/train.py --model gpt-tied --schedule interleaved-1f1b   # a module split on its graph
    python scripts/train.py --schedule auto --memory-limit 300MB   # schedule, m, v, recompute searched
    python scripts/train.py --dp 2 --stages 2 --zero    # 2 replicas of a 2-rank pipeline: 4 ranks, ZeRO-1
    torchrun --nproc-per-node 4 scripts/train.py --device cuda --dtype bf16
    torchrun --nnodes 2 --node-rank K --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        scripts/train.py --dp 2 --stages 4 --device cuda        # each node one pipeline of 4 GPUs

    flags -> plan (profile, partition: once) -> on every rank: Pipeline(model, plan), then per step
          pipe.step -> pipe.clip_grad_norm_ -> optimizer step; evaluate and save every so often
          -> busy time against the plan's prediction -> text sampled from the gathered model

    # p: pipeline ranks (--stages), dp: replicas, m: micro-batches, B: --batch-size, T: --seq-len

The flags, the world's split into dp x stages, auto and the faults: ``_train_flags.py`` (``--help``).
Mixed precision, progress lines and what is printed at the end: ``_train_support.py``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import _train_flags as flags
import _train_support as support
from _train_flags import Config, FlagError, blame

from partitioner import partition, plan_for, profile
from partitioner.partition import check_balance_layers, check_stage_count
from pipeline import checkpointing
from pipeline.launch import init_distributed, launch
from pipeline.plan import Plan
from pipeline.reference.data import VOCAB_SIZE, CharDataset
from pipeline.reference.models import gpt_loss
from pipeline.runtime.inputs.microbatch import split
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.schedule import schedule_options

_EVAL_BATCHES = 4
_AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_TIMEOUT_S = float(os.environ.get("STAGEWISE_TIMEOUT", "300"))  # bound on every wait for another rank,
# the pipeline's and the process group's (a checkpoint's collectives): a hung rank becomes a failure


# ---- the model and the plan


def build_model(cfg: Config, n_microbatches: int) -> tuple[nn.Module, torch.Tensor]:
    """The same model on every rank: seeded right before it is built. Sample: one micro-batch (rows,
    T) of ``n_microbatches`` (the plan's; the sample's rows do not change the model)."""
    torch.manual_seed(cfg.seed)
    rows = max(1, cfg.local_batch // n_microbatches)  # one replica's micro-batch
    return flags.MODELS[cfg.model](
        VOCAB_SIZE, cfg.width, cfg.layers, flags.N_HEADS, max_seq_len=cfg.seq_len, batch_size=rows
    )


def make_plan(cfg: Config, device: torch.device) -> Plan:
    """Profile and partition the model (or predict ``--balance``; or search with ``--schedule auto``), or
    reuse the plan a checkpoint of this very request recorded: a new profile may balance otherwise,
    and the run would not continue as it began. Every check is the library's. Downstream of this, the
    plan's schedule, m, v and recomputation are the run's, whatever the flags asked."""
    recorded = flags.recorded_plan(cfg)  # ``chosen`` finds the same record, to say where the plan came from
    if recorded is not None:
        plan = _recorded_plan(cfg, recorded[0], device)
    else:
        plan = _auto_plan(cfg, device) if cfg.auto else _fixed_plan(cfg, device)
    _check_split(cfg, plan.n_microbatches)
    return plan


def _check_split(cfg: Config, m: int) -> None:
    with blame(cfg, "batch_size", *(("dp",) if cfg.dp > 1 else ()), "microbatches"):  # one replica's batch
        split(torch.empty(cfg.local_batch, 0, device="meta"), m)


def _sample(cfg: Config, m: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model, a micro-batch of m's and its targets (random: only their shape matters)."""
    with blame(cfg, "width", "layers"):
        model, sample = build_model(cfg, m)
    target = torch.randint(0, VOCAB_SIZE, sample.shape, generator=torch.Generator().manual_seed(cfg.seed))
    return model, sample, target


def _profiled(cfg: Config, m: int, device: torch.device) -> tuple[nn.Module, torch.Tensor, Any]:
    """(model, sample, profile): one layer (gpt-tied: one group of its traced graph) at a time on the
    run's device, in its precision, with the loss: never the whole model on one device (a model that
    needs pipelining does not fit there)."""
    model, sample, target = _sample(cfg, m)
    if isinstance(model, nn.Sequential):  # before profiling: a wrong count fails at once
        with blame(cfg, "stages", "virtual", "layers"):
            check_stage_count(len(model), cfg.stages, cfg.virtual or 1)
        if cfg.balance is not None:  # (auto refuses --balance as it parses the flags)
            with blame(cfg, "balance", "layers"):
                check_balance_layers(cfg.balance, len(model), "the model")
    amp = _AMP[cfg.dtype]
    return model, sample, profile(model, sample, device=device, autocast=amp, loss_fn=gpt_loss, target=target)


def _fixed_plan(cfg: Config, device: torch.device) -> Plan:
    m = int(cfg.microbatches)  # not auto
    with blame(cfg, "schedule", "stages", "virtual", "microbatches"):
        schedule_options(cfg.schedule, cfg.stages, m, cfg.virtual)  # before profiling
    _check_split(cfg, m)  # before profiling too
    model, sample, prof = _profiled(cfg, m, device)
    opts: dict[str, Any] = dict(schedule=cfg.schedule, n_microbatches=m, n_virtual=cfg.virtual,
                                recompute=cfg.recompute, dp=cfg.dp, cost=cfg.cost)  # fmt: skip
    with blame(cfg, "stages", "balance", "virtual", "layers", "memory_limit"):
        if cfg.balance is None:
            return partition(model, cfg.stages, sample, profile=prof, memory_limit=cfg.memory_limit, **opts)
        plan = plan_for(prof, list(cfg.balance), **opts)
    if plan.n_ranks != cfg.stages:
        p, v = plan.n_ranks, plan.n_virtual
        raise FlagError(f"--balance gives {plan.n_stages} stages, {p} ranks x {v}, but --stages is "
                        f"{cfg.stages}: give {cfg.stages * v} layer counts")  # fmt: skip
    limit = math.inf if cfg.memory_limit is None else cfg.memory_limit
    usable = plan.usable_limits([limit] * plan.n_ranks)  # the limit less the device's reserve (workspaces...)
    peaks = zip(plan.rank_peaks, usable, strict=True)
    over = ", ".join(f"rank {r} {flags.megabytes(x)}" for r, (x, most) in enumerate(peaks) if x > most)
    if over:
        raise FlagError(f"{cfg.flags('balance', 'memory_limit')}: the predicted peak exceeds the limit "
                        f"({over}); raise --memory-limit, give another --balance, or omit --balance to have "
                        "the partitioner fit the limit")  # fmt: skip
    return plan


def _recorded_plan(cfg: Config, shape: dict[str, Any], device: torch.device) -> Plan:
    """The plan a checkpoint recorded (``flags.recorded_plan``), predicted on a new profile (for the
    busy-time report); its balance, schedule, m, v and recomputation are the recorded ones."""
    m = int(shape["n_microbatches"])
    mode = shape["recompute"] if isinstance(shape["recompute"], str) else tuple(shape["recompute"])
    _, _, prof = _profiled(cfg, m, device)
    with blame(cfg, "stages", "layers"):
        return plan_for(prof, list(shape["balance"]), schedule=shape["schedule"], n_microbatches=m,
                        n_virtual=int(shape["n_virtual"]), recompute=mode, dp=cfg.dp,
                        cost=cfg.cost)  # fmt: skip


def _auto_plan(cfg: Config, device: torch.device) -> Plan:
    """The searched plan."""
    # the sample may have any rows (the profile is scaled to each m searched): the fixed m's, or 4's
    model, sample, target = _sample(cfg, cfg.microbatches if isinstance(cfg.microbatches, int) else 4)
    with blame(cfg, "schedule", "microbatches", "stages", "virtual", "batch_size", "dp", "memory_limit"):
        return partition(model, cfg.stages, sample, schedule=cfg.schedule, n_microbatches=cfg.microbatches,
                         n_virtual=cfg.virtual, dp=cfg.dp, cost=cfg.cost, memory_limit=cfg.memory_limit,
                         batch_size=cfg.local_batch, autocast=_AMP[cfg.dtype], loss_fn=gpt_loss,
                         target=target, device=device)  # fmt: skip


def chosen(cfg: Config, plan: Plan) -> str | None:
    """What ``--schedule auto`` chose, or the recorded plan a restart reused: printed once, by rank 0,
    under the plan's table, which lists auto's runners-up. None: a plan made as the flags ask."""
    asked = cfg.flags("schedule", "microbatches", "virtual", "memory_limit")
    what = f"{plan.summary()} balance {plan.balance}"
    recorded = flags.recorded_plan(cfg)  # what make_plan reused, if anything (no checkpoint is saved before)
    if recorded is not None:
        return (f"{f'auto ({asked})' if cfg.auto else 'restart'}: reusing the plan recorded in "
                f"{recorded[1]}, {what}, not {'searching' if cfg.auto else 'partitioning'} again (a new "
                "profile may choose another plan, and the run would not continue as it began)")  # fmt: skip
    if not cfg.auto:
        return None
    limit = "" if cfg.memory_limit is None else f" (limit {flags.megabytes(cfg.memory_limit)})"
    grid, seconds = (plan.search.grid, plan.search.seconds) if plan.search is not None else ("?", 0.0)
    return (f"auto ({asked}): chose {what}: predicted step {plan.step_time * 1e3:.2f} ms, bubble "
            f"{plan.bubble:.3f}, peak per rank {', '.join(map(flags.megabytes, plan.rank_peaks))}"
            f"{limit}; searched {grid} configurations in {seconds:.2f} s, "
            f"{len(plan.candidates)} within 10 % in the table above")  # fmt: skip


# ---- the optimizer and the learning rate


def optimizer(cfg: Config, pipe: Pipeline) -> torch.optim.Optimizer:
    """AdamW over this rank's parameters; with ``--zero`` its state sharded over the replicas (ZeRO-1)."""
    kw: dict[str, Any] = dict(
        lr=cfg.lr, betas=tuple(flags.ADAMW["betas"]), weight_decay=flags.ADAMW["weight_decay"]
    )
    if not cfg.zero:
        return torch.optim.AdamW(pipe.parameters(), **kw)
    return ZeroRedundancyOptimizer(pipe.parameters(), torch.optim.AdamW, process_group=pipe.dp_group, **kw)


def learning_rate(cfg: Config, step: int) -> float:
    """Linear warmup then cosine decay to a tenth: a pure function of the step, so resume is exact."""
    warmup = max(1, min(100, cfg.steps // 10))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


# ---- one rank


def train(cfg: Config, plan: Plan) -> dict[str, Any]:
    """One rank's whole run; returns its per-step losses and evaluations, or ``{"error": why}`` when
    the run was refused or stopped (every rank decides that together, so every rank returns it)."""
    try:
        return _train(cfg, plan)
    except (support.RunStopped, checkpointing.ConfigMismatch) as exc:
        hint = " (flags: --allow-config-change KEY,... for deliberate changes)"
        return {"rank": dist.get_rank(), "error": str(exc) + (hint if isinstance(exc, ValueError) else "")}


def _train(cfg: Config, plan: Plan) -> dict[str, Any]:
    rank, device = dist.get_rank(), _device(cfg)
    replica, pp_rank = divmod(rank, cfg.stages)  # the mesh's layout: pp innermost
    first, last = pp_rank == 0, pp_rank == cfg.stages - 1  # stage 0 on pipeline rank 0, the last on p - 1
    data = CharDataset.load(cfg.data) if first or last else None  # inputs to the first, targets to the last
    model, _ = build_model(cfg, plan.n_microbatches)
    if rank == 0 and data is not None:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"data: {data.source}, {len(data.train):,} train / {len(data.val):,} val characters, "
              f"vocabulary {VOCAB_SIZE}\nmodel: {cfg.model}, {cfg.layers} blocks, width {cfg.width}, "
              f"{n_params / 1e6:.2f}M parameters\n{plan}", flush=True)  # fmt: skip
        said = chosen(cfg, plan)
        if said is not None:
            print(said, flush=True)
    precision = support.Precision(cfg.dtype, device)
    pipe = Pipeline(model, plan, loss_fn=gpt_loss, device=device, timeout=_TIMEOUT_S)
    opt = optimizer(cfg, pipe)
    config = flags.run_config(cfg, plan)
    resumed = None  # the newest sound checkpoint in --checkpoint-dir, if any: the same command restarts
    if cfg.checkpoint_dir is not None:
        resumed = checkpointing.resume(cfg.checkpoint_dir, pipe=pipe, optimizer=opt, config=config,
                                       grad_scaler=precision.scaler,
                                       allow_changes=cfg.allow_changes)  # fmt: skip
        if rank == 0:  # say which (and any damaged newer one passed over)
            print(resumed or f"no checkpoint in {cfg.checkpoint_dir}: a new run", flush=True)
    start = 0 if resumed is None else resumed.step

    def batch(split_name: str, step: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if data is None:  # a middle rank: the pipeline brings its inputs
            return None, None
        x, y = data.batch(split_name, step, cfg.batch_size, cfg.seq_len, cfg.seed)  # (B, T): every replica's
        rows = slice(replica * cfg.local_batch, (replica + 1) * cfg.local_batch)  # this replica's share
        return (x[rows] if first else None), (y[rows] if last else None)  # copied by the pipeline

    def loss_of(run: Callable[..., float], split_name: str, step: int, **kw: Any) -> float:
        with precision.autocast():  # pipe.step or pipe.evaluate
            return float(run(*batch(split_name, step), **kw))

    shown = rank == dist.get_world_size() - 1  # the last stage's rank of the last replica
    progress = support.Progress(cfg.steps, start, cfg.batch_size * cfg.seq_len, show=shown and not cfg.quiet)
    log = support.StepLog(cfg.loss_log if rank == 0 else None, start)
    losses, evals, busy, window = [], [], [], []
    bad = support.BadSteps(cfg.max_bad_steps, say=progress.write if rank == 0 else None)
    t_run = t_window = time.perf_counter()
    for step in range(start, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        record = cfg.trace is not None and step == min(start + 1, cfg.steps - 1)  # the second step: warm
        loss = loss_of(pipe.step, "train", step, record=record, **precision.step_options())
        busy.append(pipe.busy_time)
        if record and cfg.trace is not None:
            Path(cfg.trace).parent.mkdir(parents=True, exist_ok=True)
            pipe.write_trace(cfg.trace, support.predicted_timeline(plan))
            if rank == 0:
                progress.write(f"wrote the measured timeline of step {step} to {cfg.trace}")
        support.injected_nan(pipe, rank, step + 1)  # test-only, STAGEWISE_TEST_NAN
        stepped = precision.update(pipe, opt, flags.CLIP)  # every rank the same: all step, or all skip
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
        window.append(loss)
        done = step + 1
        progress.step(done, loss)
        log.step(done, loss)
        bad.step(done, stepped)  # a RunStopped after too many skipped in a row
        if done % cfg.eval_every == 0 or done == cfg.steps:
            val = sum(loss_of(pipe.evaluate, "val", k) for k in range(_EVAL_BATCHES)) / _EVAL_BATCHES
            tok_s = len(window) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - t_window)
            evals.append((done, sum(window) / len(window), val, tok_s))
            if shown:
                progress.write(f"step {done} | train loss {evals[-1][1]:.4f} | val loss {val:.4f} | "
                               f"tokens/s {tok_s:,.0f}")  # fmt: skip
            window, t_window = [], time.perf_counter()
        # the batches are drawn by step, so the step is all a checkpoint needs of the data
        due = done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)
        if cfg.checkpoint_dir and due and not bad.streak:  # a skipped update leaves the last good one newest
            checkpointing.save(cfg.checkpoint_dir, done, pipe=pipe, optimizer=opt, config=config,
                               grad_scaler=precision.scaler, extra={"step": done})  # fmt: skip
    seconds = time.perf_counter() - t_run
    support.report_busy(pipe, plan, busy)
    state, text = pipe.gather_state_dict(dst=0) if cfg.sample_chars else None, ""  # in every replica
    if state is not None and rank == 0:
        full, _ = build_model(cfg, plan.n_microbatches)
        support.load_gathered(full, state)
        text = support.generate(full.to(device), "def ", cfg.sample_chars, cfg.seq_len, cfg.seed)
        print("---- generated text ----\n" + text + "\n------------------------", flush=True)
    ran = pipe.schedule  # what this rank ran: the plan's
    return {"rank": rank, "start": start, "losses": losses, "evals": evals, "seconds": seconds,
            "sample": text, "ran": (ran.name, ran.n_microbatches, ran.n_virtual),
            "balance": plan.balance}  # fmt: skip


def _device(cfg: Config) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


# ---- entry


def _stopped(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results, or exit 2 with the error every rank returned."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        if results[0]["rank"] == 0:  # under torchrun each process returns its own rank's
            print(f"train.py: error: {errors[0]}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return results


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Parse and plan, then run every rank: spawned here, or this process's rank under torchrun."""
    cfg = flags.parse_args(argv)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if flags.torchrun_world() is None:
        try:
            plan = make_plan(cfg, _device(cfg))  # profiled with a rank's threads (profile's default)
        except FlagError as exc:
            flags.fail(str(exc))
        return _stopped(launch(train, cfg.dp * cfg.stages, cfg, plan, backend=backend, timeout=_TIMEOUT_S))
    init_distributed(backend, timeout=_TIMEOUT_S)  # dcp's collectives in a save wait this long at most
    try:
        box: list[Any] = [None]
        if dist.get_rank() == 0:  # one profile, so that every rank runs the same plan
            try:
                box[0] = make_plan(cfg, _device(cfg))
            except FlagError as exc:
                box[0] = str(exc)
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            flags.fail(box[0])
        return _stopped([train(cfg, box[0])])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
