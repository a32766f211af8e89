"""Hugging Face transformers models as a user brings them: small configs, no downloads, a wrapper each.

    # B: batch, T: tokens, C: channels, H, W: image sides, V: vocabulary

A user wraps the transformers model so that it takes tensors and returns the logits (a pipeline
passes tensors between stages; a ``ModelOutput`` is a dict-like object, not something to cut):
``pipeline.reference.hf.CausalLM`` for language models, ``ImageClassifier`` below for images.

Every config turns dropout off, so one process and the pipeline draw nothing random and their
gradients can be compared to 1e-5. ``CASES`` names each case: the architecture, and what it covers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.launch import FORKSERVER_PRELOAD
from pipeline.reference.hf import CausalLM

__all__ = ["CASES", "Case", "CausalLM", "ImageClassifier", "MaskedLM", "Seq2SeqLM", "build", "loss_of"]

V, T, IMAGE = 64, 8, 16  # vocabulary, tokens per sequence, image side


class MaskedLM(CausalLM):
    """BERT: (B, T) ids [, (B, T) mask] -> (B, T, V) logits of the masked-token head."""


class Seq2SeqLM(nn.Module):
    """An encoder-decoder (BART, T5): (B, T) ids, (B, T) mask, (B, T) decoder ids -> (B, T, V) logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
        return out.logits  # type: ignore[no-any-return]


class ImageClassifier(nn.Module):
    """(B, 3, H, W) pixels -> (B, classes) logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels).logits  # type: ignore[no-any-return]


def _decoder(kind: str, blocks: int = 2, **extra: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers as tf

        config = getattr(tf, f"{kind}Config")(
            vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=blocks,
            num_attention_heads=4, max_position_embeddings=32, attention_dropout=0.0, **_TOKENS, **extra,
        )  # fmt: skip
        return CausalLM(getattr(tf, f"{kind}ForCausalLM")(config))

    return make


_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # inside the small vocabulary


def _opt() -> nn.Module:
    import transformers as tf

    config = tf.OPTConfig(
        vocab_size=V, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0, **_TOKENS,
    )  # fmt: skip
    return CausalLM(tf.OPTForCausalLM(config))


def _neox() -> nn.Module:
    import transformers as tf

    config = tf.GPTNeoXConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, attention_dropout=0.0, hidden_dropout=0.0, **_TOKENS,
    )  # fmt: skip
    return CausalLM(tf.GPTNeoXForCausalLM(config))


def _gpt2() -> nn.Module:
    import transformers as tf

    config = tf.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, **_TOKENS,
    )  # fmt: skip
    return CausalLM(tf.GPT2LMHeadModel(config))


def _bert() -> nn.Module:
    import transformers as tf

    config = tf.BertConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return MaskedLM(tf.BertForMaskedLM(config))


def _vit() -> nn.Module:
    import transformers as tf

    config = tf.ViTConfig(
        image_size=IMAGE, patch_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return ImageClassifier(tf.ViTForImageClassification(config))


def _resnet() -> nn.Module:
    import transformers as tf

    config = tf.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1], layer_type="basic", num_labels=5
    )
    return ImageClassifier(tf.ResNetForImageClassification(config))


def _bart() -> nn.Module:
    import transformers as tf

    config = tf.BartConfig(
        vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=2, **_TOKENS,
    )  # fmt: skip
    model = tf.BartForConditionalGeneration(config)
    with torch.no_grad():  # zeros as built: values of its own make a wrong charge show in the gradients
        model.final_logits_bias.normal_()
    return Seq2SeqLM(model)


def _t5() -> nn.Module:
    import transformers as tf

    config = tf.T5Config(
        vocab_size=V, d_model=16, d_kv=4, d_ff=32, num_layers=3, num_decoder_layers=3, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, **_TOKENS,
    )  # fmt: skip
    return Seq2SeqLM(tf.T5ForConditionalGeneration(config))


@dataclass(frozen=True)
class Case:
    """One architecture: how to build it, its inputs ("ids", "ids+mask", "seq2seq": ids, mask and
    decoder ids, or "pixels"), what it covers."""

    name: str
    make: Callable[[], nn.Module]
    inputs: str
    covers: str


CASES = {
    case.name: case
    for case in (
        Case("llama", _decoder("Llama", num_key_value_heads=2), "ids+mask", "GQA, rotary, RMSNorm, untied"),
        Case(
            "qwen2",
            _decoder("Qwen2", num_key_value_heads=2, tie_word_embeddings=True),
            "ids",
            "GQA, rotary, tied embeddings",
        ),
        Case(
            "mistral",
            _decoder("Mistral", num_key_value_heads=2, sliding_window=4),
            "ids+mask",
            "sliding-window attention",
        ),
        Case(
            "gemma",
            _decoder("Gemma", num_key_value_heads=1, head_dim=4),
            "ids",
            "multi-query, scaled embeddings, tied",
        ),
        Case("phi3", _decoder("Phi3", num_key_value_heads=2), "ids", "fused qkv, partial rotary"),
        Case(
            "cohere", _decoder("Cohere", num_key_value_heads=2), "ids", "logit scale outside any module, tied"
        ),
        Case(
            "gemma2",
            _decoder("Gemma2", num_key_value_heads=1, head_dim=4, sliding_window=4),
            "ids",
            "final logit softcap outside any module, alternating sliding window",
        ),
        Case("neox", _neox, "ids+mask", "GPT-NeoX: parallel residual, partial rotary"),
        Case("opt", _opt, "ids+mask", "OPT: positions from the attention mask"),
        Case("gpt2", _gpt2, "ids", "learned positions, tied head"),
        Case("bert", _bert, "ids+mask", "encoder, tied MLM head"),
        Case("vit", _vit, "pixels", "patch embedding, class token"),
        Case("resnet", _resnet, "pixels", "convolutions, BatchNorm buffers"),
        Case("bart", _bart, "seq2seq", "encoder-decoder, a logits bias buffer of the top module"),
        Case("t5", _t5, "seq2seq", "encoder-decoder, relative position bias, tied embeddings"),
    )
}


def build(name: str, batch: int, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """(model, inputs, targets) of ``CASES[name]``, the same on every call for one seed."""
    case = CASES[name]
    torch.manual_seed(seed)
    model = case.make()
    model.train()
    g = torch.Generator().manual_seed(seed + 1)
    if case.inputs == "pixels":
        x = torch.randn(batch, 3, IMAGE, IMAGE, generator=g)  # (B, 3, H, W)
        return model, (x,), torch.randint(0, 5, (batch,), generator=g)
    ids = torch.randint(1, V, (batch, T), generator=g)  # (B, T)
    targets = torch.randint(0, V, (batch, T), generator=g)  # (B, T)
    if case.inputs == "ids":
        return model, (ids,), targets
    mask = torch.ones(batch, T, dtype=torch.long)
    mask[::2, : T // 4] = 0  # every other sequence left-padded by a quarter
    if case.inputs == "seq2seq":
        return model, (ids, mask, torch.randint(1, V, (batch, T), generator=g)), targets
    return model, (ids, mask), targets


def loss_of(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss a user writes: cross entropy over tokens (sequence models) or images."""
    return _token_loss if CASES[name].inputs != "pixels" else F.cross_entropy


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B * T, V) against (B * T,)


# The ranks of the tests that build these models fork from launch's server (tests/dist.py). With
# transformers and each architecture imported there once, a rank skips some 3 s of imports. The
# server reads the list when it starts (the first launch: after collection, which imports this).
_KINDS = ("llama", "qwen2", "mistral", "gemma", "phi3", "cohere", "gemma2", "gpt_neox", "opt", "gpt2", "bert",
          "vit", "resnet", "bart", "t5")  # fmt: skip
FORKSERVER_PRELOAD += [f"transformers.models.{kind}.modeling_{kind}" for kind in _KINDS]
