"""The recompute modes' rules as plain data (see pipeline/runtime/step/recompute.py for what they mean):
read by the memory walk (peaks.py) and the runtime alike, so the schedules' layer needs no runtime."""

from __future__ import annotations

__all__ = ["RECOMPUTE_MODES", "check_mode", "recomputes"]

RECOMPUTE_MODES = ("never", "except_last", "always")


def check_mode(mode: str) -> str:
    """``mode`` if it is one of RECOMPUTE_MODES, else a ValueError naming them."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; use one of {', '.join(RECOMPUTE_MODES)}")
    return mode


def recomputes(mode: str, microbatch: int, n_microbatches: int) -> bool:
    """True when micro-batch ``microbatch`` recomputes its forward under ``mode``."""
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch < n_microbatches - 1
    return False
