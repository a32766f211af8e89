"""The one helper for multi-process tests: run a function on local gloo ranks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.launch import launch

__all__ = ["run_ranks"]


def run_ranks(
    tmp_path: Path, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` gloo ranks rendezvousing in ``tmp_path``; results by rank."""
    return launch(fn, world_size, *args, backend="gloo", timeout=timeout, store_dir=tmp_path)
