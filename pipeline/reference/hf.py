"""Wrappers that put a Hugging Face transformers model behind a tensor-only ``forward``.

    # B: batch, T: tokens, V: vocabulary

A pipeline hands tensors from stage to stage and traces the model's ``forward``: a transformers
model returns a ``ModelOutput`` and takes keyword arguments, so users wrap it once::

    model = CausalLM(transformers.LlamaForCausalLM(config))    # (B, T) ids [, (B, T) mask] -> logits

Nothing here imports transformers: the wrappers take any module with the transformers call.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CausalLM", "llama_layers"]


class CausalLM(nn.Module):
    """(B, T) ids [, (B, T) attention mask] -> (B, T, V) logits (an LM head, causal or masked)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits  # type: ignore[no-any-return]


class _Embed(nn.Module):
    """(B, T) ids -> (B, T, C)."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)  # type: ignore[no-any-return]


class _Decoder(nn.Module):
    """One decoder layer, causal, with its rotary embedding made from the positions 0..T-1:
    (B, T, C) -> (B, T, C)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, T)
        cos_sin = self.rotary(h, positions)
        return self.layer(h, position_embeddings=cos_sin, attention_mask=None)  # type: ignore[no-any-return]


class _Head(nn.Module):
    """(B, T, C) -> (B, T, V): the final norm and the LM head."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))  # type: ignore[no-any-return]


def llama_layers(model: nn.Module) -> nn.Sequential:
    """A transformers Llama-family ``*ForCausalLM`` as an ``nn.Sequential`` of its own modules: the
    embedding, one layer per decoder layer, the norm and head; (B, T) ids -> (B, T, V) logits, causal,
    without padding masks. Its layers are called as modules, which tensor parallelism needs
    (``pipeline.parallelize_llama``); the parameters are the model's (nothing is copied)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        raise ValueError(
            f"llama_layers takes a transformers Llama-family *ForCausalLM (model.model.layers, "
            f"model.model.rotary_emb, model.lm_head), got {type(model).__name__}; wrap other models with "
            "CausalLM and let partition() trace them"
        )
    attention = getattr(getattr(inner, "config", None), "_attn_implementation", "sdpa")
    if attention != "sdpa":
        raise ValueError(
            f"llama_layers runs causal attention with no mask, which transformers' {attention!r} attention "
            "does not make causal; build the model with attn_implementation='sdpa'"
        )
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise ValueError(
            "llama_layers takes a model whose LM head is its own weight, but this one ties it to the "
            "embedding (config.tie_word_embeddings=True); build it with tie_word_embeddings=False"
        )
    blocks: list[nn.Module] = [_Embed(inner.embed_tokens)]
    blocks += [_Decoder(layer, inner.rotary_emb) for layer in layers]
    blocks.append(_Head(inner.norm, model.get_submodule("lm_head")))
    return nn.Sequential(*blocks)
