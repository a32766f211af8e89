"""Memory against step time: the table a user reads to choose among the schedules of one m.

    python scripts/bench_schedules.py --tradeoff          # p = 4, m = 8, the reference GPT

    # p: ranks, m: micro-batches, k: stages (p, or 2p in a V)

Every schedule runs the same GPT (real compute, its layers spread evenly over its k stages) in the
same processes, one step of each in turn in a fresh random order, then one step each that counts
memory (``step(..., measure_memory=True)``): per rank, the activations held at the peak (what autograd
and the pipeline keep for backward, each storage once) and the true peak (every live storage, the
weights and gradients included).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from pipeline import launch
from pipeline.reference.models import gpt, gpt_loss
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.registry import REGISTRY

__all__ = ["SCHEDULES", "tradeoff"]

SCHEDULES = ("1f1b", "zb-h1", "zb-v", "v-half", "v-min")


def _balance(n: int, k: int) -> list[int]:
    return [n // k + (1 if s < n % k else 0) for s in range(k)]


def _rank(p: int, m: int, steps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pipes = {}
    for name in SCHEDULES:
        v = REGISTRY[name].default_virtual
        model, x = gpt(vocab_size=96, width=128, n_layers=2 * p * 2 - 3, n_heads=4, max_seq_len=64,
                       batch_size=4 * m)  # fmt: skip
        pipes[name] = Pipeline(model, _balance(len(model), p * v), schedule=name, n_virtual=v,
                               n_microbatches=m, loss_fn=gpt_loss)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 96, (4 * m, 64), generator=g)
    y = torch.randint(0, 96, (4 * m, 64), generator=g)
    times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    order = random.Random(2)
    for k in range(warmup + steps):
        names = list(SCHEDULES)
        order.shuffle(names)
        for name in names:
            dist.barrier()
            start = time.perf_counter()
            pipes[name].step(x, y)
            dist.barrier()
            if k >= warmup:
                times[name].append(time.perf_counter() - start)
    memory = {}
    for name, pipe in pipes.items():
        pipe.step(x, y, measure_memory=True)
        stats = pipe.memory_stats()
        memory[name] = (int(stats["activations"]), int(stats["peak"]))
    return {"times": times, "memory": memory}


def tradeoff(p: int = 4, m: int = 8, steps: int = 8, warmup: int = 2) -> None:
    """Print the table (see the module docstring)."""
    per_rank = launch(_rank, p, p, m, steps, warmup, backend="gloo", timeout=900.0)
    print(f"\nMemory against step time: the reference GPT (width 128, {4 * p - 3} blocks), p = {p}, m = {m}, "
          f"real compute, median of {steps} steps; activations held at the peak per rank (MB)")  # fmt: skip
    head = "".join(f"{f'rank {r}':>9}" for r in range(p))
    print(f"{'schedule':<10}{'step ms':>9}{'vs 1f1b':>9}{head}{'max':>8}{'vs 1f1b':>9}{'peak MB':>9}")
    base_t = statistics.median(per_rank[0]["times"]["1f1b"])
    base_a = max(r["memory"]["1f1b"][0] for r in per_rank)
    for name in SCHEDULES:
        t = statistics.median(per_rank[0]["times"][name])
        acts = [r["memory"][name][0] for r in per_rank]
        peak = max(r["memory"][name][1] for r in per_rank)
        cells = "".join(f"{a / 1e6:>9.2f}" for a in acts)
        print(f"{name:<10}{t * 1e3:>9.1f}{t / base_t:>9.2f}{cells}{max(acts) / 1e6:>8.2f}"
              f"{max(acts) / base_a:>9.2f}{peak / 1e6:>9.2f}")  # fmt: skip
