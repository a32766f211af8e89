"""The schedules by name: one entry each, which ``schedule()``, the auto search and the scripts read.

    # p: ranks, v: stages per rank, m: micro-batches

An entry holds everything that differs between schedules: its generator ((p, v, m) -> each rank's
ordered compute actions), whether its backward is split (B, then W), the v it takes (one stage per
rank, or several), whether m must be a multiple of p and where the stages live (the placement:
stage s on rank s % p, or the V of zb-v, dualpipe-v, v-half and v-min). Nothing else names a
schedule, so adding one is an entry here plus its generator:

    REGISTRY["gpipe"] ----> schedule("gpipe", p, m)          build + validate
                      \\---> schedule_options(...)            the one check of (v, m)
                       \\--> partition(schedule="auto")       which v to try, split or not
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.schedules import generators
from pipeline.schedules.actions import Action

__all__ = ["REGISTRY", "Entry", "entry"]

Orders = tuple[tuple[Action, ...], ...]


@dataclass(frozen=True)
class Entry:
    """One schedule: ``generate(p, v, m)``, and the options it accepts."""

    name: str
    generate: Callable[[int, int, int], Orders]
    split_backward: bool  # B is the input-gradient part only; every (s, i) also has a W
    min_virtual: int = 1  # stages per rank: at least ...
    max_virtual: int | None = 1  # ... and at most (None: no bound)
    m_multiple_of_p: bool = False
    placement: str = "loop"  # where stage s lives (schedule.rank_of): "loop" s % p, or "v"

    @property
    def default_virtual(self) -> int:
        return self.min_virtual

    def virtual_counts(self, most: int) -> list[int]:
        """The v it takes, up to ``most`` (the search's bound: layers per rank)."""
        top = most if self.max_virtual is None else min(most, self.max_virtual)
        return list(range(self.min_virtual, top + 1))

    def takes_virtual(self, v: int) -> bool:
        return v >= self.min_virtual and (self.max_virtual is None or v <= self.max_virtual)


_ENTRIES = (
    Entry("gpipe", lambda p, v, m: generators.gpipe(p, m), False),  # all F, then all B
    Entry("1f1b", lambda p, v, m: generators.one_f_one_b(p, m), False),  # at most p micro-batches held
    Entry("interleaved-1f1b", generators.interleaved_1f1b, False, min_virtual=2, max_virtual=None,
          m_multiple_of_p=True),  # 1f1b over v stages per rank: a bubble v times smaller
    Entry("zb-h1", lambda p, v, m: generators.zb_h1(p, m), True),  # split backward, W fills the bubble
    Entry("interleaved-zb", generators.interleaved_zb, True, min_virtual=2, max_virtual=None,
          m_multiple_of_p=True),  # interleaved-1f1b with zb-h1's split backward
    Entry("zb-v", generators.zb_v, True, min_virtual=2, max_virtual=2,
          placement="v"),  # two stages per rank in a V, split backward: near-zero bubble
    Entry("dualpipe-v", generators.dualpipe_v, True, min_virtual=2, max_virtual=2,
          placement="v"),  # DeepSeek's DualPipe in a V (torch's ScheduleDualPipeV); its order for m >= 2p
    Entry("v-half", generators.v_half, True, min_virtual=2, max_virtual=2,
          placement="v"),  # controllable memory: (p + 2) // 2 micro-batches held, about half 1F1B's bubble
    Entry("v-min", generators.v_min, True, min_virtual=2, max_virtual=2,
          placement="v"),  # controllable memory: (p + 4) // 3 micro-batches held, about 2/3 1F1B's bubble
)  # fmt: skip
REGISTRY: dict[str, Entry] = {e.name: e for e in _ENTRIES}


def entry(name: str) -> Entry:
    """The registered schedule ``name``; an unknown name gets the list of valid ones."""
    found = REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown schedule {name!r}; valid schedules are {', '.join(REGISTRY)}")
    return found
