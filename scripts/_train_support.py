"""The pieces of ``scripts/train.py``'s run that are not its loop: mixed precision, progress output,
a streak of skipped updates, and what is printed or written at the end.

    # p: ranks, r: rank, s: stage, m: micro-batches

Every function here is called on every rank (each does its own collectives
through the pipeline or ``torch.distributed``), in the same order.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.plan import Plan
from pipeline.reference.data import decode, encode
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import Timeline

__all__ = [
    "NAN_ENV",
    "BadSteps",
    "Precision",
    "Progress",
    "RunStopped",
    "StepLog",
    "generate",
    "injected_nan",
    "load_gathered",
    "predicted_timeline",
    "report_busy",
]


class Precision:
    """Autocast around step and evaluate, as in one process; under fp16 torch's GradScaler through the
    pipeline (``step(..., scaler=)``, ``unscale_``): an overflow on any rank skips the update on every
    rank and backs the scale off alike."""

    def __init__(self, dtype: str, device: torch.device) -> None:
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, self.dtype or torch.float32, enabled=self.dtype is not None)

    def step_options(self) -> dict[str, Any]:
        """What ``pipe.step`` takes besides the batch: the scaler, under fp16."""
        return {} if self.scaler is None else {"scaler": self.scaler}

    def update(self, pipe: Pipeline, opt: torch.optim.Optimizer, max_norm: float) -> bool:
        """Clip by the norm over every stage, then step, unless some rank's gradients are not finite
        (the same answer on every rank: all step, or all skip). False: skipped for bad numbers (under
        fp16 an overflow is the scaler's routine and counts as a step taken: its scale backs off)."""
        if self.scaler is None:
            if not pipe.grads_finite():
                return False
            pipe.clip_grad_norm_(max_norm)
            opt.step()
            return True
        pipe.unscale_(self.scaler, opt)  # the overflow agreed on every rank: step() skips alike
        pipe.clip_grad_norm_(max_norm)
        self.scaler.step(opt)
        self.scaler.update()
        return True


class RunStopped(RuntimeError):
    """The run cannot go on (decided on every rank alike); the message says why and what was kept."""


class BadSteps:
    """Counts updates skipped in a row for a non-finite loss or gradient; at ``limit`` a RunStopped."""

    def __init__(self, limit: int, say: Any) -> None:
        self.limit, self.say, self.streak, self.last_good = limit, say, 0, 0

    def step(self, done: int, stepped: bool) -> None:
        if stepped:
            self.streak, self.last_good = 0, done
            return
        self.streak += 1
        if self.say is not None:
            self.say(f"step {done}: a loss or gradient is not finite on some rank: update skipped on every "
                     f"rank ({self.streak} in a row, at most {self.limit})")  # fmt: skip
        if self.streak >= self.limit:
            raise RunStopped(
                f"{self.streak} consecutive steps ({done - self.streak + 1}-{done}) had a non-finite loss or "
                f"gradient; stopped. The newest checkpoint is from before them (the last good update was "
                f"step {self.last_good}); lower the learning rate or check the data, then restart"
            )


NAN_ENV = "STAGEWISE_TEST_NAN"  # test-only: "RANK:STEP,STEP" (global rank, 1-based steps)


def injected_nan(pipe: Pipeline, rank: int, step: int) -> None:
    """Test-only: a NaN in this rank's first gradient when NAN_ENV names this rank and ``step``."""
    spec = os.environ.get(NAN_ENV)
    if not spec:
        return
    who, _, steps = spec.partition(":")
    if int(who) == rank and str(step) in steps.split(","):
        grad = next(p.grad for p in pipe.parameters() if p.grad is not None)
        grad.view(-1)[0] = float("nan")


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
