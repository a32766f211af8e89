"""Train a character-level GPT on real text across pipeline stages.

    python scripts/train.py                       # 2 stages, 1F1B, CPU: about 2.5 minutes on 2 cores
    python scripts/train.py --stages 4 --schedule zb-h1 --microbatches 8 --trace runs/zb.json
    python scripts/train.py --checkpoint-dir runs/ckpt --checkpoint-every 100   # later: add --resume
    torchrun --nproc-per-node 4 scripts/train.py --device cuda --dtype bf16

Standalone, the script spawns one process per stage itself (gloo, one thread
each); under ``torchrun`` every process is one stage (NCCL on GPUs). Rank 0
profiles the model and partitions it (unless ``--balance`` is given), prints
the plan and broadcasts it; every rank builds the same model from the same seed
and keeps only its stages. The default data is the Python standard library's
own source (see ``pipeline.data``); ``--data`` takes a text file or folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from partitioner.partition import COSTS, partition, plan_for
from partitioner.plan import Plan
from partitioner.profile import profile
from pipeline import checkpointing
from pipeline.launch import init_distributed, launch
from pipeline.reference.data import VOCAB_SIZE, CharDataset, decode, encode
from pipeline.reference.models import gpt, gpt_loss
from pipeline.schedules.schedule import SCHEDULES, Schedule, schedule
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import Timeline

# every entry of the chain besides the blocks: embedding, final norm, LM head
_EXTRA_LAYERS = 3
_N_HEADS = 4
_EVAL_BATCHES = 4
_CLIP = 1.0
_TIMEOUT_S = float(os.environ.get("STAGEWISE_TIMEOUT", "300"))  # bound on every wait for another rank
_EXTRAS = ("step", "data/position", "data/seed", "config", "amp/scaler")
_MODEL_KEYS = ("layers", "width", "seq_len")  # what a checkpoint must agree on to be loaded


@dataclass(frozen=True)
class Config:
    stages: int = 2
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 4
    batch_size: int = 16
    seq_len: int = 128
    steps: int = 1500
    lr: float = 2e-3
    layers: int = 4
    width: int = 128
    balance: tuple[int, ...] | None = None
    cost: str = "time"
    device: str = "cpu"
    dtype: str = "fp32"
    data: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    trace: str | None = None
    eval_every: int = 100
    seed: int = 0
    sample_chars: int = 300
    quiet: bool = False

    @property
    def n_pieces(self) -> int:
        """Stages the model is cut into: ranks x virtual stages per rank."""
        return self.stages * self.virtual


# ---------------------------------------------------------------------------- options


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not the whole usage text
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    d = Config()
    p = _Parser(prog="train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--stages", type=int, default=None, help=f"pipeline ranks (default {d.stages}; torchrun: world size)")
    add("--schedule", choices=SCHEDULES, default=d.schedule)
    add("--virtual", type=int, default=None, help="stages per rank (default 2 for interleaved-1f1b, else 1)")
    add("--microbatches", type=int, default=d.microbatches)
    add("--batch-size", type=int, default=d.batch_size, help="sequences per step, split into micro-batches")
    add("--seq-len", type=int, default=d.seq_len)
    add("--steps", type=int, default=d.steps)
    add("--lr", type=float, default=d.lr, help="peak learning rate (warmup, then cosine decay to 10%%)")
    add("--layers", type=int, default=d.layers, help="transformer blocks")
    add("--width", type=int, default=d.width, help=f"model width, a multiple of {_N_HEADS}")
    add("--balance", default=None, help="layer counts per stage, e.g. 3,4 (default: the partitioner's)")
    add("--cost", choices=COSTS, default=d.cost, help="what the partitioner balances")
    add("--device", choices=("cpu", "cuda"), default=d.device)
    add("--dtype", choices=("fp32", "bf16", "fp16"), default=d.dtype, help="autocast dtype")
    add("--data", default=None, help="text file or folder (default: the standard library's sources)")
    add("--checkpoint-dir", default=None)
    add("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps; 0: only at the end")
    add("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    add("--trace", default=None, metavar="PATH", help="write one step's measured timeline (Chrome trace)")
    add("--eval-every", type=int, default=d.eval_every)
    add("--seed", type=int, default=d.seed)
    add("--sample-chars", type=int, default=d.sample_chars, help="characters of text generated at the end")
    add("--quiet", action="store_true", help="no progress bar")
    return p


def _torchrun_world() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in os.environ else None


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Options -> Config; any bad value ends the program with a one-line error and exit code 2."""
    p = _parser()
    a = p.parse_args(argv)
    world = _torchrun_world()
    stages = a.stages if a.stages is not None else (world or Config.stages)
    if world is not None and stages != world:
        p.error(f"--stages {stages} differs from torchrun's world size {world}; drop --stages or match it")
    virtual = a.virtual if a.virtual is not None else (2 if a.schedule == "interleaved-1f1b" else 1)
    for name in ("stages", "virtual", "microbatches", "batch_size", "seq_len", "steps", "layers", "width"):
        value = stages if name == "stages" else virtual if name == "virtual" else getattr(a, name)
        if value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if a.eval_every < 1 or a.checkpoint_every < 0 or a.sample_chars < 0:
        p.error("--eval-every must be >= 1, --checkpoint-every and --sample-chars >= 0")
    if not a.lr > 0:
        p.error(f"--lr must be > 0, got {a.lr}")
    if a.width % _N_HEADS:
        p.error(f"--width ({a.width}) must be a multiple of {_N_HEADS} (attention heads)")
    if virtual > 1 and a.schedule != "interleaved-1f1b":
        p.error(f"--virtual {virtual} needs --schedule interleaved-1f1b; others run one stage per rank")
    n_pieces, n_entries = stages * virtual, a.layers + _EXTRA_LAYERS
    if n_pieces > n_entries:
        p.error(
            f"{n_pieces} stages ({stages} ranks x {virtual} virtual) exceed the model's {n_entries} layers "
            f"({a.layers} blocks + embedding, norm, head); use fewer --stages or more --layers"
        )
    if a.batch_size % a.microbatches:
        p.error(
            f"--batch-size ({a.batch_size}) must be divisible by --microbatches ({a.microbatches}); "
            f"try --batch-size {a.microbatches * max(1, round(a.batch_size / a.microbatches))}"
        )
    try:
        schedule(a.schedule, stages, a.microbatches, n_virtual=virtual)
    except ValueError as exc:
        p.error(f"--schedule {a.schedule} with {n_pieces} stages and {a.microbatches} micro-batches: {exc}")
    balance = _parse_balance(p, a.balance, n_pieces, n_entries)
    if a.data is not None and not os.path.exists(a.data):
        p.error(f"--data {a.data!r} does not exist; pass a text file or a folder of them")
    if a.data is not None:
        try:
            CharDataset.load(a.data).check(a.seq_len)
        except (OSError, ValueError) as exc:
            p.error(str(exc))
    if a.resume and a.checkpoint_dir is None:
        p.error("--resume needs --checkpoint-dir, the folder to resume from")
    if a.resume and checkpointing.latest(a.checkpoint_dir) is None:
        p.error(f"--resume: no complete checkpoint in {a.checkpoint_dir!r}; run once without --resume")
    if a.trace is not None and not Path(a.trace).resolve().parent.is_dir():
        p.error(f"--trace {a.trace!r}: folder {str(Path(a.trace).parent)!r} does not exist")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available here; use --device cpu")
    if a.device == "cuda" and world is None and torch.cuda.device_count() < stages:
        p.error(f"--device cuda needs one GPU per stage: {stages} stages, {torch.cuda.device_count()} GPUs")
    if a.device == "cpu" and a.dtype == "fp16" and not _cpu_fp16_autocast():
        p.error("--dtype fp16: this torch build has no float16 autocast on CPU; use --dtype bf16")
    fields = {k: v for k, v in vars(a).items() if k not in ("stages", "virtual", "balance")}
    return Config(stages=stages, virtual=virtual, balance=balance, **fields)


def _parse_balance(
    p: argparse.ArgumentParser, text: str | None, n_pieces: int, n_entries: int
) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        balance = tuple(int(x) for x in text.split(","))
    except ValueError:
        p.error(f"--balance {text!r} must be comma-separated layer counts, e.g. 3,4")
    if len(balance) != n_pieces or sum(balance) != n_entries or min(balance) < 1:
        p.error(
            f"--balance {text!r} must give {n_pieces} positive layer counts summing to {n_entries} "
            f"(the model's layers: {n_entries - _EXTRA_LAYERS} blocks + embedding, norm, head)"
        )
    return balance


def _cpu_fp16_autocast() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            return bool(nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float16)
    except (RuntimeError, ValueError):
        return False


# ---------------------------------------------------------------------------- pieces


def build_model(cfg: Config) -> tuple[nn.Sequential, torch.Tensor]:
    """The same model on every rank: seeded right before it is built. Sample: one micro-batch."""
    torch.manual_seed(cfg.seed)
    return gpt(
        vocab_size=VOCAB_SIZE,
        width=cfg.width,
        n_layers=cfg.layers,
        n_heads=_N_HEADS,
        max_seq_len=cfg.seq_len,
        batch_size=cfg.batch_size // cfg.microbatches,
    )


def learning_rate(cfg: Config, step: int) -> float:
    """Linear warmup then cosine decay to a tenth: a pure function of the step, so resume is exact."""
    warmup = max(1, min(100, cfg.steps // 10))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def _clip_gradients(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip by the norm over all stages: every rank applies the same factor."""
    sq = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
    for p in params:
        if p.grad is not None:
            sq += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq)
    norm = float(sq.sqrt())
    if norm > max_norm:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def _all_finite(params: list[nn.Parameter], device: torch.device) -> bool:
    bad = torch.zeros((), device=device)
    for p in params:
        if p.grad is not None and not bool(p.grad.isfinite().all()):
            bad.fill_(1.0)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad == 0)


@torch.no_grad()
def generate(model: nn.Sequential, prompt: str, n_chars: int, seq_len: int, seed: int) -> str:
    """Sample ``n_chars`` characters after ``prompt`` (temperature 0.8) from the full model."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    idx = encode(prompt).long()[None].to(device)  # (1, T)
    for _ in range(n_chars):
        logits = model(idx[:, -seq_len:])[:, -1].float().cpu()  # (1, V)
        probs = torch.softmax(logits / 0.8, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=g).to(device)  # (1, 1)
        idx = torch.cat([idx, nxt], dim=1)
    return decode(idx[0].cpu())


# ---------------------------------------------------------------------------- one rank


def _plan(cfg: Config, model: nn.Sequential, sample: torch.Tensor, device: torch.device) -> Plan:
    """Rank 0 profiles (and partitions, without --balance); every rank gets the same plan.

    Profiling once and broadcasting keeps the balance identical on every rank even
    though measured times are not.
    """
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        model.to(device)
        figures = profile(model, sample.to(device))
        kw: dict[str, Any] = {"schedule": cfg.schedule, "n_microbatches": cfg.microbatches}
        kw["n_virtual"] = cfg.virtual
        if cfg.balance is None:
            box[0] = partition(model, cfg.n_pieces, sample, cost=cfg.cost, profile=figures, **kw)
        else:
            box[0] = plan_for(figures, list(cfg.balance), cost=cfg.cost, **kw)
        model.zero_grad(set_to_none=True)
        model.cpu()
    dist.broadcast_object_list(box, src=0)
    plan: Plan = box[0]
    return plan


def _resume(cfg: Config, pipe: Any, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> int:
    assert cfg.checkpoint_dir is not None
    path = checkpointing.latest(cfg.checkpoint_dir)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint in {cfg.checkpoint_dir!r} to resume from")
    extras = checkpointing.load(path, pipe.named_parameters(), opt, _EXTRAS)
    if scaler is not None and extras["amp/scaler"] != "null":
        scaler.load_state_dict(json.loads(extras["amp/scaler"]))
    saved = json.loads(extras["config"])
    differ = {k: (saved[k], getattr(cfg, k)) for k in _MODEL_KEYS if saved[k] != getattr(cfg, k)}
    if differ:
        raise ValueError(f"checkpoint {str(path)!r} has a different model (saved, now): {differ}")
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {extras['step']}", flush=True)
    return int(extras["step"])


def _save(
    cfg: Config, pipe: Any, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, step: int
) -> None:
    assert cfg.checkpoint_dir is not None
    extra = {
        "step": step,
        "data/position": step,  # batches are drawn by step: the step is the whole data-loader state
        "data/seed": cfg.seed,
        "config": json.dumps(asdict(cfg)),
        "amp/scaler": json.dumps(scaler.state_dict() if scaler is not None else None),
    }
    checkpointing.save(
        cfg.checkpoint_dir, step, checkpointing.training_state(pipe.named_parameters(), opt, extra)
    )


def _simulated(plan: Plan, sched: Schedule) -> Timeline:
    """The plan's prediction of a step as a timeline, to sit beside the measured one in the trace.

    The plan has one backward time per stage; a schedule that splits it (zb-h1) gets half for
    the input gradient (B) and half for the weight gradient (W), roughly what a linear layer does.
    """
    fwd = [st.forward_time for st in plan.stages]
    bwd = [st.backward_time for st in plan.stages]
    if sched.split_backward:
        return simulate(sched, fwd, [b / 2 for b in bwd], [b / 2 for b in bwd])
    return simulate(sched, fwd, bwd)


def _report(cfg: Config, pipe: Any, plan: Plan, busy: list[float]) -> None:
    """Rank 0 prints every rank's mean measured busy time per step beside the plan's prediction."""
    mine = (
        sum(busy[1:]) / max(1, len(busy) - 1) if len(busy) > 1 else (busy[0] if busy else 0.0)
    )  # skip warmup
    measured: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(measured, mine)
    if dist.get_rank() != 0:
        return
    stage_ids = [pipe.schedule.stages_of(r) for r in range(dist.get_world_size())]
    predicted = plan.predicted_busy()
    print("busy time per step (compute only, mean over the run):", flush=True)
    print(
        f"  {'rank':>4}  {'stages':<8}  {'layers':>6}  {'predicted ms':>12}  {'measured ms':>11}", flush=True
    )
    balance = pipe.balance
    for r, stages in enumerate(stage_ids):
        layers = sum(balance[s] for s in stages)
        pred = f"{predicted[r] * 1e3:12.1f}"
        names = ",".join(map(str, stages))
        print(f"  {r:>4}  {names:<8}  {layers:>6}  {pred}  {measured[r] * 1e3:11.1f}", flush=True)


def _gather_model(cfg: Config, pipe: Any) -> nn.Sequential | None:
    """Every rank's parameters to rank 0, loaded into a fresh full model there."""
    local = {n: p.detach().float().cpu() for n, p in pipe.named_parameters()}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    if dist.get_rank() != 0:
        return None
    model, _ = build_model(cfg)
    model.load_state_dict({k: v for part in parts for k, v in part.items()})
    return model


def train(cfg: Config) -> dict[str, Any]:
    """One rank's whole run; returns its per-step losses and evaluations."""
    from pipeline.runtime.pipe import Pipeline

    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    )
    first, last = rank == 0, rank == world - 1  # stage 0 lives on rank 0, the last stage on rank p - 1
    data = CharDataset.load(cfg.data) if first or last else None
    model, sample = build_model(cfg)
    plan = _plan(cfg, model, sample, device)
    balance = list(plan.balance)
    if first:
        src = data.source if data is not None else ""
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"data: {src}, {len(data.train) if data else 0:,} train / {len(data.val) if data else 0:,} "
            f"val characters, vocabulary {VOCAB_SIZE}",
            flush=True,
        )
        print(
            f"model: {cfg.layers} blocks, width {cfg.width}, {n_params / 1e6:.2f}M parameters; "
            f"{cfg.n_pieces} stages, schedule {cfg.schedule}, balance {balance}",
            flush=True,
        )
        print(plan, flush=True)

    amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    scaler = torch.amp.GradScaler(device.type) if cfg.dtype == "fp16" else None
    loss_scale = [1.0]  # read by the loss at every micro-batch; GradScaler's current scale under fp16

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return gpt_loss(logits, targets) * loss_scale[0]

    # Mixed precision around the whole step, as in one process: the pipeline carries the autocast
    # state in its step header and checks that every rank agrees.
    amp = torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None)
    pipe = Pipeline(
        model,
        balance,
        schedule=cfg.schedule,
        n_microbatches=cfg.microbatches,
        loss_fn=loss_fn,
        n_virtual=cfg.virtual,
        device=device,
        timeout=_TIMEOUT_S,
    )
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.1)
    start = _resume(cfg, pipe, opt, scaler) if cfg.resume else 0

    def batch(split: str, step: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if data is None:
            return None, None
        x, y = data.batch(split, step, cfg.batch_size, cfg.seq_len, cfg.seed)
        return (x.to(device) if first else None), (y.to(device) if last else None)

    def evaluate() -> float:
        losses = []
        for k in range(_EVAL_BATCHES):
            x, y = batch("val", k)
            with amp:
                losses.append(float(pipe.evaluate(x, y)) / loss_scale[0])
        return sum(losses) / len(losses)

    from tqdm import tqdm

    bar = tqdm(
        total=cfg.steps, initial=start, disable=cfg.quiet or not last, dynamic_ncols=True, file=sys.stderr
    )
    trace_step = min(start + 1, cfg.steps - 1)
    losses: list[float] = []
    evals: list[tuple[int, float, float, float]] = []
    window: list[float] = []
    busy: list[float] = []
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t_run = t_window = time.perf_counter()
    n_window = 0
    for step in range(start, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        if scaler is not None:  # scale() also creates the scale tensor that unscale_() needs
            loss_scale[0] = float(scaler.scale(torch.ones((), device=device)))
        x, y = batch("train", step)
        t0 = time.perf_counter()
        record = cfg.trace is not None and step == trace_step
        with amp:
            loss = float(pipe.step(x, y, record=record)) / loss_scale[0]
        busy.append(pipe.busy_time)
        if record:
            assert cfg.trace is not None
            pipe.write_trace(cfg.trace, _simulated(plan, pipe.schedule))
            if first:
                bar.write(f"wrote the measured timeline of step {step} to {cfg.trace}")
        if scaler is not None:
            scaler.unscale_(opt)
            if _all_finite(params, device):  # every rank must agree to step or to skip
                _clip_gradients(params, _CLIP)
                scaler.step(opt)
                scaler.update()
            else:
                scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
        else:
            _clip_gradients(params, _CLIP)
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
        window.append(loss)
        n_window += 1
        dt = time.perf_counter() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            val = evaluate()
            tok_s = n_window * tokens_per_step / (time.perf_counter() - t_window)
            evals.append((done, sum(window) / len(window), val, tok_s))
            if last:
                mean = evals[-1][1]
                bar.write(f"step {done} | train loss {mean:.4f} | val loss {val:.4f} | tokens/s {tok_s:,.0f}")
            window, n_window, t_window = [], 0, time.perf_counter()
        if cfg.checkpoint_dir is not None and (
            done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)
        ):
            _save(cfg, pipe, opt, scaler, done)
    bar.close()
    seconds = time.perf_counter() - t_run
    _report(cfg, pipe, plan, busy)
    full = _gather_model(cfg, pipe) if cfg.sample_chars else None
    sample_text = ""
    if full is not None:
        sample_text = generate(full.to(device), "def ", cfg.sample_chars, cfg.seq_len, cfg.seed)
        print("---- generated text ----\n" + sample_text + "\n------------------------", flush=True)
    return {
        "rank": rank,
        "start": start,
        "losses": losses,
        "evals": evals,
        "seconds": seconds,
        "sample": sample_text,
    }


# ---------------------------------------------------------------------------- entry


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Parse, then run every rank: spawned here, or this process's rank under torchrun."""
    cfg = parse_args(argv)
    if _torchrun_world() is not None:
        init_distributed("nccl" if cfg.device == "cuda" else "gloo")
        try:
            return [train(cfg)]
        finally:
            dist.destroy_process_group()
    return launch(train, cfg.stages, cfg, backend="nccl" if cfg.device == "cuda" else "gloo", timeout=600.0)


if __name__ == "__main__":
    main()
