"""Micro-batches: split a batch along dim 0 as evenly as possible and concatenate them back.

    # m: micro-batches, i: a micro-batch, B: batch size (rows)

A batch is a tensor or a tuple of tensors (a stage may take or return several);
every tensor of a tuple is split the same way, so chunk i of a tuple is the tuple
of the tensors' chunks i. Chunks are views (``torch.tensor_split``): no copy.
When m does not divide B, the first B % m micro-batches get one row more:

    split(x, 4)        # x: (8, C)  -> 4 x (2, C)
    split(x, 4)        # x: (30, C) -> 2 x (8, C), 2 x (7, C)       rows(30, 4) == [8, 8, 7, 7]
    concat(chunks)     # back to (B, C)

so a step's micro-batches have at most two sizes. Each micro-batch's loss is
weighted by its share of the rows, ``weights(rows)`` (rows_i / B, which is 1/m
when m divides B): with a loss that is a mean over rows, the weighted sum is the
mean over the whole batch, as one process computes it.

``signature`` describes a batch's tensors by shape and dtype: the executor
allocates receive buffers and checks stage outputs against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "Batch",
    "Signature",
    "as_tuple",
    "batch_rows",
    "concat",
    "from_tuple",
    "rows",
    "signature",
    "split",
    "weights",
]

Batch = torch.Tensor | tuple[torch.Tensor, ...]
# per tensor (shape, dtype); a plain tensor is a one-element signature
Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def as_tuple(batch: Batch) -> tuple[torch.Tensor, ...]:
    return batch if isinstance(batch, tuple) else (batch,)


def from_tuple(tensors: Sequence[torch.Tensor], like_tuple: bool) -> Batch:
    """Inverse of ``as_tuple``: a single tensor unless the original was a tuple."""
    return tuple(tensors) if like_tuple else tensors[0]


def _check(batch: object, what: str) -> tuple[torch.Tensor, ...]:
    tensors = batch if isinstance(batch, tuple) else (batch,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        kinds = ", ".join(type(t).__name__ for t in tensors) or "an empty tuple"
        raise TypeError(f"{what} must be a tensor or a non-empty tuple of tensors, got {kinds}")
    return tensors  # type: ignore[return-value]


def batch_rows(batch: Batch, *, what: str = "batch") -> int:
    """The rows (dim 0) every tensor of ``batch`` has; TypeError / ValueError for anything else."""
    tensors = _check(batch, what)
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{what} holds a 0-dim tensor; micro-batches split dim 0, so give it one")
    sizes = [t.shape[0] for t in tensors]
    if any(n != sizes[0] for n in sizes):
        raise ValueError(f"the tensors of {what} have different sizes along dim 0 ({sizes}); they must agree")
    return int(sizes[0])


def rows(n_rows: int, chunks: int) -> list[int]:
    """The rows of each of ``chunks`` micro-batches of a batch of ``n_rows``: the first n_rows % chunks
    get one more (``torch.tensor_split``'s sizes)."""
    small, extra = divmod(n_rows, chunks)
    return [small + (1 if i < extra else 0) for i in range(chunks)]


def weights(sizes: Sequence[int]) -> list[float]:
    """Each micro-batch's share of the batch's rows: the weight of its loss."""
    total = sum(sizes)
    return [n / total for n in sizes]


def split(batch: Batch, chunks: int, *, what: str = "batch") -> list[Batch]:
    """``chunks`` micro-batches along dim 0, as even as possible (see ``rows``); at least one row each."""
    n = batch_rows(batch, what=what)
    if n < chunks:
        raise ValueError(
            f"{what} has {n} rows but n_microbatches is {chunks}, and every micro-batch needs at least one "
            f"row; pass a batch of at least {chunks} rows, or build the Pipeline with n_microbatches <= {n}"
        )
    parts = [t.tensor_split(chunks) for t in as_tuple(batch)]
    if isinstance(batch, tuple):
        return [tuple(p[i] for p in parts) for i in range(chunks)]
    return list(parts[0])


def concat(chunks: Sequence[Batch]) -> Batch:
    """Concatenate micro-batches along dim 0 (inverse of ``split``)."""
    if not chunks:
        raise ValueError("concat needs at least one micro-batch")
    if isinstance(chunks[0], tuple):
        columns = zip(*(as_tuple(c) for c in chunks), strict=True)
        return tuple(torch.cat(col) for col in columns)
    return torch.cat([c for c in chunks if isinstance(c, torch.Tensor)])


def signature(batch: Batch) -> Signature:
    return tuple((tuple(t.shape), t.dtype) for t in as_tuple(batch))
