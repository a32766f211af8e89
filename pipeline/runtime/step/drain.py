"""A device-wide synchronisation forced in the middle of a step: proof that none can hang it.

    STAGEWISE_DRAIN_AT=R:K        pipeline rank R, as its host queues its compute K (0-based, in
                                  its program's order), at every step
    STAGEWISE_DRAIN_AT=R:*        rank R at each of its computes
    STAGEWISE_DRAIN_AT=turns      rank t % p at each of its computes, at step t: p steps hold
                                  every rank at every compute
    STAGEWISE_DRAIN_AT=random:S   one (rank, compute) per step, drawn from the seed S and the step's
                                  number (every rank draws the same)

On a GPU two ordinary things hold a host in a device-wide synchronisation while it queues a
compute: the caching allocator's retry after a failed cudaMalloc (cudaFree synchronises the
device) and a kernel's first launch under lazy module loading. The host then waits until every
kernel already queued is done, the receives it posted included, and posts nothing meanwhile. Here
the executor does the same on purpose, right after queuing the chosen compute: it blocks until
every transfer it has posted is complete (and, on a GPU, the compute queued), with the pipeline's
timeout and failure watch, so a program that breaks the rule (program.py's, which ``validate``
proves) fails with the transfer named instead of hanging. Under the NCCL emulation (emulation.py)
this is how CPU tests hold the real NCCL code path to the rule; gpu_check runs it on hardware.

One rank drains at a time (a fixed R, or one drawn per step): the rule is about one rank's sync
while the others run on. Two ranks synchronising at once can each wait for the other's host,
whatever the program: a peer's send that the other waits for may be exactly what its own host is
held before (as in every schedule that posts point-to-point from the host, torch's included).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

__all__ = ["ENV", "DrainAt", "drain_at"]

ENV = "STAGEWISE_DRAIN_AT"

# (step number, this rank's compute index) -> whether this rank drains right after queuing it
DrainAt = Callable[[int, int], bool]


def drain_at(
    rank: int, computes: list[int], value: str | None = None, training: bool = True
) -> DrainAt | None:
    """Where rank ``rank`` drains, from ``value`` (default: the environment's ``STAGEWISE_DRAIN_AT``);
    ``computes``: each rank's number of computes per step. None when it is unset. ``R:K`` names a
    training step's compute: a forward-only program (evaluate, predict) with fewer drains at none
    past its end rather than refuse what the training step takes."""
    text = (os.environ.get(ENV, "") if value is None else value).strip()
    if not text:
        return None
    p = len(computes)
    if text == "turns":
        return lambda step, k: step % p == rank
    head, _, tail = text.partition(":")
    if head == "random" and tail.lstrip("-").isdigit():
        seed = int(tail)

        def drawn(step: int, k: int) -> bool:
            rng = random.Random(seed * 1_000_003 + step)
            r = rng.randrange(p)
            return r == rank and k == rng.randrange(max(computes[r], 1))

        return drawn
    if head.isdigit() and 0 <= int(head) < p and (tail == "*" or tail.isdigit()):
        if int(head) != rank:
            return lambda step, k: False
        if tail == "*":
            return lambda step, k: True
        at = int(tail)
        if at >= computes[rank] and training:
            raise ValueError(
                f"{ENV}={text!r}: rank {rank} runs {computes[rank]} computes per step (0 to "
                f"{computes[rank] - 1}), so it never reaches compute {at}; name one of those"
            )
        return lambda step, k: k == at
    raise ValueError(
        f"{ENV}={text!r} is not one of 'R:K' (pipeline rank R drains at its compute K), 'R:*' (at "
        f"each of its computes), 'turns' or 'random:SEED', with R in [0, {p}); unset it to run "
        "without draining"
    )
