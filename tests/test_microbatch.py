from __future__ import annotations

import pytest
import torch

from pipeline.runtime.microbatch import concat, signature, split


def test_split_tensor_into_views() -> None:
    x = torch.arange(24.0).view(8, 3)
    chunks = split(x, 4)
    assert [c.shape for c in chunks] == [torch.Size([2, 3])] * 4
    assert torch.equal(chunks[1], x[2:4])
    assert chunks[1].data_ptr() == x[2:4].data_ptr()  # a view, not a copy
    assert torch.equal(concat(chunks), x)


def test_split_tuple_keeps_tensors_together() -> None:
    x, y = torch.randn(6, 2), torch.arange(6)
    chunks = split((x, y), 3)
    assert isinstance(chunks[2], tuple)
    assert torch.equal(chunks[2][0], x[4:]) and torch.equal(chunks[2][1], y[4:])
    back = concat(chunks)
    assert isinstance(back, tuple) and torch.equal(back[0], x) and torch.equal(back[1], y)


def test_signature() -> None:
    assert signature(torch.zeros(2, 3)) == (((2, 3), torch.float32),)
    assert signature((torch.zeros(1), torch.zeros(4, dtype=torch.int64))) == (
        ((1,), torch.float32),
        ((4,), torch.int64),
    )


def test_indivisible_batch() -> None:
    with pytest.raises(ValueError, match=r"batch size \(10\) is not divisible by n_microbatches \(4\)"):
        split(torch.zeros(10, 2), 4)


def test_mismatched_tuple_sizes() -> None:
    with pytest.raises(ValueError, match=r"different sizes along dim 0 \(\[4, 2\]\)"):
        split((torch.zeros(4), torch.zeros(2)), 2)


def test_not_a_tensor() -> None:
    with pytest.raises(TypeError, match=r"must be a tensor or a non-empty tuple of tensors, got list"):
        split([1, 2], 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"0-dim tensor"):
        split(torch.tensor(1.0), 1)
