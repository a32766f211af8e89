"""A transformers Llama trained on (pp, shard, tp) at once: pipeline stages, FSDP2 shards, tensor parallelism.

    torchrun --standalone --nproc-per-node 8 examples/llama_3d.py --pp 2 --shard 2 --tp 2
    python examples/llama_3d.py --pp 2 --shard 2 --tp 2       # starts the 8 local ranks itself

    # B: batch, T: tokens, V: vocabulary (the reference data's 98 characters)
    # d: replica, h: shard, r: pipeline rank, t: tp rank

One DeviceMesh ("dp_replicate", "dp_shard", "pp", "tp") holds every rank; global rank
g = ((d * shard + h) * pp + r) * tp + t, so tp ranks are neighbours (on a GPU node they share the
fastest links: they all-reduce inside every block), then the pipeline, then the data ranks.

What a user writes, top to bottom:

    model       LlamaForCausalLM (sdpa attention, its own LM head) as an nn.Sequential of its own
                modules (llama_layers): tensor parallelism needs layers called as modules
    partition   the balance of a pipeline's stages, by FLOPs, with shard / tp / zero recorded in the
                plan (each rank's memory priced as one rank of that composition)
    Pipeline    each rank builds its stages; parallelize_llama splits q/k/v/o and the MLP over "tp";
                fully_shard splits what is left over "dp_shard" (and "dp_replicate": HSDP)
    train       each data rank (pipe.replica of pipe.dp = dp x shard) takes its rows of the batch;
                AdamW over the rank's parameters, clipped by the global norm
    memory      after one step, each rank's parameter, gradient and AdamW bytes against what the
                same stages hold whole (shard=1, tp=1)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pipeline
from partitioner import partition
from partitioner.noise import NoisyProfileWarning
from pipeline import Pipeline
from pipeline.launch import FORKSERVER_PRELOAD
from pipeline.reference.data import VOCAB_SIZE, CharDataset
from pipeline.reference.hf import llama_layers

warnings.filterwarnings("ignore", module="transformers")  # its notes on small configs
# partition times every layer even when it balances by flops (cost="flops" below): its timings do not
# choose the balance here, so their noise on a busy CPU does not matter
warnings.filterwarnings("ignore", category=NoisyProfileWarning)


def llama(args: argparse.Namespace) -> nn.Sequential:
    """The same seeded model on every rank (each keeps its stages; tp and FSDP split them there)."""
    import transformers

    # sdpa attention and an LM head of its own: what llama_layers needs (attn_implementation is a
    # PretrainedConfig keyword that LlamaConfig's typed signature does not list)
    config = transformers.LlamaConfig(  # type: ignore[call-arg]
        vocab_size=VOCAB_SIZE, hidden_size=args.width, intermediate_size=2 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq_len, attention_dropout=0.0, use_cache=False,
        tie_word_embeddings=False, attn_implementation="sdpa",
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return llama_layers(transformers.LlamaForCausalLM(config))  # embed, one per decoder layer, head


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B * T, V) against (B * T,)


def whole_bytes(pipe: Pipeline) -> int:
    """This rank's stages' parameters as one process holds them (shard=1, tp=1): every element of the
    full tensors (a DTensor's numel is its global one), at its dtype."""
    return sum(p.numel() * p.element_size() for p in pipe.parameters())


def memory_row(pipe: Pipeline, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """One rank's bytes after a step, and the same stages' whole bytes: AdamW keeps two tensors of
    each parameter's size (exp_avg, exp_avg_sq) and a one-element step count per parameter."""
    stats = pipe.memory_stats(opt)
    whole = whole_bytes(pipe)
    n_tensors = sum(1 for _ in pipe.parameters())
    return {
        "rank": dist.get_rank(),
        "coords": tuple(pipe.mesh.get_coordinate()) if pipe.mesh is not None else (0, 0, 0, 0),
        "params": stats["parameters"],
        "grads": stats["gradients"],
        "optim": stats["optimizer"] or 0,
        "whole": whole,
        "whole_optim": 2 * whole + 4 * n_tensors,
    }


def print_memory(rows: list[dict[str, Any]]) -> None:
    kb = 1024
    print("memory per rank after one step (KiB): this rank's bytes | whole: the same stages at shard=1, tp=1")
    print(" rank  (d,h,r,t)   params  whole  |  grads  whole  |  AdamW  whole  | params / whole")
    for row in rows:
        coords = ",".join(map(str, row["coords"]))
        print(
            f"{row['rank']:5d}  ({coords})  {row['params'] / kb:7.1f} {row['whole'] / kb:6.1f}  | "
            f"{row['grads'] / kb:6.1f} {row['whole'] / kb:6.1f}  | "
            f"{row['optim'] / kb:6.1f} {row['whole_optim'] / kb:6.1f}  | {row['params'] / row['whole']:.2f}",
            flush=True,
        )


def print_layout(args: argparse.Namespace, balance: list[int], rows: int) -> None:
    world, dims = args.dp * args.shard * args.pp * args.tp, (args.dp, args.shard, args.pp, args.tp)
    print("layout: {} ranks = dp_replicate {} x dp_shard {} x pp {} x tp {}".format(world, *dims))
    print(f"  global rank g = ((d * {args.shard} + h) * {args.pp} + r) * {args.tp} + t")
    print(
        f"  tp            t < {args.tp}: each decoder block's q/k/v/o and MLP Linears divided by {args.tp} "
        "(neighbouring ranks; embedding, norms and head whole)"
    )
    print(f"  pp            r < {args.pp}: the stages' layers {balance} (embedding first, head last)")
    print(
        f"  dp_shard      h < {args.shard}: each stage's parameters, gradients and AdamW state divided by "
        f"{args.shard} (FSDP2, ZeRO-{args.zero})"
    )
    print(f"  dp_replicate  d < {args.dp}: whole replicas of all the above (HSDP with dp_shard > 1)")
    print(
        f"  data          each of the dp x shard = {args.dp * args.shard} data ranks takes {rows} of the "
        f"{args.batch_size} rows, in {args.m} micro-batches",
        flush=True,
    )


def train(args: argparse.Namespace) -> float:
    info = pipeline.init_distributed()  # torchrun's environment, or the group launch made
    world = args.dp * args.shard * args.pp * args.tp
    if info.world_size != world:
        raise ValueError(
            f"--dp {args.dp} x --shard {args.shard} x --pp {args.pp} x --tp {args.tp} is {world} ranks "
            f"but {info.world_size} were started; run torchrun --nproc-per-node {world}"
        )
    model = llama(args)
    data_ranks = args.dp * args.shard  # each takes its own rows
    if args.batch_size % (data_ranks * args.m):
        raise ValueError(
            f"--batch-size {args.batch_size} must divide into dp x shard = {data_ranks} data ranks "
            f"of --m {args.m} micro-batches each"
        )
    rows = args.batch_size // data_ranks
    micro = torch.zeros(rows // args.m, args.seq_len, dtype=torch.long)  # one micro-batch of one data rank
    # solved on global rank 0 (every rank gets its plan); each rank's memory priced as one rank of the
    # composition (partitioner.composition)
    plan = partition(model, args.pp, micro, schedule=args.schedule, n_microbatches=args.m,
                     dp=args.dp, shard=args.shard, tp=args.tp, zero=args.zero,
                     loss_fn=lm_loss, target=micro, cost="flops")  # fmt: skip
    split = pipeline.parallelize_llama if args.tp > 1 else None  # the Pipeline refuses one it would not call
    pipe = Pipeline(model, plan, loss_fn=lm_loss, parallelize_fn=split)
    first = info.rank == 0
    if first:
        print_layout(args, plan.balance, rows)
        print(plan, flush=True)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    data = CharDataset.load(Path(json.__file__).parent)  # the json package's sources, as characters
    mine = slice(pipe.replica * rows, (pipe.replica + 1) * rows)  # this data rank's rows
    loss = float("nan")
    for step in range(args.steps):
        x, y = data.batch("train", step, args.batch_size, args.seq_len, seed=0)  # (B, T) each
        loss = pipe.step(x[mine], y[mine])  # the global batch's mean loss, on every rank
        norm = pipe.clip_grad_norm_(1.0)
        opt.step()
        if step == 0:  # after AdamW made its state, before the gradients are dropped
            row = memory_row(pipe, opt)
            rows_of: list[Any] | None = [None] * info.world_size if first else None
            dist.gather_object(row, rows_of, dst=0)
            if rows_of is not None:
                print_memory(rows_of)
        opt.zero_grad()
        if first and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:3d} | loss {loss:.4f} | grad norm {norm:.3f}", flush=True)
    pipe.close()
    if not math.isfinite(loss):
        raise RuntimeError(f"the loss is {loss} after {args.steps} steps")
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    parser.add_argument("--shard", type=int, default=1, help="FSDP2 parts of each stage")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of each stage")
    parser.add_argument("--dp", type=int, default=1, help="replicas (HSDP when --shard > 1 too)")
    parser.add_argument("--zero", type=int, choices=(2, 3), default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--m", type=int, default=4, help="micro-batches per data rank and step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16, help="rows of the global batch")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun started this rank
        loss = train(args)
        if dist.get_rank() == 0:
            print(f"final loss {loss:.4f} on {dist.get_world_size()} ranks")
        dist.destroy_process_group()
        return
    world = args.dp * args.shard * args.pp * args.tp
    # the ranks are forked from one server that imported torch and transformers once (seconds each
    # per rank otherwise, on every one of the world's ranks)
    FORKSERVER_PRELOAD.append("transformers.models.llama.modeling_llama")
    losses = pipeline.launch(train, world, args, start_method="forkserver")
    print(f"final loss {losses[0]:.4f} on {world} ranks")


if __name__ == "__main__":
    main()
