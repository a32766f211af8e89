"""Train a character-level GPT on real text across pipeline ranks.

    python scripts/train.py     # 2 ranks, 1F1B, 1500 steps: ~2.5 min on 2 idle cores, 6-12 on busy ones
    python scripts/train.py --stages 4 --schedule zb-h1 --microbatches 8 --trace runs/zb.json
    python scripts/train.py --checkpoint-dir runs/ckpt --checkpoint-every 100   # the same command resumes
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 scripts/train.py --checkpoint-dir runs/ckpt
    python scripts/train.py --model gpt-tied --schedule interleaved-1f1b   # a module split on its graph
    python scripts/train.py --schedule auto --memory-limit 300MB   # schedule, m, v, recompute searched
    python scripts/train.py --dp 2 --stages 2 --zero    # 2 replicas of a 2-rank pipeline: 4 ranks, ZeRO-1
    torchrun --nproc-per-node 4 scripts/train.py --device cuda --dtype bf16
    torchrun --nnodes 2 --node-rank K --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        scripts/train.py --dp 2 --stages 4 --device cuda        # each node one pipeline of 4 GPUs

    flags -> plan (profile, partition: once) -> on every rank: Pipeline(model, plan), then per step
          pipe.step -> pipe.clip_grad_norm_ -> optimizer step; evaluate and save every so often
          -> busy time against the plan's prediction -> text sampled from the gathered model

Standalone, this process makes the plan and spawns one process per rank, dp x
stages of them (gloo, one thread each); under ``torchrun`` rank 0 makes it and
sends it to the others, and every process is one rank (NCCL on GPUs): the
world is split into dp replicas of a pipeline of ``stages`` ranks, global rank
g = d * stages + r (replica d, pipeline rank r; see pipeline/runtime/mesh.py).
``--model gpt`` is an ``nn.Sequential`` (embedding, blocks, norm, head), split
between its layers; ``--model gpt-tied`` is the GPT as users write it (a
ModuleList of blocks called in a loop, the head's weight the token
embedding's), traced and split on its layer graph, the tied weight's copies
summed across the ranks that hold them. ``--batch-size`` is the whole step's
batch: each replica trains on its own 1/dp of it, so a run at any dp computes
the same losses. The library checks every option; its ValueError becomes one
line naming the flags involved (exit code 2). The data is the Python standard
library's own source (``pipeline.reference.data``) unless ``--data`` names a
text file or folder. The progress bar needs tqdm
(``pip install -e ".[train]"``); without it, or when stderr is not a terminal,
plain progress lines are printed instead, and ``--quiet`` prints none.

Auto. ``--schedule auto`` (and/or ``--microbatches auto``, the default with
``--schedule auto``; an integer keeps m fixed) has the partitioner search the
schedule, micro-batch count, stages per rank, recomputation per stage and
balance together, the fastest predicted configuration whose every rank's
predicted peak fits ``--memory-limit`` (bytes per rank: 300MB, 1.5GB, 512MiB
or plain bytes; without auto it bounds the partitioner's balance).
Recomputation is then searched, so ``--recompute`` and ``--balance`` are
refused. Rank 0 prints the choice and the runners-up. Everything after the
search runs the plan's values; the checkpoints record what was asked
("auto", the limit) and the plan chosen, and a restart of the same command
reuses that recorded plan instead of searching again (a new profile could
choose another plan, and the run would no longer continue the same way).

Faults. With ``--checkpoint-dir D`` every start resumes from the newest sound
checkpoint in D (a damaged one is passed over, named) and says which, so the
one command both starts a run and restarts it (``torchrun --max-restarts``
reruns it as it is; ``--resume`` is accepted and changes nothing). Each
checkpoint records the run's configuration (``run_config``); a start whose
configuration differs is refused with the list of differences, unless
``--allow-config-change stages,dp`` names the deliberate ones. An update
whose loss or gradients are not finite on any rank is skipped on every rank
(and no checkpoint is written until a good step); ``--max-bad-steps`` in a
row stop the run with the last good checkpoint intact. Test-only:
STAGEWISE_TEST_NAN="RANK:STEP,STEP" puts a NaN into a gradient of global
rank RANK at those 1-based steps (see ``_train_support.injected_nan``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from _train_support import (
    BadSteps,
    Precision,
    Progress,
    RunStopped,
    StepLog,
    generate,
    injected_nan,
    load_gathered,
    predicted_timeline,
    report_busy,
    resume,
    save,
)

from partitioner import COSTS, partition, plan_for, profile
from partitioner.partition import check_stage_count
from pipeline import checkpointing
from pipeline.checkpoint.folder import candidates, read_manifest
from pipeline.checkpoint.manifest import Manifest
from pipeline.launch import init_distributed, launch
from pipeline.plan import Plan
from pipeline.reference.data import VOCAB_SIZE, CharDataset
from pipeline.reference.graph_models import gpt_tied
from pipeline.reference.models import gpt, gpt_loss
from pipeline.runtime.microbatch import split
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.recompute import RECOMPUTE_MODES
from pipeline.schedules.schedule import SCHEDULES, schedule_options

_N_HEADS, _EVAL_BATCHES, _CLIP = 4, 4, 1.0
MODELS = {"gpt": gpt, "gpt-tied": gpt_tied}  # the Sequential; the traced module with a tied head
_TIMEOUT_S = float(os.environ.get("STAGEWISE_TIMEOUT", "300"))  # bound on every wait for another rank,
# the pipeline's and the process group's (a checkpoint's collectives): a hung rank becomes a failure


@dataclass(frozen=True)
class Config:
    """One field per flag. ``stages``: pipeline ranks; ``virtual`` None: the schedule's default."""

    model: str = "gpt"
    stages: int = 2
    dp: int = 1
    zero: bool = False
    schedule: str = "1f1b"  # or "auto": searched with m, v and recompute
    virtual: int | None = None
    microbatches: int | str = 4  # or "auto" (the default with --schedule auto)
    memory_limit: int | None = None  # bytes per rank
    batch_size: int = 16
    seq_len: int = 128
    steps: int = 1500
    lr: float = 2e-3
    layers: int = 4
    width: int = 128
    balance: tuple[int, ...] | None = None
    cost: str = "time"
    recompute: str = "never"
    device: str = "cpu"
    dtype: str = "fp32"
    data: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False  # accepted, changes nothing: a --checkpoint-dir holding a checkpoint resumes
    allow_config_change: tuple[str, ...] = ()
    max_bad_steps: int = 3
    trace: str | None = None
    eval_every: int = 100
    seed: int = 0
    sample_chars: int = 300
    quiet: bool = False
    loss_log: str | None = None

    @property
    def auto(self) -> bool:
        """The partitioner searches the configuration (schedule and/or micro-batch count)."""
        return self.schedule == AUTO or self.microbatches == AUTO

    @property
    def local_batch(self) -> int:
        """Sequences per replica and step."""
        return self.batch_size // self.dp

    def flags(self, *names: str) -> str:
        """The named fields as typed on the command line (``--batch-size 16``), unset ones left out."""
        values = {n: getattr(self, n) for n in names}
        shown = {n: ",".join(map(str, v)) if isinstance(v, tuple) else v for n, v in values.items()}
        return " ".join(f"--{n.replace('_', '-')} {v}" for n, v in shown.items() if v is not None)


# ---------------------------------------------------------------------------- flags and plan

AUTO = "auto"
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_SIZE_FORMS = ("300MB, 1.5GB, 512MiB or plain bytes (300000000, 3e8); units B, KB, MB, GB, TB (powers of "
               "1000) and KiB, MiB, GiB, TiB (powers of 1024)")  # fmt: skip


def memory_size(text: str) -> int:
    """``--memory-limit``: "300MB", "1.5GB", "512MiB", "3e8" -> bytes (an int >= 1)."""
    found = re.fullmatch(r"\s*((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = found.group(2).lower() if found else ""
    if found is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size; give bytes per rank: {_SIZE_FORMS}")
    value = float(found.group(1)) * _SIZE_UNITS[unit]
    if not 1 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is {value:g} bytes: a limit must be at least 1 byte")
    return round(value)


def _microbatches(text: str) -> int | str:
    if text == AUTO:
        return AUTO
    try:
        m = int(text)
    except ValueError:
        m = 0
    if m < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}")
    return m


def _at_least(low: float, kind: Callable[[str], Any] = int) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if kind(text) < low:  # not a number at all: argparse's own "invalid int value"
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the whole usage text
        _fail(message)


def _parser() -> argparse.ArgumentParser:
    d, count, more = Config(), _at_least(1), _at_least(0)
    p = _Parser(prog="train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", choices=MODELS, default=d.model,
        help="gpt: an nn.Sequential; gpt-tied: a ModuleList of blocks, head tied to embedding")  # fmt: skip
    add("--stages", type=int, help=f"pipeline ranks (default {d.stages}; under torchrun: the world / --dp)")
    add("--dp", type=int, help="pipeline replicas, data-parallel (default 1; torchrun: world / --stages)")
    add("--zero", action="store_true", help="shard the optimizer state over the replicas (ZeRO-1)")
    add("--schedule", choices=(*SCHEDULES, AUTO), default=d.schedule,
        help="auto: schedule, micro-batches, stages per rank, recomputation searched together")  # fmt: skip
    add("--virtual", type=int, help="stages per rank (default 2 for interleaved-1f1b, else 1)")
    add("--microbatches", type=_microbatches,
        help=f"per replica, or auto (default: auto if --schedule auto, else {d.microbatches})")  # fmt: skip
    add("--memory-limit", metavar="SIZE", type=memory_size,
        help="predicted peak bytes per rank the plan must fit: 300MB, 1.5GB, 512MiB or bytes")  # fmt: skip
    add("--batch-size", type=count, default=d.batch_size,
        help="sequences per step over all replicas, each replica's split into micro-batches")  # fmt: skip
    add("--seq-len", type=count, default=d.seq_len)
    add("--steps", type=count, default=d.steps)
    add("--lr", type=_at_least(0.0, float), default=d.lr, help="peak learning rate (warmup, cosine to 10%%)")
    add("--layers", type=count, default=d.layers, help="transformer blocks")
    add("--width", type=count, default=d.width, help=f"model width, a multiple of {_N_HEADS} (heads)")
    add("--balance", help="layer counts per stage, e.g. 3,4 (default: the partitioner's)")
    add("--cost", choices=COSTS, default=d.cost, help="what the partitioner balances")
    add("--recompute", choices=RECOMPUTE_MODES,
        help=f"activation recomputation (default {d.recompute}; searched per stage with auto)")  # fmt: skip
    add("--device", choices=("cpu", "cuda"), default=d.device)
    add("--dtype", choices=("fp32", "bf16", "fp16"), default=d.dtype, help="autocast dtype")
    add("--data", help="text file or folder (default: the standard library's sources)")
    add("--checkpoint-dir", help="folder of checkpoints (made if missing)")
    add("--checkpoint-every", type=more, default=d.checkpoint_every, help="steps; 0: only at the end")
    add("--resume", action="store_true", help="accepted, changes nothing: --checkpoint-dir resumes by itself")
    add("--allow-config-change", metavar="FLAGS", default="",
        help="comma-separated flags that may differ from the checkpoint's run, e.g. stages,dp")  # fmt: skip
    add("--max-bad-steps", type=count, default=d.max_bad_steps,
        help="stop after this many updates in a row skipped for a non-finite loss or gradient")  # fmt: skip
    add("--trace", metavar="PATH", help="write one step's measured timeline (Chrome trace); folders are made")
    add("--eval-every", type=count, default=d.eval_every)
    add("--seed", type=int, default=d.seed)
    add("--sample-chars", type=more, default=d.sample_chars, help="characters of text generated at the end")
    add("--quiet", action="store_true", help="no progress output")
    add("--loss-log", metavar="PATH", help="write each step's loss as a JSON line (rank 0); folders are made")
    return p


def _fail(message: str) -> NoReturn:
    """One line on stderr and exit code 2, as argparse does for a bad flag."""
    print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _torchrun_world() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in os.environ else None


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Flags -> Config, checking what only this script knows; ``make_plan`` asks the library the rest."""
    a, world = _parser().parse_args(argv), _torchrun_world()
    for flag, value in (("--stages", a.stages), ("--dp", a.dp)):
        if value is not None and value < 1:
            _fail(f"{flag} {value} must be >= 1")
    a.stages, a.dp = _split_world(world, a.stages, a.dp)
    if a.zero and a.dp < 2:
        _fail("--zero shards the optimizer state over the replicas: give --dp 2 or more")
    if a.batch_size % a.dp != 0:
        even = a.dp * max(1, a.batch_size // a.dp)
        _fail(f"--batch-size {a.batch_size} --dp {a.dp}: the batch is split evenly over the replicas, so "
              f"--batch-size must be a multiple of --dp (e.g. {even})")  # fmt: skip
    try:
        a.balance = None if a.balance is None else tuple(int(x) for x in a.balance.split(","))
    except ValueError:
        _fail(f"--balance {a.balance!r} must be comma-separated layer counts, e.g. 3,4")
    if a.microbatches is None:
        a.microbatches = AUTO if a.schedule == AUTO else Config.microbatches
    if AUTO in (a.schedule, a.microbatches):
        given = f"--schedule {a.schedule} --microbatches {a.microbatches}"
        if a.recompute is not None:
            _fail(f"{given} --recompute {a.recompute}: the search chooses recomputation per stage; omit "
                  "--recompute (or give a --schedule and an integer --microbatches)")  # fmt: skip
        if a.balance is not None:
            _fail(f"{given} --balance {','.join(map(str, a.balance))}: the search chooses the balance; omit "
                  "--balance (or give a --schedule and an integer --microbatches)")  # fmt: skip
    a.recompute = a.recompute or Config.recompute
    if a.resume and a.checkpoint_dir is None:
        _fail("--resume needs --checkpoint-dir (which resumes by itself when it holds a checkpoint)")
    a.allow_config_change = tuple(
        x.strip().lstrip("-").replace("-", "_") for x in a.allow_config_change.split(",") if x.strip()
    )
    unknown = [x for x in a.allow_config_change if x not in CONFIG_KEYS]
    if unknown:
        _fail(f"--allow-config-change {','.join(unknown)}: not a recorded setting; use flags among "
              f"{', '.join(k.replace('_', '-') for k in CONFIG_KEYS)}")  # fmt: skip
    try:
        if a.data is not None:
            CharDataset.load(a.data).check(a.seq_len)
    except (OSError, ValueError) as exc:
        _fail(f"--data {a.data} --seq-len {a.seq_len}: {exc}")
    if a.device == "cuda" and torch.cuda.device_count() < (1 if world else a.stages * a.dp):
        _fail(f"--device cuda needs a GPU per rank: {a.stages * a.dp} ranks, {torch.cuda.device_count()} "
              "GPUs here")  # fmt: skip
    return Config(**vars(a))


def _split_world(world: int | None, stages: int | None, dp: int | None) -> tuple[int, int]:
    """(stages, dp): as given standalone (defaults 2 and 1); under torchrun the world is dp x stages,
    and a missing one of the two is what the world leaves."""
    if world is None:
        return stages or Config.stages, dp or 1
    if stages is None and dp is None:
        return world, 1
    given = stages if stages is not None else dp
    assert given is not None
    if world % given != 0 or (stages is not None and dp is not None and stages * dp != world):
        shown = " ".join(f"--{n} {v}" for n, v in (("stages", stages), ("dp", dp)) if v is not None)
        _fail(f"{shown} does not split torchrun's world of {world} ranks into dp x stages; give --stages "
              "and --dp whose product is the world size (or one of them, dividing it)")  # fmt: skip
    if stages is None:
        assert dp is not None
        return world // dp, dp
    return stages, world // stages if dp is None else dp


class FlagError(ValueError):
    """A plan the library refused, in the command line's terms."""


@contextlib.contextmanager
def _blame(cfg: Config, *names: str) -> Iterator[None]:
    """A library ValueError inside becomes a FlagError naming the flags that fed the call."""
    try:
        yield
    except ValueError as exc:
        raise FlagError(f"{cfg.flags(*names)}: {exc}") from exc


def build_model(cfg: Config, n_microbatches: int) -> tuple[nn.Module, torch.Tensor]:
    """The same model on every rank: seeded right before it is built. Sample: one micro-batch of
    ``n_microbatches`` (the plan's; the sample's rows do not change the model)."""
    torch.manual_seed(cfg.seed)
    rows = max(1, cfg.local_batch // n_microbatches)  # one replica's micro-batch
    return MODELS[cfg.model](
        VOCAB_SIZE, cfg.width, cfg.layers, _N_HEADS, max_seq_len=cfg.seq_len, batch_size=rows
    )


def make_plan(cfg: Config, device: torch.device) -> Plan:
    """Profile and partition the model (or predict ``--balance``; or search with ``--schedule auto``).
    Every check is the library's. Downstream of this, the plan's schedule, m, v and recomputation
    are the run's, whatever the flags asked."""
    amp = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    plan = _auto_plan(cfg, device, amp) if cfg.auto else _fixed_plan(cfg, device, amp)
    with _blame(cfg, "batch_size", *(("dp",) if cfg.dp > 1 else ()), "microbatches"):  # one replica's batch
        split(torch.empty(cfg.local_batch, 0, device="meta"), plan.n_microbatches)
    return plan


def _profiled(cfg: Config, n_microbatches: int, device: torch.device, amp: torch.dtype | None) -> Any:
    """(model, sample, target, profile): profiled one layer (gpt-tied: one group of its traced graph)
    at a time on the run's device, in its precision, with the loss: never the whole model on one
    device (a model that needs pipelining does not fit there)."""
    with _blame(cfg, "width", "layers"):
        model, sample = build_model(cfg, n_microbatches)
    if isinstance(model, nn.Sequential):  # before profiling: a wrong count fails at once
        with _blame(cfg, "stages", "virtual", "layers"):
            check_stage_count(len(model), cfg.stages, cfg.virtual or 1)
    target = torch.randint(0, VOCAB_SIZE, sample.shape, generator=torch.Generator().manual_seed(cfg.seed))
    prof = profile(model, sample, device=device, autocast=amp, loss_fn=gpt_loss, target=target)
    return model, sample, target, prof


def _fixed_plan(cfg: Config, device: torch.device, amp: torch.dtype | None) -> Plan:
    assert isinstance(cfg.microbatches, int)  # not auto
    with _blame(cfg, "schedule", "stages", "virtual", "microbatches"):
        schedule_options(cfg.schedule, cfg.stages, cfg.microbatches, cfg.virtual)  # before profiling
    with _blame(cfg, "batch_size", *(("dp",) if cfg.dp > 1 else ()), "microbatches"):  # before profiling too
        split(torch.empty(cfg.local_batch, 0, device="meta"), cfg.microbatches)
    model, sample, _, prof = _profiled(cfg, cfg.microbatches, device, amp)
    opts: dict[str, Any] = dict(schedule=cfg.schedule, n_microbatches=cfg.microbatches, n_virtual=cfg.virtual,
                                recompute=cfg.recompute, dp=cfg.dp, cost=cfg.cost)  # fmt: skip
    with _blame(cfg, "stages", "balance", "virtual", "layers", "memory_limit"):
        if cfg.balance is None:
            return partition(model, cfg.stages, sample, profile=prof, memory_limit=cfg.memory_limit, **opts)
        plan = plan_for(prof, list(cfg.balance), **opts)
    if plan.n_ranks != cfg.stages:
        raise FlagError(
            f"--balance gives {plan.n_stages} stages, {plan.n_ranks} ranks x {plan.n_virtual}, but --stages "
            f"is {cfg.stages}: give {cfg.stages * plan.n_virtual} layer counts"
        )
    over = [(r, peak) for r, peak in enumerate(plan.rank_peaks) if
            cfg.memory_limit is not None and peak > cfg.memory_limit]  # fmt: skip
    if over:
        peaks = ", ".join(f"rank {r} {peak / 1e6:.2f} MB" for r, peak in over)
        raise FlagError(
            f"{cfg.flags('balance', 'memory_limit')}: the predicted peak exceeds the limit ({peaks}); raise "
            "--memory-limit, give another --balance, or omit --balance to have the partitioner fit the limit"
        )
    return plan


def _auto_plan(cfg: Config, device: torch.device, amp: torch.dtype | None) -> Plan:
    """The searched plan; or, when ``--checkpoint-dir`` holds a checkpoint of this very request, the plan
    that run chose (recorded in the checkpoint), so that a restart continues the same run."""
    recorded = _recorded_plan(cfg)
    if recorded is not None:  # ``chosen`` finds the same record, to say where the plan came from
        shape, _ = recorded
        m = int(shape["n_microbatches"])
        mode = shape["recompute"] if isinstance(shape["recompute"], str) else tuple(shape["recompute"])
        *_, prof = _profiled(cfg, m, device, amp)
        with _blame(cfg, "stages", "layers"):
            v = int(shape["n_virtual"])
            return plan_for(prof, list(shape["balance"]), schedule=shape["schedule"], n_microbatches=m,
                            n_virtual=v, recompute=mode, dp=cfg.dp, cost=cfg.cost)  # fmt: skip
    # the sample may have any rows (the profile is scaled to each m searched): the fixed m, or the
    # default's rows
    given_m = cfg.microbatches if isinstance(cfg.microbatches, int) else 4
    with _blame(cfg, "width", "layers"):
        model, sample = build_model(cfg, given_m)
    target = torch.randint(0, VOCAB_SIZE, sample.shape, generator=torch.Generator().manual_seed(cfg.seed))
    with _blame(cfg, "schedule", "microbatches", "stages", "virtual", "batch_size", "dp", "memory_limit"):
        return partition(model, cfg.stages, sample, schedule=cfg.schedule, n_microbatches=cfg.microbatches,
                         n_virtual=cfg.virtual, dp=cfg.dp, cost=cfg.cost, memory_limit=cfg.memory_limit,
                         batch_size=cfg.local_batch, autocast=amp, loss_fn=gpt_loss, target=target,
                         device=device)  # fmt: skip


# what shapes the plan among the recorded settings: a checkpoint whose values of these are the current
# ones holds the plan to reuse
_PLAN_SHAPERS = ("model", "layers", "width", "seq_len", "stages", "dp", "schedule", "virtual", "microbatches",
                 "batch_size", "recompute", "dtype", "memory_limit", "balance")  # fmt: skip


def _recorded_plan(cfg: Config) -> tuple[dict[str, Any], Path] | None:
    """The plan entry of the newest checkpoint in ``--checkpoint-dir`` (its manifest's config, read here
    without verifying the files: ``resume`` verifies them, and compares the whole configuration), when
    that run asked for what ``cfg`` asks and recorded its balance (an auto run); else None."""
    if cfg.checkpoint_dir is None:
        return None
    for path in candidates(Path(cfg.checkpoint_dir)):
        found = read_manifest(path)
        if isinstance(found, Manifest):
            saved = found.config or {}
            break
    else:
        return None
    asked = asked_config(cfg)
    shape = saved.get("plan")
    if not isinstance(shape, dict) or "balance" not in shape:
        return None
    if any(saved.get(k, None) != asked.get(k, None) for k in _PLAN_SHAPERS):
        return None  # another request: search again (resume then lists the differences)
    return shape, path


# ---------------------------------------------------------------------------- pieces of a run


def learning_rate(cfg: Config, step: int) -> float:
    """Linear warmup then cosine decay to a tenth: a pure function of the step, so resume is exact."""
    warmup = max(1, min(100, cfg.steps // 10))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


# ---------------------------------------------------------------------------- one rank


def train(cfg: Config, plan: Plan) -> dict[str, Any]:
    """One rank's whole run; returns its per-step losses and evaluations, or ``{"error": why}`` when
    the run was refused or stopped (every rank decides that together, so every rank returns it)."""
    try:
        return _train(cfg, plan)
    except (RunStopped, checkpointing.ConfigMismatch) as exc:
        hint = " (flags: --allow-config-change KEY,... for deliberate changes)"
        return {"rank": dist.get_rank(), "error": str(exc) + (hint if isinstance(exc, ValueError) else "")}


def _train(cfg: Config, plan: Plan) -> dict[str, Any]:
    rank, device = dist.get_rank(), _device(cfg)
    replica, pp_rank = divmod(rank, cfg.stages)  # the mesh's layout: pp innermost
    first, last = pp_rank == 0, pp_rank == cfg.stages - 1  # stage 0 on pipeline rank 0, the last on p - 1
    data = CharDataset.load(cfg.data) if first or last else None
    model, _ = build_model(cfg, plan.n_microbatches)
    if rank == 0 and data is not None:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"data: {data.source}, {len(data.train):,} train / {len(data.val):,} val characters, "
              f"vocabulary {VOCAB_SIZE}\nmodel: {cfg.model}, {cfg.layers} blocks, width {cfg.width}, "
              f"{n_params / 1e6:.2f}M parameters\n{plan}", flush=True)  # fmt: skip
        if cfg.auto:
            print(chosen(cfg, plan), flush=True)
    precision = Precision(cfg.dtype, device)
    pipe = Pipeline(model, plan, loss_fn=precision.loss_fn, device=device, timeout=_TIMEOUT_S)
    opt = optimizer(cfg, pipe)
    config = run_config(cfg, plan)
    start = resume(cfg.checkpoint_dir, pipe, opt, precision, config, cfg.allow_config_change)

    def batch(split_name: str, step: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if data is None:  # inputs go to the first rank, targets to the last
            return None, None
        x, y = data.batch(split_name, step, cfg.batch_size, cfg.seq_len, cfg.seed)  # every replica's rows
        rows = slice(replica * cfg.local_batch, (replica + 1) * cfg.local_batch)  # this replica's share
        return (x[rows] if first else None), (y[rows] if last else None)  # copied by the pipeline

    def loss_of(run: Callable[..., float], split_name: str, step: int, **kw: Any) -> float:
        with precision.autocast():  # pipe.step or pipe.evaluate
            return float(run(*batch(split_name, step), **kw)) / precision.scale

    shown = rank == dist.get_world_size() - 1  # the last stage's rank of the last replica
    progress = Progress(cfg.steps, start, cfg.batch_size * cfg.seq_len, show=shown and not cfg.quiet)
    log = StepLog(cfg.loss_log if rank == 0 else None, start)
    losses, evals, busy, window = [], [], [], []
    bad = BadSteps(cfg.max_bad_steps, say=progress.write if rank == 0 else None)
    t_run = t_window = time.perf_counter()
    for step in range(start, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        precision.begin_step()
        record = cfg.trace is not None and step == min(start + 1, cfg.steps - 1)
        loss = loss_of(pipe.step, "train", step, record=record)
        busy.append(pipe.busy_time)
        if record and cfg.trace is not None:
            Path(cfg.trace).parent.mkdir(parents=True, exist_ok=True)
            pipe.write_trace(cfg.trace, predicted_timeline(plan))
            if rank == 0:
                progress.write(f"wrote the measured timeline of step {step} to {cfg.trace}")
        injected_nan(pipe, rank, step + 1)  # test-only, STAGEWISE_TEST_NAN
        stepped = precision.update(pipe, opt, _CLIP)  # every rank the same: all step, or all skip
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
        if (
            cfg.checkpoint_dir
            and not bad.streak
            and (  # a skipped update leaves the last good one newest
                done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)
            )
        ):
            save(cfg.checkpoint_dir, done, pipe, opt, precision, config)
    seconds = time.perf_counter() - t_run
    report_busy(pipe, plan, busy)
    state, text = pipe.gather_state_dict(dst=0) if cfg.sample_chars else None, ""  # in every replica
    if state is not None and rank == 0:
        full, _ = build_model(cfg, plan.n_microbatches)
        load_gathered(full, state)
        text = generate(full.to(device), "def ", cfg.sample_chars, cfg.seq_len, cfg.seed)
        print("---- generated text ----\n" + text + "\n------------------------", flush=True)
    ran = pipe.schedule  # what this rank ran: the plan's
    return {"rank": rank, "start": start, "losses": losses, "evals": evals, "seconds": seconds,
            "sample": text, "ran": (ran.name, ran.n_microbatches, ran.n_virtual)}  # fmt: skip


def chosen(cfg: Config, plan: Plan) -> str:
    """What ``--schedule auto`` chose (or reused): printed once, by rank 0, under the plan's table, which
    lists the runners-up."""
    asked = cfg.flags("schedule", "microbatches", "virtual", "memory_limit")
    what = f"{plan.summary()} balance {plan.balance}"
    recorded = _recorded_plan(cfg)  # what _auto_plan reused, if anything (no checkpoint is saved before)
    if recorded is not None:
        return (f"auto ({asked}): reusing the plan recorded in {recorded[1]}, {what}, not "
                "searching again (a new profile may choose another plan, and the run would not continue "
                "as it began)")  # fmt: skip
    limit = "" if cfg.memory_limit is None else f" (limit {cfg.memory_limit / 1e6:.2f} MB)"
    grid, seconds = (plan.search.grid, plan.search.seconds) if plan.search is not None else ("?", 0.0)
    return (f"auto ({asked}): chose {what}: predicted step {plan.step_time * 1e3:.2f} ms, bubble "
            f"{plan.bubble:.3f}, peak per rank {', '.join(f'{x / 1e6:.2f}' for x in plan.rank_peaks)} "
            f"MB{limit}; searched {grid} configurations in {seconds:.2f} s, "
            f"{len(plan.candidates)} within 10 % in the table above")  # fmt: skip


CONFIG_KEYS = ("model", "layers", "width", "seq_len", "stages", "dp", "zero", "schedule", "virtual",
               "microbatches", "memory_limit", "batch_size", "steps", "lr", "balance", "recompute", "dtype",
               "data", "seed", "plan", "optimizer")  # fmt: skip  # what a checkpoint records (run_config)


_ADAMW: dict[str, Any] = dict(betas=[0.9, 0.99], weight_decay=0.1)  # besides lr, set per step


def asked_config(cfg: Config) -> dict[str, Any]:
    """``run_config`` without the plan: what the flags asked ("auto", the memory limit), as recorded."""
    skip = ("plan", "optimizer", "data", "memory_limit")
    out: dict[str, Any] = {k: getattr(cfg, k) for k in CONFIG_KEYS if k not in skip}
    if cfg.memory_limit is not None:  # absent when unset: the runs recorded before the flag resume
        out["memory_limit"] = cfg.memory_limit
    out["balance"] = None if cfg.balance is None else list(cfg.balance)
    out["data"] = "python-stdlib" if cfg.data is None else str(Path(cfg.data).resolve())
    out["optimizer"] = {"name": "AdamW", **_ADAMW, "clip": _CLIP, "schedule": "warmup-cosine-0.1"}
    return out


def run_config(cfg: Config, plan: Plan) -> dict[str, Any]:
    """What each checkpoint records of its run and a resume compares, one entry per CONFIG_KEYS: the
    flags as asked (``asked_config``), the plan's shape (its balance only when given: a fresh profile
    may balance otherwise, and a checkpoint loads at any balance; an auto run records its chosen
    balance too, so a restart reuses the whole plan, see ``_recorded_plan``), the optimizer and the
    data (an absolute path)."""
    out = asked_config(cfg)
    out["plan"] = {
        "schedule": plan.schedule,
        "n_stages": plan.n_stages,
        "n_virtual": plan.n_virtual,
        "n_microbatches": plan.n_microbatches,
        "recompute": plan.recompute if isinstance(plan.recompute, str) else list(plan.recompute),  # JSON
        "dp": plan.dp,
    }
    if cfg.auto:
        out["plan"]["balance"] = list(plan.balance)
    return out


def optimizer(cfg: Config, pipe: Pipeline) -> torch.optim.Optimizer:
    """AdamW over this rank's parameters; with ``--zero`` its state sharded over the replicas (ZeRO-1)."""
    kw: dict[str, Any] = dict(lr=cfg.lr, betas=tuple(_ADAMW["betas"]), weight_decay=_ADAMW["weight_decay"])
    if not cfg.zero:
        return torch.optim.AdamW(pipe.parameters(), **kw)
    return ZeroRedundancyOptimizer(pipe.parameters(), torch.optim.AdamW, process_group=pipe.dp_group, **kw)


def _device(cfg: Config) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


# ---------------------------------------------------------------------------- entry


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
    cfg = parse_args(argv)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if _torchrun_world() is None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # profile as the ranks run: one thread each
        try:
            plan = make_plan(cfg, _device(cfg))
        except FlagError as exc:
            _fail(str(exc))
        finally:
            torch.set_num_threads(threads)
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
            _fail(box[0])
        return _stopped([train(cfg, box[0])])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
