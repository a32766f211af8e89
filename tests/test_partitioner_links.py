"""``partitioner.measure_links``: each link's latency and bandwidth by ping-pong, the same on every
rank, every wait bounded; and what partition makes of them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from partitioner import Links, measure_links
from partitioner.links import _phases
from tests.dist import run_ranks


def _measure(size: int) -> Links:
    return measure_links(size=size, repeat=3, timeout=30.0)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_every_link(tmp_path: Path, world: int) -> None:
    results = run_ranks(tmp_path, _measure, world, 1 << 16)
    assert all(r == results[0] for r in results)  # one all-reduced answer
    links = results[0]
    assert len(links.latency) == len(links.bandwidth) == world
    assert all(0 < lat < 1.0 for lat in links.latency)  # local gloo: well under a second
    assert all(math.isfinite(bw) and bw > 1e5 for bw in links.bandwidth)


def _silent_peer(_: Any) -> str:
    import time

    import torch.distributed as dist

    from pipeline.runtime.comm.p2p import PipelineTimeout

    if dist.get_rank() == 1:
        time.sleep(3.0)  # alive, and silent past rank 0's timeout
        return "did not answer"
    try:
        measure_links(size=1 << 10, repeat=1, timeout=1.0)
    except PipelineTimeout as err:
        return str(err)
    return "no timeout"


def test_a_silent_peer_times_out_naming_the_message(tmp_path: Path) -> None:
    first, _ = run_ranks(tmp_path, _silent_peer, 2, None)
    assert "rank 0 timed out after 1.0 s waiting for link 0->1 ping-pong 8 bytes" in first


def test_pairs_take_turns() -> None:
    for p in range(2, 9):
        phases = _phases(p)
        assert sorted(pair for phase in phases for pair in phase) == [(r, (r + 1) % p) for r in range(p)]
        for phase in phases:
            ranks = [r for pair in phase for r in pair]
            assert len(ranks) == len(set(ranks)), (p, phase)  # nobody in two pairs at once
    assert _phases(1) == []


def test_needs_a_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(ValueError, match="measure_links needs an initialised process group"):
        measure_links()
