"""A model whose forward does not return tensors, passed to ``partition`` as it is: the error says
that a pipeline passes tensors between stages and shows the wrapper, not the ways out of a branch on
data (an nn.Sequential, torch.where) that the other untraceable models get."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from partitioner import partition

tf = pytest.importorskip("transformers")


def _llama() -> Any:
    config = tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config)


def test_an_unwrapped_transformers_model_is_told_to_wrap_it() -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as info:
        partition(_llama(), 2, ids)
    message = str(info.value)
    assert "LlamaForCausalLM" in message and "transformers model" in message
    assert "passes tensors between stages" in message
    assert "from pipeline.reference.hf import CausalLM; model = CausalLM(hf_model)" in message
    assert "nn.Sequential" not in message and "torch.where" not in message


class _Cache:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _ReturnsCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, _Cache]:
        h = self.a(x)
        return self.b(h), _Cache(h)


def test_a_module_that_returns_a_non_tensor_is_told_to_return_tensors() -> None:
    with pytest.raises(ValueError) as info:
        partition(_ReturnsCache(), 2, torch.randn(2, 4))
    message = str(info.value)
    assert "returns a _Cache, which is not a tensor" in message
    assert "passes tensors between stages" in message and "nn.Sequential" not in message
