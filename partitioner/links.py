"""``measure_links``: each link's latency and bandwidth, by a short ping-pong on the group's backend.

    # p: ranks, r: rank, link r: rank r -> rank (r + 1) % p

    links = measure_links()            # on EVERY rank of the group (it is collective)
    plan = partition(model, p, sample, latency=links.latency, bandwidth=links.bandwidth)

Rank r and rank r + 1 bounce a message back and forth, first a tiny one, then a large one; the
median round trip gives::

    latency[r]   = rtt(tiny) / 2
    bandwidth[r] = size / (rtt(size) / 2 - latency[r])

The pairs take turns so that every rank is in one pair at a time (pairs from even ranks, then
from odd ranks, then the last link p - 1 -> 0 when p is odd), and the p figures reach every rank
in one all-reduce. Messages go through ``pipeline.runtime.comm.p2p.Comm``: every wait has ``timeout``
and a failure on one rank is raised on all, naming it. On NCCL the tensors live on ``device``
(default: the current CUDA device) and each round trip is timed after a device synchronise.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.runtime.comm.p2p import Comm

__all__ = ["Links", "measure_links"]

_calls = itertools.count()  # same order of calls on every rank -> same store keys


@dataclass(frozen=True)
class Links:
    """Per link r (rank r -> (r + 1) % p): ``latency`` in seconds, ``bandwidth`` in bytes per second."""

    latency: list[float]
    bandwidth: list[float]


def measure_links(
    group: Any = None,
    *,
    device: torch.device | str | None = None,
    size: int = 1 << 22,
    repeat: int = 5,
    timeout: float = 60.0,
) -> Links:
    """Latency and bandwidth of the p links of ``group`` (the default group if None); see above.

    ``size``: bytes of the large message. Raises ``ValueError`` outside an initialised group or for
    bad counts; ``PipelineTimeout`` / ``PeerFailure`` (naming the rank and the message) when a
    peer does not answer in ``timeout`` seconds or fails.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "measure_links needs an initialised process group (pipeline.launch or torchrun, then "
            "call it on every rank); without one, pass latency= and bandwidth= to partition"
        )
    for name, value, least in (("size", size, 8), ("repeat", repeat, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} ({value!r}) must be an integer >= {least}")
    comm = Comm(group, f"stagewise/links/{next(_calls)}", timeout)
    p, r = comm.world_size, comm.rank
    dev = torch.device("cpu")
    if comm.nccl:
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    try:
        mine = [0.0, 0.0]
        for phase in _phases(p):
            for first, second in phase:
                if r in (first, second):
                    got = _ping_pong(comm, first, second, dev, size, repeat)
                    if got is not None:
                        mine = got
        figures = torch.zeros(2, p, dtype=torch.float64, device=dev)
        if p > 1:
            figures[:, r] = torch.tensor(mine, dtype=torch.float64)
            comm.all_reduce(figures, dist.ReduceOp.SUM, "the links' figures (all-reduce)")
        values = figures.cpu().tolist()
    finally:
        comm.close()
    return Links(latency=[float(x) for x in values[0]], bandwidth=[float(x) for x in values[1]])


def _phases(p: int) -> list[list[tuple[int, int]]]:
    """The pairs (r, (r + 1) % p), in turns where no rank is in two pairs."""
    if p < 2:
        return []
    pairs = [(r, (r + 1) % p) for r in range(p)]
    even = [pair for pair in pairs if pair[0] % 2 == 0 and not (p % 2 == 1 and pair[0] == p - 1)]
    odd = [pair for pair in pairs if pair[0] % 2 == 1]
    wrap = [pair for pair in pairs if p % 2 == 1 and pair[0] == p - 1]
    return [phase for phase in (even, odd, wrap) if phase]


def _ping_pong(
    comm: Comm, first: int, second: int, dev: torch.device, size: int, repeat: int
) -> list[float] | None:
    """Bounce messages between ``first`` and ``second``; ``first`` returns [latency, bandwidth]."""
    me, peer = comm.rank, (second if comm.rank == first else first)
    rtts = {}
    for nbytes in (8, size):
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        times = []
        for rep in range(repeat + 1):  # the first round sets the connection up
            start = time.perf_counter()
            for sender in (first, second):
                what = f"link {first}->{second} ping-pong {nbytes} bytes, round {rep}, from rank {sender}"
                if me == sender:
                    comm.wait(comm.post([([buf], peer)], [], what)[0], what)
                else:
                    comm.wait(comm.post([], [([buf], peer)], what)[0], what)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if rep > 0:
                times.append(time.perf_counter() - start)
        rtts[nbytes] = statistics.median(times)
    if me != first:
        return None
    latency = rtts[8] / 2
    one_way = rtts[size] / 2 - latency
    return [latency, size / (one_way if one_way > 0 else rtts[size] / 2)]
