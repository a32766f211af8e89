"""Micro-batches: split a batch along dim 0 into equal chunks and concatenate them back.

    # m: micro-batches, B: batch size

A batch is a tensor or a tuple of tensors (a stage may take or return several);
every tensor of a tuple is split the same way, so chunk i of a tuple is the tuple
of the tensors' chunks i. Chunks are views (``torch.chunk``): no copy.

    split(x, 4)        # x: (8, C) -> 4 x (2, C)
    concat(chunks)     # 4 x (2, C) -> (8, C)

``signature`` describes a batch's tensors by shape and dtype: the executor
allocates receive buffers and checks stage outputs against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Batch", "Signature", "as_tuple", "concat", "from_tuple", "signature", "split"]

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


def split(batch: Batch, chunks: int, *, what: str = "batch") -> list[Batch]:
    """``chunks`` equal micro-batches along dim 0; the batch size must be a multiple of ``chunks``."""
    tensors = _check(batch, what)
    for t in tensors:
        if t.dim() == 0:
            raise ValueError(f"{what} holds a 0-dim tensor; micro-batches split dim 0, so give it one")
        if t.shape[0] % chunks != 0:
            raise ValueError(
                f"{what} size ({t.shape[0]}) is not divisible by n_microbatches ({chunks}); "
                f"use a batch size that is a multiple of {chunks} "
                f"(e.g. {chunks * max(1, t.shape[0] // chunks)}) or change n_microbatches"
            )
    size = tensors[0].shape[0]
    if any(t.shape[0] != size for t in tensors):
        sizes = [t.shape[0] for t in tensors]
        raise ValueError(f"the tensors of {what} have different sizes along dim 0 ({sizes}); they must agree")
    parts = [t.chunk(chunks) for t in tensors]
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
