"""``partitioner.flops``: every op counts, forward and backward, and attention the same on CPU as on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from partitioner.flops import FlopCount


def _count(fn, *args):  # type: ignore[no-untyped-def]
    """(forward flops, backward flops) of fn(*args) with a backward of ones."""
    with FlopCount() as count:
        out = fn(*args)
        forward = count.total
        out.backward(torch.ones_like(out))
    return forward, count.total - forward


def test_ops_torch_does_not_count() -> None:
    x = torch.randn(4, 16, requires_grad=True)
    ln = nn.LayerNorm(16)
    with FlopCounterMode(display=False) as theirs:
        ln(x)
    assert theirs.get_total_flops() == 0  # what the old cost saw
    assert _count(ln, x) == (4 * 16, 4 * 16)  # one per element of the output, forward and backward
    emb = nn.Embedding(100, 16)
    ids = torch.randint(0, 100, (4, 8))
    # the lookup moves rows (0); its backward adds each row's gradient into the weight's (4 x 8 x 16)
    assert _count(emb, ids) == (0, 4 * 8 * 16)
    assert _count(lambda t: F.gelu(t).sum(), x) == (2 * 4 * 16, 4 * 16 + 4 * 16)


def test_attention_on_cpu_counts_like_cuda() -> None:
    q = torch.randn(2, 4, 32, 16, requires_grad=True)
    forward, backward = _count(lambda t: F.scaled_dot_product_attention(t, t, t, is_causal=True), q)
    shape = (2, 4, 32, 16)
    # the formulas torch applies to the CUDA kernels (flash, efficient, cudnn) for these shapes
    assert forward == flop_counter.sdpa_flop_count(shape, shape, shape)  # type: ignore[no-untyped-call]
    count_backward = flop_counter.sdpa_backward_flop_count  # type: ignore[attr-defined]
    assert backward >= count_backward(shape, shape, shape, shape)  # plus adding q's three gradients
    with FlopCounterMode(display=False) as theirs:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    if q.device.type == "cpu":
        assert theirs.get_total_flops() == 0  # torch has no formula for the CPU kernel


def test_matmuls_and_views() -> None:
    lin = nn.Linear(16, 32, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    assert _count(lin, x) == (2 * 4 * 16 * 32, 2 * (2 * 4 * 16 * 32))  # input and weight gradients
    assert _count(lambda t: t.view(2, 32).t().contiguous(), x)[0] == 0  # views and copies: 0
