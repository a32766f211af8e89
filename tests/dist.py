"""The one helper for multi-process tests: run a function on local ranks (gloo by default)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.launch import launch

__all__ = ["run_ranks"]


def run_ranks(
    tmp_path: Path,
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str | None = "gloo",
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks rendezvousing in ``tmp_path``; results by rank.

    ``backend``: "gloo" (default), "nccl-emulated" (gloo with STAGEWISE_EMULATE_NCCL=1
    in every rank), or None (what ``launch`` picks from the environment).
    """
    return launch(fn, world_size, *args, backend=backend, timeout=timeout, store_dir=tmp_path)
