"""Where stage s of a pipeline over p ranks lives: the one statement of the rule (a schedule's
``placement``; ``Schedule.rank_of``, the generators, the partitioner and the runtime all read it).

    # p: ranks, s: stage, c = s // p: its chunk, j = s % p

    "loop"  stage s on rank s % p: rank r holds r, r + p, r + 2p, ...   (p = 3: 0 1 2 0 1 2)
    "v"     chunk c runs down the ranks for even c, back up for odd c:   (p = 3: 0 1 2 2 1 0)
            with 2 stages per rank (zb-v) rank r holds r and 2p - 1 - r
"""

from __future__ import annotations

__all__ = ["PLACEMENTS", "check_placement", "rank_of"]

PLACEMENTS: tuple[str, ...] = ("loop", "v")


def rank_of(placement: str, p: int, s: int) -> int:
    """The rank of stage ``s`` of a pipeline over ``p`` ranks under ``placement`` (the one rule):
    "loop": s % p; "v": chunk c = s // p runs down the ranks for even c, back up for odd c."""
    if placement == "loop":
        return s % p
    if placement == "v":
        c, j = divmod(s, p)
        return j if c % 2 == 0 else p - 1 - j
    raise ValueError(_unknown(placement))


def check_placement(placement: str) -> None:
    """A ValueError naming ``placement`` unless it is one of ``PLACEMENTS``."""
    if placement not in PLACEMENTS:
        raise ValueError(_unknown(placement))


def _unknown(placement: object) -> str:
    return f"unknown placement {placement!r}; valid placements are {', '.join(PLACEMENTS)}"
