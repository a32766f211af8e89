"""The pieces of ``scripts/train.py``'s run that are not its loop: mixed precision, progress output,
checkpoints, and what is printed or written at the end.

    # p: ranks, r: rank, s: stage, m: micro-batches

Every function here is called on every rank (each does its own collectives
through the pipeline or ``torch.distributed``), in the same order.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline import checkpointing
from pipeline.plan import Plan
from pipeline.reference.data import decode, encode
from pipeline.reference.models import gpt_loss
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import Timeline

__all__ = [
    "Precision",
    "Progress",
    "StepLog",
    "generate",
    "load_gathered",
    "predicted_timeline",
    "report_busy",
    "resume",
    "save",
]


class Precision:
    """Autocast around step and evaluate, as in one process; under fp16 a GradScaler, whose scale the
    loss multiplies in, and an update skipped on every rank when any rank's gradients overflowed."""

    def __init__(self, dtype: str, device: torch.device) -> None:
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.device, self.scale = device, 1.0
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, self.dtype or torch.float32, enabled=self.dtype is not None)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return gpt_loss(logits, targets) * self.scale

    def begin_step(self) -> None:
        if self.scaler is not None:  # scale() also makes the scale tensor that unscale_() needs
            self.scale = float(self.scaler.scale(torch.ones((), device=self.device)))

    def update(self, pipe: Pipeline, opt: torch.optim.Optimizer, max_norm: float) -> None:
        """Clip by the norm over every stage, then step (under fp16: unless some rank overflowed)."""
        if self.scaler is None:
            pipe.clip_grad_norm_(max_norm)
            opt.step()
            return
        self.scaler.unscale_(opt)
        if pipe.grads_finite():  # the same answer on every rank: all step, or all skip
            pipe.clip_grad_norm_(max_norm)
            self.scaler.step(opt)
            self.scaler.update()
        else:
            self.scaler.update(new_scale=self.scaler.get_scale() * self.scaler.get_backoff_factor())


class Progress:
    """A tqdm bar on a terminal; else a plain line on stderr every ``total / 20`` steps (log files get
    no carriage-return updates); nothing when not ``show``n. ``write`` puts a message on stdout."""

    def __init__(self, total: int, start: int, tokens_per_step: int, show: bool) -> None:
        self.total, self.show, self.every = total, show, max(1, total // 20)
        self.tokens, self.count, self.since = tokens_per_step, 0, time.perf_counter()
        self.bar: Any = None
        if show and sys.stderr.isatty():
            with contextlib.suppress(ImportError):  # tqdm is the "train" extra's; plain lines without it
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, dynamic_ncols=True, file=sys.stderr)

    def step(self, done: int, loss: float) -> None:
        self.count += 1
        tok_s = self.count * self.tokens / (time.perf_counter() - self.since)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
            if done == self.total:
                self.bar.close()
        elif self.show and (done % self.every == 0 or done == self.total):
            print(f"{done}/{self.total} steps | loss {loss:.3f} | tokens/s {tok_s:,.0f}", file=sys.stderr)
            sys.stderr.flush()
            self.count, self.since = 0, time.perf_counter()

    def write(self, line: str) -> None:
        (self.bar.write if self.bar is not None else print)(line)
        sys.stdout.flush()


class StepLog:
    """``--loss-log``: one JSON line per step, ``{"step": 3, "loss": 4.12}``, appended (a resumed run goes on
    where the file stops); nothing when ``path`` is None."""

    def __init__(self, path: str | None, start: int) -> None:
        self.path = None if path is None else Path(path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if start == 0:
                self.path.write_text("")

    def step(self, done: int, loss: float) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": done, "loss": loss}) + "\n")


def save(folder: str, step: int, pipe: Pipeline, opt: torch.optim.Optimizer, precision: Precision,
         config: dict[str, Any]) -> None:  # fmt: skip
    """Checkpoint ``step``: parameters and buffers, optimizer, scaler, RNG and the run's configuration."""
    extra = {"step": step, "config": json.loads(json.dumps(config))}  # batches are drawn by step
    checkpointing.save(folder, step, pipe=pipe, optimizer=opt, grad_scaler=precision.scaler, extra=extra)


def resume(folder: str, pipe: Pipeline, opt: torch.optim.Optimizer, precision: Precision,
           model: dict[str, Any]) -> int:  # fmt: skip
    """Load the latest checkpoint in ``folder``; its step. ``model``: the settings it must have been
    saved with (a checkpoint of another model is an error naming the differences)."""
    path = checkpointing.latest(folder)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint in {folder!r} to resume from")
    extra = checkpointing.load(path, pipe=pipe, optimizer=opt, grad_scaler=precision.scaler)
    saved = {"model": "gpt", **extra["config"]}  # checkpoints from before --model were of the gpt
    differ = {k: (saved[k], v) for k, v in model.items() if saved[k] != v}
    if differ:
        raise ValueError(f"checkpoint {str(path)!r} has a different model (saved, now): {differ}")
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {extra['step']}", flush=True)
    return int(extra["step"])


def predicted_timeline(plan: Plan) -> Timeline:
    """The plan's step as a timeline, beside the measured one in a trace. A split backward (zb-h1)
    gets the profile's weight-gradient share as W, or half the backward where that is unknown."""
    sched = plan.build_schedule()
    fwd, bwd = [st.forward_time for st in plan.stages], [st.backward_time for st in plan.stages]
    if not sched.split_backward:
        return simulate(sched, fwd, bwd)
    w = [st.weight_time or st.backward_time / 2 for st in plan.stages]
    return simulate(sched, fwd, [b - x for b, x in zip(bwd, w, strict=True)], w)


def report_busy(pipe: Pipeline, plan: Plan, busy: list[float]) -> None:
    """Rank 0 prints every rank's mean measured compute time per step beside the plan's prediction
    (the prediction is one pipeline's: each replica's rank r is predicted as pipeline rank r)."""
    mine = sum(busy[1:]) / (len(busy) - 1) if len(busy) > 1 else sum(busy)  # the first step warms up
    measured: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(measured, mine)
    if dist.get_rank() != 0:
        return
    p, predicted = plan.n_ranks, plan.predicted_busy()
    replicas = plan.dp > 1
    print("busy time per step (compute only, mean over the run):")
    head = f"  {'rank':>4}  " + (f"{'replica':>7}  " if replicas else "")
    print(head + f"{'stages':<8}  {'layers':>6}  {'predicted ms':>12}  {'measured ms':>11}")
    for g, meas in enumerate(measured):
        d, r = divmod(g, p)  # the mesh's layout: pp innermost
        stages = pipe.schedule.stages_of(r)
        layers, names = sum(plan.balance[s] for s in stages), ",".join(map(str, stages))
        row = f"  {g:>4}  " + (f"{d:>7}  " if replicas else "")
        print(row + f"{names:<8}  {layers:>6}  {predicted[r] * 1e3:12.1f}  {meas * 1e3:11.1f}", flush=True)


def load_gathered(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``pipe.gather_state_dict()`` into the whole ``model``. A tied weight comes once, under its
    first name (``tok.weight``); its other names (``head.weight``) are the same Parameter here, so
    loading it under one name loads them all. Anything else missing is an error."""
    first: dict[int, str] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        first.setdefault(id(t), name)
    aliases = {
        name: first[id(t)] for name, t in model.state_dict(keep_vars=True).items() if first[id(t)] != name
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    wrong = [k for k in missing if aliases.get(k) not in state] + list(unexpected)
    if wrong:
        raise RuntimeError(f"the gathered state does not fit the model: {wrong[:5]}")


@torch.no_grad()
def generate(model: nn.Module, prompt: str, n_chars: int, seq_len: int, seed: int) -> str:
    """Sample ``n_chars`` characters after ``prompt`` (temperature 0.8) from the full model."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    idx = encode(prompt).long()[None].to(device)  # (1, T)
    for _ in range(n_chars):
        logits = model(idx[:, -seq_len:])[:, -1].float().cpu()  # (1, V)
        nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=g).to(device)  # (1, 1)
        idx = torch.cat([idx, nxt], dim=1)
    return decode(idx[0].cpu())
