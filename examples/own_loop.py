"""Your own training loop on a pipeline: a small CNN, 2 ranks, the Python API end to end.

    python examples/own_loop.py                        # 2 local ranks (pipeline.launch), 4 epochs
    python examples/own_loop.py --bf16                 # the same under torch.autocast(bfloat16)
    python examples/own_loop.py --epochs 6             # later: resumes from ./checkpoints, runs to 6

    # under torchrun: make the plan once, then every rank reads it from the checkpoint folder
    python examples/own_loop.py --plan-only
    torchrun --nproc-per-node 2 examples/own_loop.py

What a practitioner writes, and nothing else: no hand-written collective.

    partition once      the plan (balance, schedule, micro-batches) is made in this process,
                        written to <checkpoints>/plan.json and passed to every rank; a resumed
                        run reuses it (the same stages on the same ranks: the same dropout masks)
    Pipeline            this rank's stages of the nn.Sequential (conv, BatchNorm, ReLU, pool,
                        dropout, linear), loss F.cross_entropy
    data where used     the training and validation loaders exist only on the ranks that use
                        them (pipe.needs_inputs: stage 0's; pipe.needs_targets: the last
                        stage's); a middle rank calls step() with nothing. Each step prefetches
                        the next batch's host-to-device copy (prefetch=...)
    optimizer           AdamW, a linear warm-up then cosine decay (LambdaLR), clipping by the
                        norm over every stage's gradients (pipe.clip_grad_norm_)
    validation          evaluate(x, y, return_outputs=True, dst=<the targets' rank>): the loss
                        on every rank, the logits where the labels are, so accuracy is one line;
                        the last validation batch is smaller and not a multiple of m (uneven
                        micro-batches: same loss as one process)
    checkpoints         checkpointing.save each epoch (parameters, BatchNorm statistics,
                        optimizer and scheduler state, every rank's RNG, the epoch), and
                        checkpointing.load at start when the folder holds one: a stopped run
                        resumed continues bit for bit as if never stopped

The data: images of Gaussian blobs, one position per class, plus jitter and
noise, each image made from the seed and its index alone (nothing to
download; any rank could make any batch). The history (``--history FILE``) holds one JSON
line per training step and per epoch, with exact floats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import pipeline
from partitioner import partition
from pipeline import Pipeline, Plan, checkpointing

PLAN_FILE = "plan.json"


# ---- data: Gaussian blobs, one position per class


class Blobs(Dataset[tuple[torch.Tensor, int]]):
    """``size`` grey images (1, S, S) of ``n_classes`` classes: a Gaussian blob at the class's place
    on a circle, jittered, plus noise. Item i depends only on (seed, i)."""

    def __init__(self, size: int, n_classes: int, image_size: int, seed: int) -> None:
        self.size, self.n_classes, self.image_size, self.seed = size, n_classes, image_size, seed
        angles = torch.arange(n_classes) * (2 * math.pi / n_classes)
        self.centres = (image_size - 1) / 2 * (1 + 0.5 * torch.stack([angles.cos(), angles.sin()], 1))
        grid = torch.arange(image_size, dtype=torch.float32)
        self.ys, self.xs = torch.meshgrid(grid, grid, indexing="ij")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(self.n_classes, (), generator=gen))
        cy, cx = self.centres[label] + torch.randn(2, generator=gen) * self.image_size / 10
        blob = torch.exp(-((self.ys - cy) ** 2 + (self.xs - cx) ** 2) / (2 * (self.image_size / 8) ** 2))
        noise = 0.3 * torch.randn(self.image_size, self.image_size, generator=gen)
        return (blob + noise).unsqueeze(0), label


def loader(data: Blobs, batch_size: int, shuffle_seed: int | None, pin: bool) -> DataLoader[Any]:
    """Batches in a shuffled order fixed by ``shuffle_seed`` (the same on every rank that loads), or in
    order (None). The last batch is smaller when the size is not a multiple of ``batch_size``."""
    order = None if shuffle_seed is None else torch.Generator().manual_seed(shuffle_seed)
    return DataLoader(data, batch_size=batch_size, shuffle=order is not None, generator=order, pin_memory=pin)


def batches(data: DataLoader[Any] | None, n_steps: int) -> Iterator[tuple[Any, Any]]:
    """The loader's (inputs, targets) batches, or ``n_steps`` times (None, None) on a rank that uses no
    data (a middle stage's), which builds no loader and loads nothing."""
    if data is None:
        for _ in range(n_steps):
            yield None, None
        return
    yield from data


def with_prefetch(it: Iterator[tuple[Any, Any]]) -> Iterator[tuple[tuple[Any, Any], Any]]:
    """Each batch with the one after it (None at the end): step(*batch, prefetch=following)."""
    batch = next(it, None)
    while batch is not None:
        following = next(it, None)
        yield batch, following
        batch = following


# ---- the model and the plan


def build_model(width: int, n_classes: int, image_size: int, dropout: float) -> nn.Sequential:
    """A small CNN as one flat nn.Sequential (the pipeline cuts it between any two layers)."""
    flat = 2 * width * (image_size // 4) ** 2
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(dropout), nn.Linear(flat, 4 * width), nn.ReLU(),
        nn.Dropout(dropout), nn.Linear(4 * width, n_classes),
    )  # fmt: skip


def model_of(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(args.seed)  # the same initial model on every rank
    return build_model(args.width, args.classes, args.image_size, args.dropout)


def autocast(args: argparse.Namespace, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast when asked: step, evaluate and predict run in it (partition takes autocast=)."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.bf16)


def make_plan(args: argparse.Namespace) -> Plan:
    """Profile the model (and the loss) on one micro-batch, in the run's precision, and cut it into
    stages for ``args.ranks`` ranks."""
    rows = max(1, args.batch_size // args.microbatches)
    data = Blobs(rows, args.classes, args.image_size, args.seed)
    sample = torch.stack([data[i][0] for i in range(rows)])
    labels = torch.tensor([data[i][1] for i in range(rows)])
    return partition(
        model_of(args), args.ranks, sample, schedule=args.schedule, n_microbatches=args.microbatches,
        autocast=torch.bfloat16 if args.bf16 else None, loss_fn=F.cross_entropy, target=labels,
    )  # fmt: skip


def plan_for(args: argparse.Namespace) -> Plan:
    """The run's plan: the checkpoint folder's (a resumed run keeps its stages), else a new one, saved."""
    path = Path(args.checkpoints) / PLAN_FILE
    if path.is_file():
        return Plan.from_json(path.read_text())
    plan = make_plan(args)
    if int(os.environ.get("RANK", "0")) == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(plan.to_json())
        tmp.replace(path)  # atomic: a rank never reads half a plan
    return plan


# ---- the schedule of the learning rate


def warmup_cosine(warmup: int, total: int) -> Any:
    """The LambdaLR factor: linear from 1/warmup to 1 over ``warmup`` steps, then cosine to 0 at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

    return factor


# ---- one rank's training


def train(args: argparse.Namespace, plan: Plan) -> None:
    """Run on every rank: build this rank's stages, resume if there is a checkpoint, train, validate."""
    pipe = Pipeline(model_of(args), plan, loss_fn=F.cross_entropy)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = math.ceil(args.train_size / args.batch_size)  # known everywhere, no data needed
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(args.warmup, args.epochs * steps_per_epoch)
    )
    first_epoch = 0
    if checkpointing.latest(args.checkpoints) is not None:  # resume: every rank loads what it holds
        state = checkpointing.load(
            args.checkpoints, pipe=pipe, optimizer=optimizer, lr_scheduler=lr_scheduler
        )
        first_epoch = state["epoch"]
    train_data = Blobs(args.train_size, args.classes, args.image_size, args.seed + 1)
    val_data = Blobs(args.val_size, args.classes, args.image_size, args.seed + 2)
    pin = pipe.device.type == "cuda"
    uses_data = pipe.needs_inputs or pipe.needs_targets  # stage 0's rank, the last stage's rank
    kind = pipe.device.type
    log = Log(args.history, active=pipe.needs_targets)  # the rank that holds the labels reports
    val_steps = math.ceil(args.val_size / args.batch_size)
    for epoch in range(first_epoch, args.epochs):
        train_loader = loader(train_data, args.batch_size, args.seed + epoch, pin) if uses_data else None
        for t, (batch, following) in enumerate(with_prefetch(batches(train_loader, steps_per_epoch))):
            with autocast(args, kind):
                loss = pipe.step(*batch, prefetch=following)
            norm = pipe.clip_grad_norm_(args.clip)
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            step = epoch * steps_per_epoch + t + 1
            log.write(kind="step", epoch=epoch + 1, step=step, loss=loss, norm=norm, lr=lr)
        total_loss, correct, seen = 0.0, 0, 0
        val_loader = loader(val_data, args.batch_size, None, pin) if uses_data else None
        for (x, y), following in with_prefetch(batches(val_loader, val_steps)):
            with autocast(args, kind):
                loss, logits = pipe.evaluate(
                    x, y, return_outputs=True, dst=pipe.last_loss_rank, prefetch=following
                )
            if logits is not None:  # on the rank that holds the labels
                correct += int((logits.argmax(1).cpu() == y).sum())
                total_loss += loss * len(y)
                seen += len(y)
        log.write(
            kind="epoch", epoch=epoch + 1, val_loss=total_loss / max(seen, 1), accuracy=correct / max(seen, 1)
        )
        checkpointing.save(
            args.checkpoints, (epoch + 1) * steps_per_epoch, pipe=pipe, optimizer=optimizer,
            lr_scheduler=lr_scheduler, extra={"epoch": epoch + 1}, keep=args.keep,
        )  # fmt: skip
        if args.stop_after is not None and epoch + 1 >= args.stop_after:
            break  # as if the job were stopped here; run again to resume
    pipe.close()


class Log:
    """On the active rank: readable lines on stdout and, with a path, exact JSON lines in a file."""

    def __init__(self, path: str | None, active: bool) -> None:
        self.path, self.active = path, active

    def write(self, **record: Any) -> None:
        if not self.active:
            return
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        text = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items())
        print(text, flush=True)


# ---- the command line


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4, help="epochs of the whole run (the schedule's length)")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this epoch (resume later)")
    ap.add_argument("--train-size", type=int, default=2000)
    ap.add_argument("--val-size", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--ranks", type=int, default=2, help="pipeline ranks (torchrun: its world size)")
    ap.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--classes", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=10, help="warm-up steps")
    ap.add_argument("--clip", type=float, default=1.0, help="clip the gradients' total norm to this")
    ap.add_argument("--bf16", action="store_true", help="run under torch.autocast(bfloat16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--checkpoints", default="checkpoints", help="checkpoint folder (resumed when it holds one)"
    )
    ap.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    ap.add_argument("--history", default=None, help="append exact JSON lines here (one per step, per epoch)")
    ap.add_argument("--backend", default=None, help="gloo (default), nccl or nccl-emulated")
    ap.add_argument("--plan-only", action="store_true", help="write <checkpoints>/plan.json and stop")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if "LOCAL_RANK" in os.environ:  # started by torchrun: this process is one rank
        info = pipeline.init_distributed(args.backend)
        args.ranks = info.world_size
        try:
            # the plan from <checkpoints>/plan.json (make it first: --plan-only); without one, every
            # rank partitions, which gives every rank the same plan only where partition shares it
            train(args, plan_for(args))
        finally:  # while Python still runs: the group's threads end before the interpreter finalizes
            dist.destroy_process_group()
        return
    plan = plan_for(args)  # once, in this process
    if args.plan_only:
        print(f"{Path(args.checkpoints) / PLAN_FILE}:\n{plan.summary()}")
        return
    pipeline.launch(train, args.ranks, args, plan, backend=args.backend)


if __name__ == "__main__":
    main(sys.argv[1:])
