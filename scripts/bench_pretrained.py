"""Pretrained weights per stage: each rank's memory while it builds its stages and loads them.

    python scripts/bench_pretrained.py                   # a 4-layer Llama, 2 ranks, ~1 min
    python scripts/bench_pretrained.py --layers 8 --width 512 --ranks 4

A Llama of the given size is saved with ``save_pretrained`` (sharded), then on each rank, side by
side in the same processes:

    ours        a meta-device model, Pipeline (this rank's stages only), pipe.load_pretrained(folder)
    naive       what a script does without per-stage loading: the whole model built on the CPU and
                its whole checkpoint read (safetensors' load_file of every shard), then split

Memory is Linux's peak resident set size (every live byte: tensors, the allocator's slack, mapped
file pages), reset (``/proc/self/clear_refs``) before each phase and read after it, less what was
resident before. The table gives, per rank, its own stages' bytes, the growth of ours while it
builds and while it loads, and the naive load's growth; the model's whole size for scale.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import pipeline
from partitioner import partition
from pipeline import Pipeline, Plan
from pipeline.reference.hf import CausalLM, hf_init

warnings.filterwarnings("ignore", module="transformers")


def config(args: argparse.Namespace) -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=4 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def meta_model(args: argparse.Namespace) -> CausalLM:
    import transformers

    with torch.device("meta"):
        return CausalLM(transformers.LlamaForCausalLM(config(args)))


def _resident(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _grew(fn: Any) -> tuple[Any, int]:
    """fn()'s result and how far the peak resident set rose above what was resident before."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from the current resident set
    before = _resident("VmRSS")
    out = fn()
    return out, _resident("VmHWM") - before


def rank(plan: Plan, args: argparse.Namespace) -> tuple[int, int, int, int]:
    """(own bytes, build growth, load growth, naive growth) on this rank."""
    import transformers
    from safetensors.torch import load_file

    model = meta_model(args)
    init = hf_init(model, pretrained=True)  # inv_freq: in no checkpoint
    pipe, built = _grew(lambda: Pipeline(model, plan, loss_fn=F.cross_entropy, init_fn=init))
    _, loaded = _grew(lambda: pipe.load_pretrained(args.folder))
    own = sum(t.numel() * t.element_size() for t in [*pipe.parameters(), *pipe.buffers()])
    pipe.close()

    def naive() -> None:
        whole = transformers.LlamaForCausalLM(config(args))
        for shard in sorted(Path(args.folder).glob("*.safetensors")):
            whole.load_state_dict(load_file(str(shard)), strict=False)

    _, naive_grew = _grew(naive)
    return own, built, loaded, naive_grew


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("this benchmark reads Linux's peak resident set (/proc/self/clear_refs)")
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        args.folder = folder
        torch.manual_seed(0)
        saved = transformers.LlamaForCausalLM(config(args))
        total = sum(p.numel() * p.element_size() for p in saved.parameters())
        saved.save_pretrained(folder, max_shard_size=f"{max(1, total // 4 // 2**20)}MB")
        del saved
        model = meta_model(args)
        sample = torch.zeros(2, 32, dtype=torch.long)
        plan = partition(
            model, args.ranks, sample, n_microbatches=args.ranks, device="cpu", init_fn=hf_init(model)
        )
        rows = pipeline.launch(rank, args.ranks, plan, args)
    mb = 2**20
    print(f"Llama, {args.layers} layers, width {args.width}, vocab {args.vocab}: {total / mb:.1f} MB of fp32")
    print(f"{'rank':>4}  {'own MB':>7}  {'ours: build':>11}  {'ours: load':>10}  {'naive load':>10}")
    for r, (own, built, loaded, naive_grew) in enumerate(rows):
        print(f"{r:>4}  {own / mb:7.1f}  {built / mb:11.1f}  {loaded / mb:10.1f}  {naive_grew / mb:10.1f}")


if __name__ == "__main__":
    main()
