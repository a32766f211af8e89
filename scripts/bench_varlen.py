"""Batches of text of every length: ours packed by tokens and ordered per step, against padding.

    python3 scripts/bench_varlen.py                       # 2 and 4 ranks, a few minutes
    python3 scripts/bench_varlen.py --ranks 2 --steps 6 --warmup 2

    # p: ranks, m: micro-batches, S: sequences per step, L: a sequence's length

The reference GPT (``pipeline.reference.models.gpt``) trains on steps of S sequences whose lengths
are drawn from a long-tailed distribution (lognormal, median 64, 99th percentile 512, at most
512), the same steps for every run, 1F1B with m micro-batches, in the same processes (gloo), one
step of each run in turn in a fresh random order so that a load spike hits them all:

    ours varlen   Pipeline(varlen=VarLen(token_budget)): sequences grouped by length into m
                  micro-batches, each padded to its own longest, run in the order the simulator
                  finds fastest within the plan's memory; the plan is the balance below with the
                  partitioner's predictions (``plan_for`` on a profile at token_budget / 512 x 512
                  tokens, the largest micro-batch the budget allows): each compute's cost split
                  into tokens and attention's length², each order's memory walked
    ours documents  the same with VarLen(documents=True) on ``with_documents(gpt(...))`` (the same weights):
                  each micro-batch one row of whole sequences end to end, each attending to itself
                  alone (a dense mask here, so a row of W tokens costs W² in attention)
    (a) padded    ours on the step padded to its longest sequence: m equal micro-batches, what
                  users do today with any runtime
    (b) torch     torch.distributed.pipelining's Schedule1F1B on (a)'s batches; its stages take one
                  input shape for the run, so every step is padded to the longest of the run

Per run: real tokens per second (the step's tokens over its median step, barrier to last rank),
the share of the computed tokens that are padding, and the most bytes live at once on any rank
(every tensor storage, transients included: ``step(measure_memory=True)`` for ours, the same
counter, ``LiveBytes``, around torch's step, both over the parameters, buffers and gradients);
for ours varlen also the packing's planning time as a share of the step, and the most any step's
chosen order was predicted to hold on a rank against the plan's own predicted peak (its bound).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline import Plan, VarLen, launch
from pipeline.reference.models import gpt, gpt_loss, with_documents
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.step.live import LiveBytes
from pipeline.runtime.step.memory import storage_bytes

VOCAB, WIDTH, HEADS, MAX_LEN = 256, 64, 4, 512
MEDIAN, P99 = 64, 512
SIGMA = math.log(P99 / MEDIAN) / 2.326  # the lognormal whose 99th percentile is P99


@dataclass(frozen=True)
class Config:
    p: int
    m: int
    sequences: int  # S per step
    token_budget: int
    pad_multiple: int
    steps: int
    warmup: int
    seed: int
    plan: str = ""  # the balance's plan with predictions, as JSON (``planned``)


def lengths(cfg: Config, rng: random.Random) -> list[int]:
    return [
        min(MAX_LEN, max(1, round(rng.lognormvariate(math.log(MEDIAN), SIGMA)))) for _ in range(cfg.sequences)
    ]


def data(cfg: Config) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Every step's sequences and next-token targets (the same on every rank)."""
    rng, g = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    steps = []
    for _ in range(cfg.warmup + cfg.steps + 1):  # + 1: the step that measures memory
        tokens = [torch.randint(0, VOCAB, (n + 1,), generator=g) for n in lengths(cfg, rng)]
        steps.append(([t[:-1] for t in tokens], [t[1:] for t in tokens]))
    return steps


def padded(
    xs: list[torch.Tensor], ys: list[torch.Tensor], width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step as one batch: every sequence padded to ``width`` (None: the step's longest)."""
    width = width or max(len(x) for x in xs)
    x = torch.zeros(len(xs), width, dtype=torch.long)
    y = torch.full((len(ys), width), -100, dtype=torch.long)
    for row, (a, b) in enumerate(zip(xs, ys, strict=True)):
        x[row, : len(a)], y[row, : len(b)] = a, b
    return x, y


def model(p: int, documents: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    built = gpt(vocab_size=VOCAB, width=WIDTH, n_layers=2 * p, n_heads=HEADS, max_seq_len=MAX_LEN)
    return with_documents(built)[0] if documents else built[0]


def balance(n: int, p: int) -> list[int]:
    return [n // p + (1 if s < n % p else 0) for s in range(p)]


def planned(cfg: Config) -> str:
    """``balance``'s plan with predictions from a profile at the largest micro-batch the token
    budget allows (rows of MAX_LEN tokens): the costs and memory limit ours varlen orders by."""
    from partitioner import plan_for, profile

    mod = model(cfg.p)
    sample = torch.randint(0, VOCAB, (max(cfg.token_budget // MAX_LEN, 1), MAX_LEN))
    prof = profile(mod, sample, loss_fn=gpt_loss, target=sample)
    return plan_for(prof, balance(len(mod), cfg.p), schedule="1f1b", n_microbatches=cfg.m).to_json()


class Ours:
    def __init__(self, cfg: Config, varlen: bool, documents: bool = False) -> None:
        mod = model(cfg.p, documents)
        packing = VarLen(cfg.token_budget, MAX_LEN, pad_multiple=cfg.pad_multiple, documents=documents)
        opts = packing if varlen else None
        self.varlen = varlen
        self.pipe = Pipeline(mod, Plan.from_json(cfg.plan), loss_fn=gpt_loss, varlen=opts)
        self.planning: list[float] = []
        self.predicted: list[float] = []  # per step, the chosen order's predicted peak (worst rank)
        self.bound = max(Plan.from_json(cfg.plan).rank_peaks)

    def step(self, xs: list[torch.Tensor], ys: list[torch.Tensor], measure: bool = False) -> int:
        """One step; the tokens its micro-batches computed (real and padding)."""
        pipe = self.pipe
        if self.varlen:
            pipe.step(xs if pipe.needs_inputs else None, ys if pipe.needs_targets else None,
                      measure_memory=measure)  # fmt: skip
            packing = pipe.last_packing
            if packing is not None:
                self.planning.append(packing.seconds)
                self.predicted.append(max(packing.peaks, default=0.0))
                return packing.padded_tokens
            return 0
        x, y = padded(xs, ys)
        pipe.step(x, y, measure_memory=measure)
        return x.numel()

    def peak(self) -> int:
        return int(self.pipe.memory_stats()["peak"])


class Torch:
    def __init__(self, cfg: Config, width: int) -> None:
        from torch.distributed import pipelining as tp

        mod, rank = model(cfg.p), dist.get_rank()
        bounds = [0]
        for n in balance(len(mod), cfg.p):
            bounds.append(bounds[-1] + n)
        self.stage = tp.PipelineStage(mod[bounds[rank] : bounds[rank + 1]], rank, cfg.p, torch.device("cpu"))
        self.sched = tp.Schedule1F1B(self.stage, cfg.m, loss_fn=gpt_loss)
        self.first, self.last, self.width = rank == 0, rank == cfg.p - 1, width
        self.measured = 0

    def step(self, xs: list[torch.Tensor], ys: list[torch.Tensor], measure: bool = False) -> int:
        x, y = padded(xs, ys, self.width)
        params = list(self.stage.submod.parameters())
        before = storage_bytes([*params, *(q.grad for q in params)])
        live = LiveBytes() if measure else None  # counting costs every op a Python call: not when timed
        with live if live is not None else contextlib.nullcontext():
            if self.last:
                self.sched.step(*((x,) if self.first else ()), target=y)
            else:
                self.sched.step(*((x,) if self.first else ()))
        if live is not None:
            self.measured = before + live.most()
        return x.numel()

    def peak(self) -> int:
        return self.measured


def rank_main(cfg: Config) -> dict[str, Any]:
    torch.set_num_threads(1)
    steps = data(cfg)
    longest = max(len(x) for xs, _ in steps for x in xs)
    runs: dict[str, Any] = {"ours varlen": Ours(cfg, True), "ours documents": Ours(cfg, True, True),
                            "(a) padded": Ours(cfg, False)}  # fmt: skip
    runs["(b) torch"] = Torch(cfg, longest)
    times: dict[str, list[float]] = {k: [] for k in runs}
    computed: dict[str, int] = {k: 0 for k in runs}
    real = 0
    order = random.Random(cfg.seed + 1)
    for k, (xs, ys) in enumerate(steps[:-1]):
        names = list(runs)
        order.shuffle(names)
        for name in names:
            dist.barrier()
            start = time.perf_counter()
            done = runs[name].step(xs, ys)
            dist.barrier()
            if k >= cfg.warmup:
                times[name].append(time.perf_counter() - start)
                computed[name] += done
        if k >= cfg.warmup:
            real += sum(len(x) for x in xs)
    xs, ys = steps[-1]
    peaks = {}
    for name, run in runs.items():
        run.step(xs, ys, measure=True)
        peaks[name] = run.peak()
    ours = runs["ours varlen"]
    return {"times": times, "computed": computed, "real": real, "peaks": peaks, "planning": ours.planning,
            "predicted": ours.predicted, "bound": ours.bound}  # fmt: skip


def report(cfg: Config, per_rank: list[dict[str, Any]]) -> None:
    r0 = per_rank[0]
    real_per_step = r0["real"] / cfg.steps
    print(f"\np = {cfg.p} ranks, 1F1B, m = {cfg.m}, S = {cfg.sequences} sequences per step "
          f"(~{real_per_step:.0f} tokens), token_budget = {cfg.token_budget}, pad_multiple = "
          f"{cfg.pad_multiple}, {cfg.steps} timed steps")  # fmt: skip
    print(f"{'run':<16}{'median step ms':>14}{'tokens/s':>11}{'padding':>9}{'peak MB (max rank)':>20}"
          f"{'x (a)':>8}{'x (b)':>8}")  # fmt: skip
    tps = {}
    for name in r0["times"]:
        med = statistics.median(r0["times"][name])
        tps[name] = real_per_step / med
    for name in r0["times"]:
        med = statistics.median(r0["times"][name])
        # padding: the share of the computed tokens that are not real; counted where the inputs are
        comp = max(r["computed"][name] for r in per_rank)
        pad_share = 1 - r0["real"] / comp if comp else float("nan")
        peak = max(r["peaks"][name] for r in per_rank) / 1e6
        over_a, over_b = tps[name] / tps["(a) padded"], tps[name] / tps["(b) torch"]
        print(f"{name:<16}{med * 1e3:>14.1f}{tps[name]:>11.0f}{pad_share:>9.1%}{peak:>20.2f}"
              f"{over_a:>8.2f}{over_b:>8.2f}")  # fmt: skip
    planning = [s for r in per_rank for s in r["planning"]]
    med = statistics.median(r0["times"]["ours varlen"])
    if planning:
        print(f"planning (pack + order) per step: median {statistics.median(planning) * 1e3:.2f} ms, "
              f"{statistics.median(planning) / med:.2%} of the step")  # fmt: skip
    predicted = [x for r in per_rank for x in r["predicted"]]
    if predicted:
        print(f"predicted peak of the chosen order, worst step: {max(predicted) / 1e6:.2f} MB, within the "
              f"plan's {r0['bound'] / 1e6:.2f} MB")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--pad-multiple", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, lengths lognormal (median {MEDIAN}, 99th percentile {P99}, at most "
          f"{MAX_LEN}), GPT width {WIDTH}, 2p blocks")  # fmt: skip
    for p in args.ranks:
        cfg = Config(p, args.microbatches, args.sequences, args.token_budget, args.pad_multiple, args.steps,
                     args.warmup, args.seed)  # fmt: skip
        cfg = dataclasses.replace(cfg, plan=planned(cfg))
        report(cfg, launch(rank_main, p, cfg, backend="gloo", timeout=900.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
