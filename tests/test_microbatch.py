from __future__ import annotations

import pytest
import torch

from pipeline.runtime.inputs.microbatch import concat, rows, signature, split, weights


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


SPLITS = [(30, 4, [8, 8, 7, 7]), (7, 3, [3, 2, 2]), (8, 4, [2] * 4), (4, 4, [1] * 4)]  # (B, m, rows)


@pytest.mark.parametrize(("n", "m", "sizes"), SPLITS)
def test_uneven_batches_split_as_evenly_as_possible(n: int, m: int, sizes: list[int]) -> None:
    x, y = torch.arange(float(n)).view(n, 1).expand(n, 3), torch.arange(n)
    chunks = split((x, y), m)
    assert rows(n, m) == sizes == [c[0].shape[0] for c in chunks] == [c[1].shape[0] for c in chunks]
    assert all(c[0].data_ptr() == x[sum(sizes[:i]) :].data_ptr() for i, c in enumerate(chunks))  # views
    back = concat(chunks)
    assert isinstance(back, tuple) and torch.equal(back[0], x) and torch.equal(back[1], y)
    shares = weights(sizes)
    assert shares == [k / n for k in sizes] and abs(sum(shares) - 1.0) < 1e-12
    if n % m == 0:
        assert shares == [1.0 / m] * m  # even batches weigh each micro-batch exactly 1/m, as before


def test_fewer_rows_than_micro_batches_names_both_and_the_fix() -> None:
    error = (
        r"inputs has 3 rows but n_microbatches is 4, and every micro-batch needs at least one row; pass "
        r"a batch of at least 4 rows, or build the Pipeline with n_microbatches <= 3"
    )
    with pytest.raises(ValueError, match=error):
        split(torch.zeros(3, 2), 4, what="inputs")


def test_mismatched_tuple_sizes() -> None:
    with pytest.raises(ValueError, match=r"different sizes along dim 0 \(\[4, 2\]\)"):
        split((torch.zeros(4), torch.zeros(2)), 2)


def test_not_a_tensor() -> None:
    with pytest.raises(TypeError, match=r"must be a tensor or a non-empty tuple of tensors, got list"):
        split([1, 2], 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"0-dim tensor"):
        split(torch.tensor(1.0), 1)
