"""The balances we compare against: equal layer counts, and torchgpipe's ``balance_by_time``.

torchgpipe's ``balance_by_time`` profiles per-layer times and hands them to its
``blockpartition.solve`` (a block-partition heuristic); calling that solver on our
own per-layer costs compares the algorithms on the same numbers, not two noisy
measurements.

    # n: layers, k: stages (p * v), s: stage
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["equal_balance", "torchgpipe_balance"]


def equal_balance(n_layers: int, n_stages: int) -> list[int]:
    """As many layers on every stage as possible; the first ``n_layers % n_stages`` get one more."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"n_stages ({n_stages}) must be from 1 to the number of layers ({n_layers})")
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def torchgpipe_balance(costs: Sequence[float], n_stages: int) -> list[int]:
    """torchgpipe's block partition of ``costs`` into ``n_stages`` (needs ``pip install torchgpipe``).

    The heuristic can leave a stage empty (a 0 in the result), which no pipeline can run.
    """
    try:
        from torchgpipe.balance import blockpartition
    except ImportError as exc:
        raise ImportError(
            "torchgpipe_balance needs torchgpipe, the peer we compare against: pip install torchgpipe "
            '(it is in the "dev" extra)'
        ) from exc
    parts = blockpartition.solve(list(costs), n_stages)  # type: ignore[arg-type]  # typed List[int] there; floats work
    return [len(part) for part in parts]
