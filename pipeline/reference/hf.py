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

__all__ = ["CausalLM"]


class CausalLM(nn.Module):
    """(B, T) ids [, (B, T) attention mask] -> (B, T, V) logits (an LM head, causal or masked)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits  # type: ignore[no-any-return]
