"""The command line of ``scripts/train.py``: its flags, made into a ``Config`` and checked before any rank
starts; a bad one is one line on stderr and exit code 2.

The world. Standalone, train.py makes the plan and spawns one process per rank, dp x stages of them
(gloo, one thread each); under ``torchrun`` rank 0 makes it and sends it to the others, and every
process is one rank (NCCL on GPUs): the world is split into dp replicas of a pipeline of ``stages``
ranks, global rank g = d * stages + r (replica d, pipeline rank r; see pipeline/runtime/replicas/mesh.py).
``--batch-size`` is the whole step's batch: each replica trains on its own 1/dp of it, so a run at
any dp computes the same losses.

The model. ``--model gpt`` is an ``nn.Sequential`` (embedding, blocks, norm, head), split between its
layers; ``--model gpt-tied`` is the GPT as users write it (a ModuleList of blocks called in a loop,
the head's weight the token embedding's), traced and split on its layer graph, the tied weight's
copies summed across the ranks that hold them. The data is the Python standard library's own source
(``pipeline.reference.data``) unless ``--data`` names a text file or folder. The progress bar needs
tqdm (``pip install -e ".[train]"``); without it, or when stderr is not a terminal, plain progress
lines are printed instead, and ``--quiet`` prints none.

Checks. The library checks every option; its ValueError becomes one line naming the flags involved
(``blame``; the library's errors speak of its API, never of flags).

Auto. ``--schedule auto`` (and/or ``--microbatches auto``, the default with ``--schedule auto``; an
integer keeps m fixed) has the partitioner search the schedule, micro-batch count, stages per rank,
recomputation per stage and balance together, the fastest predicted configuration whose every
rank's predicted peak fits ``--memory-limit`` (bytes per rank: 300MB, 1.5GB, 512MiB or plain bytes;
without auto it bounds the partitioner's balance). Recomputation is then searched, so
``--recompute`` and ``--balance`` are refused. Rank 0 prints the choice and the runners-up.
Everything after the search runs the plan's values; the checkpoints record what was asked ("auto",
the limit) and the plan chosen, and a restart of the same command reuses that recorded plan instead
of searching again (a new profile could choose another plan, and the run would no longer continue
the same way). So does a restart of a fixed schedule whose balance the partitioner chose (no
``--balance``): a different balance computes the same model with sums in another order.

Faults. With ``--checkpoint-dir D`` every start resumes from the newest sound checkpoint in D (a
damaged one is passed over, named) and says which, so the one command both starts a run and
restarts it (``torchrun --max-restarts`` reruns it as it is; ``--resume`` is accepted and changes
nothing). Each checkpoint records the run's configuration (``CONFIG_KEYS``); a start whose
configuration differs is refused with the list of differences, unless ``--allow-config-change
stages,dp`` names the deliberate ones. An update whose loss or gradients are not finite on any rank
is skipped on every rank (and no checkpoint is written until a good step); ``--max-bad-steps`` in a
row stop the run with the last good checkpoint intact. Test-only: STAGEWISE_TEST_NAN="RANK:STEP,STEP"
puts a NaN into a gradient of global rank RANK at those 1-based steps (``_train_support.injected_nan``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from partitioner import COSTS
from pipeline import checkpointing
from pipeline.plan import Plan
from pipeline.reference.data import CharDataset
from pipeline.reference.graph_models import gpt_tied
from pipeline.reference.models import gpt
from pipeline.runtime.step.recompute import RECOMPUTE_MODES
from pipeline.schedules.schedule import SCHEDULES

__all__ = ["ADAMW", "AUTO", "CLIP", "CONFIG_KEYS", "MODELS", "N_HEADS", "Config", "FlagError",
           "asked_config", "blame", "fail", "megabytes", "memory_size", "parse_args", "recorded_plan",
           "run_config", "split_world", "torchrun_world"]  # fmt: skip

AUTO = "auto"
N_HEADS = 4  # attention heads: --width must be a multiple
MODELS = {"gpt": gpt, "gpt-tied": gpt_tied}  # the Sequential; the traced module with a tied head
CONFIG_KEYS = ("model", "layers", "width", "seq_len", "stages", "dp", "zero", "schedule", "virtual",
               "microbatches", "memory_limit", "batch_size", "steps", "lr", "balance", "recompute", "dtype",
               "data", "seed", "plan", "optimizer")  # fmt: skip  # what a checkpoint records (run_config)
ADAMW: dict[str, Any] = dict(betas=[0.9, 0.99], weight_decay=0.1)  # and lr, set per step
CLIP = 1.0  # the gradients' total norm, clipped to this


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

    @property
    def allow_changes(self) -> set[str]:
        """``--allow-config-change`` as ``checkpointing.resume`` takes it: recorded keys, and with a flag
        that shapes the plan the whole plan entry (``stages``: the plan is made again, its stage count,
        balance and, with auto, all it searched may change)."""
        allowed = self.allow_config_change
        return set(allowed) | ({"plan"} if any(k in _PLAN_SHAPERS for k in allowed) else set())

    def flags(self, *names: str) -> str:
        """The named fields as typed on the command line (``--batch-size 16``), unset ones left out."""
        values = {n: getattr(self, n) for n in names}
        shown = {n: ",".join(map(str, v)) if isinstance(v, tuple) else v for n, v in values.items()}
        if values.get("memory_limit") is not None:  # as it is typed: 300MB, not 300000000
            shown["memory_limit"] = megabytes(values["memory_limit"]).replace(" ", "")
        return " ".join(f"--{n.replace('_', '-')} {v}" for n, v in shown.items() if v is not None)


# ---- values

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


def megabytes(n: float) -> str:
    """Bytes as ``--memory-limit`` reads them: 29092864.0 -> "29.1 MB", 3e8 -> "300 MB", 512 -> "512 B"
    (three significant digits, units of 1000 as in the flag's B, KB, MB, GB, TB)."""
    if not math.isfinite(n):
        return f"{n} B"
    value, unit = float(n), "B"
    for larger in ("KB", "MB", "GB", "TB"):
        if abs(value) < 999.5:
            break
        value, unit = value / 1000, larger
    return f"{value:.3g} {unit}"


# a byte count in the library's memory errors (it speaks of its API in bytes: "is 1692096.0", "(100000)",
# "933309.0 bytes"): 4 digits or more, not a keyword's value ("n_microbatches=16")
_BYTES = re.compile(r"(?<![\w.=])(\d{4,}(?:\.\d+)?(?:[eE][+-]?\d+)?)(?: bytes)?(?![\w.])")


def _in_megabytes(message: str) -> str:
    """The library's memory error with its byte counts read as the flag takes them ("1.69 MB")."""
    return _BYTES.sub(lambda found: megabytes(float(found.group(1))), message)


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


# ---- the parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the whole usage text
        fail(message)


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
    add("--width", type=count, default=d.width, help=f"model width, a multiple of {N_HEADS} (heads)")
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


def fail(message: str) -> NoReturn:
    """One line on stderr and exit code 2, as argparse does for a bad flag."""
    print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def torchrun_world() -> int | None:
    """The world size when torchrun started this process, else None."""
    return int(os.environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in os.environ else None


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Flags -> Config, checking what only this script knows; ``make_plan`` asks the library the rest."""
    a, world = _parser().parse_args(argv), torchrun_world()
    for flag, value in (("--stages", a.stages), ("--dp", a.dp)):
        if value is not None and value < 1:
            fail(f"{flag} {value} must be >= 1")
    a.stages, a.dp = split_world(world, a.stages, a.dp)
    if a.zero and a.dp < 2:
        fail("--zero shards the optimizer state over the replicas: give --dp 2 or more")
    if a.batch_size % a.dp != 0:
        even = a.dp * max(1, a.batch_size // a.dp)
        fail(f"--batch-size {a.batch_size} --dp {a.dp}: the batch is split evenly over the replicas, so "
             f"--batch-size must be a multiple of --dp (e.g. {even})")  # fmt: skip
    try:
        a.balance = None if a.balance is None else tuple(int(x) for x in a.balance.split(","))
    except ValueError:
        fail(f"--balance {a.balance!r} must be comma-separated layer counts, e.g. 3,4")
    if a.microbatches is None:
        a.microbatches = AUTO if a.schedule == AUTO else Config.microbatches
    if AUTO in (a.schedule, a.microbatches):
        given = f"--schedule {a.schedule} --microbatches {a.microbatches}"
        if a.recompute is not None:
            fail(f"{given} --recompute {a.recompute}: the search chooses recomputation per stage; omit "
                 "--recompute (or give a --schedule and an integer --microbatches)")  # fmt: skip
        if a.balance is not None:
            fail(f"{given} --balance {','.join(map(str, a.balance))}: the search chooses the balance; omit "
                 "--balance (or give a --schedule and an integer --microbatches)")  # fmt: skip
    a.recompute = a.recompute or Config.recompute
    if a.resume and a.checkpoint_dir is None:
        fail("--resume needs --checkpoint-dir (which resumes by itself when it holds a checkpoint)")
    a.allow_config_change = tuple(
        x.strip().lstrip("-").replace("-", "_") for x in a.allow_config_change.split(",") if x.strip()
    )
    unknown = [x for x in a.allow_config_change if x not in CONFIG_KEYS]
    if unknown:
        fail(f"--allow-config-change {','.join(unknown)}: not a recorded setting; use flags among "
             f"{', '.join(k.replace('_', '-') for k in CONFIG_KEYS)}")  # fmt: skip
    try:
        if a.data is not None:
            CharDataset.load(a.data).check(a.seq_len)
    except (OSError, ValueError) as exc:
        fail(f"--data {a.data} --seq-len {a.seq_len}: {exc}")
    if a.device == "cuda" and torch.cuda.device_count() < (1 if world else a.stages * a.dp):
        fail(f"--device cuda needs a GPU per rank: {a.stages * a.dp} ranks, {torch.cuda.device_count()} "
             "GPUs here")  # fmt: skip
    return Config(**vars(a))


def split_world(world: int | None, stages: int | None, dp: int | None) -> tuple[int, int]:
    """(stages, dp): as given standalone (defaults 2 and 1); under torchrun the world is dp x stages,
    and a missing one of the two is what the world leaves."""
    if world is None:
        return stages or Config.stages, dp or 1
    if stages is None and dp is None:
        return world, 1
    given = stages if stages is not None else dp
    if (
        given is None
        or world % given != 0
        or (stages is not None and dp is not None and stages * dp != world)
    ):
        shown = " ".join(f"--{n} {v}" for n, v in (("stages", stages), ("dp", dp)) if v is not None)
        fail(f"{shown} does not split torchrun's world of {world} ranks into dp x stages; give --stages "
             "and --dp whose product is the world size (or one of them, dividing it)")  # fmt: skip
    if stages is None:
        return world // given, given
    return stages, world // stages if dp is None else dp


# ---- the library's errors, in the command line's terms


class FlagError(ValueError):
    """A plan the library refused, in the command line's terms."""


@contextlib.contextmanager
def blame(cfg: Config, *names: str) -> Iterator[None]:
    """A library ValueError inside becomes a FlagError naming the flags that fed the call."""
    try:
        yield
    except ValueError as exc:
        text = _in_megabytes(str(exc)) if "memory_limit" in names and "memory_limit" in str(exc) else str(exc)
        raise FlagError(f"{cfg.flags(*names)}: {text}") from exc


# ---- what a checkpoint records


def asked_config(cfg: Config) -> dict[str, Any]:
    """``run_config`` without the plan: what the flags asked ("auto", the memory limit), as recorded."""
    out: dict[str, Any] = {k: getattr(cfg, k) for k in CONFIG_KEYS if k not in ("plan", "optimizer")}
    if cfg.memory_limit is None:  # absent when unset: the runs recorded before the flag resume
        del out["memory_limit"]
    out["balance"] = None if cfg.balance is None else list(cfg.balance)
    out["data"] = "python-stdlib" if cfg.data is None else str(Path(cfg.data).resolve())
    out["optimizer"] = {"name": "AdamW", **ADAMW, "clip": CLIP, "schedule": "warmup-cosine-0.1"}
    return out


def run_config(cfg: Config, plan: Plan) -> dict[str, Any]:
    """What each checkpoint records of its run and a resume compares, one entry per CONFIG_KEYS: the
    flags as asked, the plan's shape (with its balance when the partitioner chose it, auto or not: a
    restart reuses that plan, see ``recorded_plan``, because a fresh profile may balance otherwise and
    the run would not continue exactly as it began), the optimizer and the data (an absolute path)."""
    mode = plan.recompute if isinstance(plan.recompute, str) else list(plan.recompute)  # JSON
    shape = dict(schedule=plan.schedule, n_stages=plan.n_stages, n_virtual=plan.n_virtual,
                 n_microbatches=plan.n_microbatches, recompute=mode, dp=plan.dp)  # fmt: skip
    chosen = cfg.balance is None  # profiled and partitioned (or searched), not given by --balance
    return {**asked_config(cfg), "plan": {**shape, "balance": list(plan.balance)} if chosen else shape}


# the recorded settings that shape the plan: a checkpoint whose values of these are the current ones
# holds the plan to reuse
_PLAN_SHAPERS = ("model", "layers", "width", "seq_len", "stages", "dp", "schedule", "virtual", "microbatches",
                 "batch_size", "recompute", "dtype", "memory_limit", "balance")  # fmt: skip


def recorded_plan(cfg: Config) -> tuple[dict[str, Any], Path] | None:
    """The plan entry (and path) of the newest checkpoint in ``--checkpoint-dir``, when that run asked
    for what ``cfg`` asks and recorded its balance (the partitioner chose it); else None. Read before
    anything is built; ``resume`` then verifies the files and compares the whole configuration."""
    if cfg.checkpoint_dir is None:
        return None
    with blame(cfg, "checkpoint_dir"):
        found = checkpointing.recorded_config(cfg.checkpoint_dir)
    if found is None:
        return None
    path, saved = found
    shape, asked = saved.get("plan"), asked_config(cfg)
    if not isinstance(shape, dict) or "balance" not in shape:
        return None
    if any(saved.get(k) != asked.get(k) for k in _PLAN_SHAPERS):
        return None  # another request: search again (resume then lists the differences)
    return shape, path
