"""Joining a job from the environment (torchrun, or MASTER_ADDR / MASTER_PORT set by hand).

    # r: this rank, p: ranks (WORLD_SIZE)

A store per attempt. torchrun's agent serves one TCPStore for the job and all
its restarts (TORCHELASTIC_USE_AGENT_STORE=True). ``init_process_group``
("env://") keys it without the attempt, so after a worker is killed the
restarted workers read the addresses that the previous attempt's workers
published, and gloo connects to ports where nobody listens any more: it
retries, fails, or, when a stale port answers, waits out the whole timeout
(ten minutes with timeout=600). The pipeline's own keys would be stale too: a
failure published by attempt n-1 would fail attempt n at its first wait. So
every key of attempt n lives under ``stagewise/attempt<n>/``
(TORCHELASTIC_RESTART_COUNT; 0 without torchrun)::

    the agent's TCPStore
      default_pg/0//cpu/rank_1          attempt 0's dead address (plain env://)
      stagewise/attempt1/default_pg/..  attempt 1's gloo addresses, the pipeline's keys
      stagewise/attempt1/joined/<r>     attempt 1's ranks that have arrived

Every wait of start-up is bounded by ``timeout`` and names what it waited for:

    the store            the TCPStore client's connect (who serves it: rank 0, or torchrun's agent)
    every rank joined    the ``joined/<r>`` keys; the error lists the ranks that never came
    the full mesh        gloo's connect in ``init_process_group``, once all have joined
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from pipeline.runtime.comm.watchdog import quiet_store

__all__ = ["StartupError", "attempt", "bounded", "join"]

_POLL_S = 0.01


class StartupError(RuntimeError):
    """A rank could not join the job within the timeout; the message says what it waited for."""


def attempt() -> int:
    """This start's number under torchrun (TORCHELASTIC_RESTART_COUNT), 0 otherwise."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


@contextlib.contextmanager
def bounded(rank: int, what: str, timeout: float) -> Iterator[None]:
    """Turn a start-up wait's failure into one ``StartupError`` naming the rank and ``what``."""
    start = time.monotonic()
    try:
        yield
    except StartupError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise StartupError(
            f"rank {rank} (attempt {attempt()}) gave up after {time.monotonic() - start:.1f} s "
            f"(timeout {timeout:g} s) waiting for {what}: {first}"
        ) from None


def join(rank: int, world_size: int, timeout: float) -> Any:
    """This attempt's store (a prefix of the job's TCPStore), once every rank has reached it."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves it
    server = "torchrun's agent" if agent else "rank 0"
    td = datetime.timedelta(seconds=timeout)
    with bounded(rank, f"the store at {host}:{port} (served by {server})", timeout):
        base = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, world_size, is_master=rank == 0 and not agent, timeout=td,
            wait_for_workers=False, multi_tenant=True,
        )  # fmt: skip
    store = dist.PrefixStore(f"stagewise/attempt{attempt()}", base)  # type: ignore[attr-defined]
    # quiet: rank 0 dying now takes the store along, and torch would print each failed call's C++ frames
    with bounded(rank, f"the store at {host}:{port} (served by {server})", timeout):
        with quiet_store():
            store.set(f"joined/{rank}", str(os.getpid()))
        deadline = time.monotonic() + timeout
        missing = list(range(world_size))
        while True:
            with quiet_store():
                missing = [q for q in missing if not store.check([f"joined/{q}"])]
            if not missing:
                return store
            if time.monotonic() > deadline:
                raise StartupError(
                    f"rank {rank} (attempt {attempt()}) waited {timeout:g} s for ranks {missing} of "
                    f"{world_size} to join; start them (the same WORLD_SIZE, MASTER_ADDR and "
                    "MASTER_PORT), or check that they reach init_distributed"
                )
            time.sleep(_POLL_S)
