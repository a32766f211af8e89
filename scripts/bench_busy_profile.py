"""Profiles on a busy machine: how long ``profile`` takes and what ``partition`` plans while other
processes burn the cores (issue 45: a 6-layer toy Llama took 111-205 s and balanced its six identical
decoder layers as [2, 2, 1, 5]; a 10-layer MLP got [3, 7]).

    python scripts/bench_busy_profile.py                      # 2 burners, 3 runs of each model
    python scripts/bench_busy_profile.py --burners 0 --runs 1
    PYTHONPATH=<another checkout> python <this file> ...      # the same runs on other code

Per run and model: the profile's seconds, the plan's balance, and that balance's bottleneck in flops
over the best one's (1.00: as even as the flops allow): the toy Llama (transformers, 6 identical
decoder layers, traced) on 4 ranks, the 10-layer MLP (``pipeline.reference.models.mlp``) on 2.
One JSON line per run. It uses only ``profile`` and ``partition``'s long-standing arguments, so
that older code runs it too.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from partitioner import layer_costs, partition, profile
from partitioner.costs import cut_groups
from partitioner.solve import solve
from pipeline.reference.models import mlp


@contextlib.contextmanager
def burning(count: int) -> Iterator[None]:
    """``count`` processes spinning on a core each, killed on the way out."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=30)


def toy_llama() -> tuple[nn.Module, torch.Tensor]:
    import transformers as tf

    from pipeline.reference.hf import CausalLM

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return CausalLM(tf.LlamaForCausalLM(config)), torch.randint(0, 256, (4, 32))


def _bottleneck(costs: list[float], balance: list[int]) -> float:
    ends = list(itertools.accumulate(balance))
    return max(sum(costs[end - n : end]) for n, end in zip(balance, ends, strict=True))


def run(name: str, model: nn.Module, sample: Any, n_ranks: int) -> dict[str, Any]:
    start = time.perf_counter()
    prof = profile(model, sample)
    seconds = time.perf_counter() - start
    balance = partition(model, n_ranks, sample, profile=prof).balance
    flops = layer_costs(prof, "flops")
    worst = _bottleneck(flops, balance)
    sizes, _ = cut_groups(prof.layers, prof.cut_reasons)  # the runs of layers no cut may split
    grouped = [sum(flops[sum(sizes[:g]) : sum(sizes[: g + 1])]) for g in range(len(sizes))]
    best = _bottleneck(grouped, solve(grouped, n_ranks))
    return {
        "model": name,
        "seconds": round(seconds, 1),
        "balance": balance,
        "flops_bottleneck": round(worst / best, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burners", type=int, default=2, help="processes spinning on a core each")
    parser.add_argument("--runs", type=int, default=3, help="runs of each model")
    parser.add_argument("--models", default="llama,mlp", help="comma-separated: llama, mlp")
    args = parser.parse_args(argv)
    wanted = args.models.split(",")
    with burning(args.burners):
        for _ in range(args.runs):
            if "llama" in wanted:
                print(json.dumps(run("llama", *toy_llama(), 4)), flush=True)
            if "mlp" in wanted:
                print(json.dumps(run("mlp", *mlp(width=256, depth=10, batch_size=64), 2)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
