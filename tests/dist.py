"""The helpers for multi-process tests: run a function on local ranks (gloo by default), alone or batched.

Spawning ranks is most of a multi-process test's time (each rank imports torch), so test modules
declare their rank functions as jobs, and one launch per (world size, batch) runs the jobs of every
collected module in turn, each under its own backend's environment, and hands each module its own
per-rank results:

    _JOB = job(4, _matrix, timeout=120.0)          # at import: registered, nothing runs yet
    results = _JOB.results(tmp_path_factory)       # in a fixture: the first one runs the batch

    launch of 4 ranks, batch "a":   job 1 | job 2 | ... | job n | last job     (one process group)
        each rank, each job:  backend's environment, fresh RNG state -> fn(*args) -> result or error
                              -> all ranks agree it went well, else the rest of the batch is skipped
                              -> collect garbage until the job's threads are gone

A job that failed or was skipped in the batch runs again alone (a launch of its own), so its error
is exactly what it would be without batching, and a failure never spreads to other modules' results.
A job whose pipeline fails on purpose (its watchdog then closes the group's connections) is the
batch's ``last``; one that makes groups of some of the ranks only (tied weights over a subset:
dist.new_group with local synchronization) gets a batch of its own.

Under pytest-xdist (the suite's two workers) a batch runs on the worker of the test that first asks
for it, with the jobs of every collected module of the batch: those modules are one xdist group
(``worker_groups``), so that this worker runs all of their tests and each batch runs once.

The test that first asks for a batch runs all of it inside its own pytest-timeout, so batches are
kept small: about 25 s each on 2 quiet cores (``--durations`` prints every job's time), the same as
the slowest single tests, far inside the 240 s hang guard even on a loaded machine.
"""

from __future__ import annotations

import gc
import os
import pickle
import random
import socket
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.launch import launch
from pipeline.runtime.comm.emulation import ENV as EMULATE_NCCL_ENV
from pipeline.runtime.comm.watchdog import CHECK_STORE_S

__all__ = ["Job", "free_port", "job", "job_times", "run_ranks", "select_jobs", "worker_groups"]

_STILL_S = 2 * CHECK_STORE_S  # no thread stopped for this long: the rest never will
_SETTLE_S = 0.5  # how long a rank waits for a finished job's watchdog threads to stop (a Pipeline never
# closed keeps its watchdog thread, idle, until exit: waiting longer for those buys nothing)


_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PORT = 10000


def free_port() -> int:
    """A loopback port nobody listens on, for a store or rendezvous a test's processes bind later.

    A port the OS picks (bind to 0) and the test then releases is an ephemeral one, which the kernel
    hands to the next process that binds to 0 or connects out (every gloo pair does both), so the
    job's own bind can find it taken, or a rank can reach a stranger's listener. This picks at random
    below the ephemeral range, where the kernel gives out nothing: only another explicit pick could
    take it, one in thousands.
    """
    try:
        with open(_EPHEMERAL) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(100):
        port = random.SystemRandom().randrange(_LOWEST_PORT, low) if low > _LOWEST_PORT + 1000 else 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError(f"no free loopback port below {low} after 100 tries")


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
    return launch(
        fn, world_size, *args, backend=backend, timeout=timeout, store_dir=tmp_path, start_method="forkserver"
    )


@dataclass(eq=False)
class Job:
    """``fn(*args)`` on ``world_size`` ranks, run in its batch's launch (see the module docstring)."""

    world_size: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    backend: str  # "gloo" or "nccl-emulated"
    timeout: float  # the process group's, as run_ranks(timeout=) when run alone
    batch: str
    # makes the args in the parent when the batch runs (a folder from the factory, a plan), kept in args
    make_args: Callable[[pytest.TempPathFactory], tuple[Any, ...]] | None = None
    # after the other jobs: it leaves a failed pipeline behind, whose watchdog may have closed the
    # connections of its group (the world's, in a launch): at most one such job per batch
    last: bool = False
    outcome: tuple[bool, Any] | None = field(default=None, repr=False)  # (ok, per-rank results or error)
    seconds: tuple[float, float] | None = None  # in its batch: (wall, CPU) of its slowest rank

    @property
    def module(self) -> str:
        return self.fn.__module__

    def results(self, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
        """Every rank's result, running the batch (or, after a failure there, this job alone) first."""
        if self.outcome is None:
            _run_batch(self, tmp_path_factory)
        assert self.outcome is not None
        ok, value = self.outcome
        if not ok:
            raise value
        return list(value)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.fn.__name__}"

    def spec(
        self, tmp_path_factory: pytest.TempPathFactory
    ) -> tuple[str, Callable[..., Any], tuple[Any, ...], str]:
        """What a rank runs; made args are made anew each time (a second run gets fresh folders)."""
        if self.make_args is not None:
            self.args = self.make_args(tmp_path_factory)
        return self.name, self.fn, self.args, self.backend


_jobs: list[Job] = []
_selected: set[str] | None = None  # modules with collected tests (None: every module)


def job(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    batch: str = "a",
    make_args: Callable[[pytest.TempPathFactory], tuple[Any, ...]] | None = None,
    last: bool = False,
) -> Job:
    """Register ``fn(*args)`` (module level, picklable) for the launch of ``world_size`` ranks of
    ``batch``. Jobs run in the order they were registered, those with ``last`` after the others;
    ``make_args(tmp_path_factory)`` makes the arguments in the parent when the batch runs (then
    ``Job.args``)."""
    if backend not in ("gloo", "nccl-emulated"):
        raise ValueError(f"backend must be 'gloo' or 'nccl-emulated', got {backend!r}")
    if last and any(j.last and (j.world_size, j.batch) == (world_size, batch) for j in _jobs):
        raise ValueError(f"the launch of {world_size} ranks, batch {batch!r}, has its last job already")
    made = Job(world_size, fn, args, backend, timeout, batch, make_args, last)
    _jobs.append(made)
    return made


def select_jobs(modules: set[str]) -> None:
    """Batches run only the jobs of these modules (conftest: the modules of the collected tests)."""
    global _selected
    _selected = set(modules)


def worker_groups(modules: set[str]) -> dict[str, str]:
    """Each module's group for pytest-xdist (``--dist loadgroup``): modules with jobs in one batch
    share a group, so that the batch runs once, on the worker that runs all of their tests (a batch
    runs where its first test asks for it, with the jobs of every selected module)."""
    parent = {m: m for m in sorted(modules)}

    def root(m: str) -> str:
        while parent[m] != m:
            m = parent[m]
        return m

    batches: dict[tuple[int, str], list[str]] = {}
    for j in _jobs:
        if j.module in parent:
            batches.setdefault((j.world_size, j.batch), []).append(j.module)
    for members in batches.values():
        for m in members[1:]:
            a, b = sorted((root(members[0]), root(m)))
            parent[b] = a  # the smaller name is the root: the same groups in every worker
    return {m: root(m) for m in parent}


def _run_batch(wanted: Job, tmp_path_factory: pytest.TempPathFactory) -> None:
    batch = [
        j
        for j in sorted(_jobs, key=lambda j: j.last)  # stable: registration order otherwise
        if (j.world_size, j.batch) == (wanted.world_size, wanted.batch)
        and j.outcome is None
        and (j is wanted or _selected is None or j.module in _selected)
    ]
    specs = []
    for j in list(batch):
        try:
            specs.append(j.spec(tmp_path_factory))
        except Exception as exc:  # its arguments could not be made (a job it depends on failed)
            j.outcome = (False, exc)
            batch.remove(j)
    if not batch:
        return
    folder = tmp_path_factory.mktemp(f"batch{wanted.world_size}-{wanted.batch}")
    try:
        timeout = max(j.timeout for j in batch)
        per_rank = run_ranks(folder, _run_jobs, wanted.world_size, specs, timeout=timeout)
    except Exception as exc:  # the launch itself failed: every job runs alone, raising its own error
        warnings.warn(
            f"the batch of {[j.name for j in batch]} failed ({exc}); running each alone", stacklevel=2
        )
        per_rank = [[("skipped", None, 0.0, 0.0)] * len(batch)]
    why: dict[Job, str] = {}
    for k, j in enumerate(batch):
        statuses = [rank[k] for rank in per_rank]
        j.seconds = max(s[2] for s in statuses), max(s[3] for s in statuses)
        if all(s[0] == "ok" for s in statuses):
            j.outcome = (True, [pickle.loads(s[1]) for s in statuses])
        else:
            why[j] = next(
                (f"rank {r}: {s[1]}" for r, s in enumerate(statuses) if s[0] == "failed"), "skipped"
            )
    for j in batch:
        if j.outcome is None:  # failed or skipped in the batch: alone, as it would run without batching
            _run_alone(j, tmp_path_factory, why[j])


def _run_alone(j: Job, tmp_path_factory: pytest.TempPathFactory, why: str) -> None:
    try:
        name, fn, args, backend = j.spec(tmp_path_factory)
        j.outcome = (True, run_ranks(tmp_path_factory.mktemp("alone"), fn, j.world_size, *args,
                                     timeout=j.timeout, backend=backend))  # fmt: skip
    except Exception as exc:
        j.outcome = (False, exc)
        return
    warnings.warn(
        f"{name} failed or was skipped in its batch but passed alone; in the batch: {why}", stacklevel=2
    )


def _run_jobs(
    specs: list[tuple[str, Callable[..., Any], tuple[Any, ...], str]],
) -> list[tuple[str, Any, float, float]]:
    """In every rank: each job under its backend's environment, from the RNG state of a fresh process;
    once one fails on any rank, the others are skipped (the group may hold its leftovers)."""
    import torch.distributed as dist

    control = dist.new_group(backend="gloo")  # the runner's own agreements: no job's collective in between
    fresh_rng = torch.get_rng_state()
    threads = threading.active_count()
    out: list[tuple[str, Any, float, float]] = []  # (status, result or traceback, wall s, CPU s)
    healthy = True
    for _name, fn, args, backend in specs:
        if not healthy:
            out.append(("skipped", None, 0.0, 0.0))
            continue
        if backend == "nccl-emulated":
            os.environ[EMULATE_NCCL_ENV] = "1"
        else:
            os.environ.pop(EMULATE_NCCL_ENV, None)
        torch.set_rng_state(fresh_rng)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            status, value = "ok", pickle.dumps(fn(*args))
        except BaseException:  # reported to the parent, which runs the job alone
            status, value = "failed", traceback.format_exc()
        out.append((status, value, time.perf_counter() - wall, time.process_time() - cpu))
        verdicts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, out[-1][0], group=control)
        healthy = all(v == "ok" for v in verdicts)
        gc.collect()  # what a job's own reference cycles hold (its Pipelines, their watchdog threads)
        _settle(threads)
    os.environ.pop(EMULATE_NCCL_ENV, None)
    return out


def _settle(threads: int) -> None:
    """Wait for the watchdog threads of a finished job's collected Pipelines to stop: until only
    ``threads`` are left, or none has stopped for two of a watchdog's periods (the rest belong to
    Pipelines never closed, idle until exit), at most ``_SETTLE_S``."""
    deadline = time.monotonic() + _SETTLE_S
    left, still_since = threading.active_count(), time.monotonic()
    while left > threads and time.monotonic() < deadline and time.monotonic() - still_since < _STILL_S:
        time.sleep(0.01)
        now = threading.active_count()
        if now < left:
            left, still_since = now, time.monotonic()


def job_times() -> list[str]:
    """One line per job that ran in a batch: its batch, the (wall, CPU) seconds of its slowest rank."""
    ran = [j for j in _jobs if j.seconds is not None]
    return [
        f"{j.seconds[0]:7.2f}s wall {j.seconds[1]:7.2f}s cpu  {j.world_size} ranks {j.batch:6} {j.name}"
        for j in sorted(ran, key=lambda j: (j.world_size, j.batch))
        if j.seconds is not None
    ]
