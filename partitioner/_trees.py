"""What a layer takes and returns: a tensor, or tuples, lists and dicts of them (other values pass).

    # l: layer

The profiler walks a layer's input and output with these: its tensors (``tensors``), the same
structure with every tensor replaced (``tree_map``), and whether the pipeline could send it
between stages (``sendable``: a tensor or a tuple of tensors, as ``pipeline.runtime.inputs.microbatch``
takes; a dict or a ``None`` in a tuple are fine inside a stage but cannot cross a cut).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["describe", "nbytes", "sendable", "tensors", "tree_map"]


def tensors(x: Any) -> list[torch.Tensor]:
    """Every tensor in ``x``, in order (dict values in insertion order)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in tensors(item)]
    return []


def tree_map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``x`` with ``fn`` applied to each of its tensors; containers keep their type and keys."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(tree_map(item, fn) for item in x)
    if isinstance(x, dict):
        return type(x)((key, tree_map(item, fn)) for key, item in x.items())
    return x


def sendable(x: Any) -> bool:
    """Whether the pipeline can send ``x`` to another stage: a tensor or a non-empty tuple of them."""
    if isinstance(x, torch.Tensor):
        return True
    return isinstance(x, tuple) and len(x) > 0 and all(isinstance(t, torch.Tensor) for t in x)


def nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(x))


def describe(x: Any) -> str:
    found = tensors(x)
    if not found:
        return f"of type {type(x).__name__}"
    return ", ".join(f"of shape {tuple(t.shape)} ({str(t.dtype).removeprefix('torch.')})" for t in found)
