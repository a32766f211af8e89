"""A Llama from Hugging Face transformers on 2 ranks: pretrained weights per stage, training, a checkpoint.

    python examples/hf_llama.py                          # saves a stand-in "pretrained" folder, then trains
    python examples/hf_llama.py --pretrained DIR         # any save_pretrained folder of this config

    # B: batch, T: tokens, V: vocabulary (the reference data's 98 characters)

What a user writes, top to bottom:

    wrapper        CausalLM: the transformers model takes ids and returns the logits tensor (a
                   pipeline passes tensors between stages, not a ModelOutput)
    meta model     built under torch.device("meta"): no rank ever holds the whole model
    partition      traced on the meta model with one micro-batch of ids; every layer profiled on
                   the CPU in turn (device=, and init_fn=hf_init(model): a fresh model's values)
    Pipeline       each rank builds its stages; load_pretrained reads only their tensors from the
                   safetensors files; init_fn=hf_init(model, pretrained=True) gives what no
                   checkpoint holds, the rotary table (a non-persistent buffer transformers computes)
    train          AdamW with clipping over every stage; then a torch.distributed.checkpoint save

There is no network here, so the script makes the "pretrained" folder itself from a seeded model
(``save_pretrained``, sharded), as a download would leave it.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import pipeline
from partitioner import partition
from pipeline import Pipeline, Plan, checkpointing
from pipeline.reference.data import VOCAB_SIZE, CharDataset
from pipeline.reference.hf import CausalLM, hf_init

warnings.filterwarnings("ignore", module="transformers")  # its notes on small configs


def config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def meta_model() -> CausalLM:
    import transformers

    with torch.device("meta"):  # parameters without storage: each rank materialises its stages only
        return CausalLM(transformers.LlamaForCausalLM(config()))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B * T, V) against (B * T,)


def train(plan: Plan, args: argparse.Namespace) -> float:
    model = meta_model()
    pipe = Pipeline(model, plan, loss_fn=lm_loss, init_fn=hf_init(model, pretrained=True))
    pipe.load_pretrained(args.pretrained)  # this rank's tensors only; the tied head from the embedding
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    data = CharDataset.load(Path(json.__file__).parent)  # the json package's sources, as characters
    loss = float("nan")
    for step in range(args.steps):
        x, y = data.batch("train", step, args.batch_size, args.seq_len, seed=0)  # (B, T) each
        loss = pipe.step(x, y)
        pipe.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if pipe.rank == 0 and step % 10 == 0:
            print(f"step {step:3d} | loss {loss:.3f}", flush=True)
    checkpointing.save(args.out / "checkpoints", args.steps, pipe=pipe, optimizer=opt)
    pipe.close()
    return loss


def save_stand_in(folder: Path) -> None:
    """What a download of pretrained weights leaves: config.json and sharded safetensors."""
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config()).save_pretrained(folder, max_shard_size="100KB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pretrained", type=Path, help="a save_pretrained folder (default: make one)")
    parser.add_argument("--out", type=Path, default=Path("runs/hf_llama"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    if args.pretrained is None:
        args.pretrained = args.out / "pretrained"
        save_stand_in(args.pretrained)
    model = meta_model()
    sample = torch.zeros(args.batch_size // 4, args.seq_len, dtype=torch.long)  # one micro-batch of ids
    plan = partition(model, 2, sample, n_microbatches=4, device="cpu", init_fn=hf_init(model))
    print(plan)
    losses = pipeline.launch(train, 2, plan, args)
    print(f"final loss {losses[0]:.3f}; checkpoint in {args.out / 'checkpoints'}")


if __name__ == "__main__":
    main()
