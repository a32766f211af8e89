"""Start ranks: ``launch`` spawns local processes, ``init_distributed`` joins a ``torchrun`` job.

    results = pipeline.launch(train_fn, 4, config)   # train_fn(config) on ranks 0..3

Each spawned rank gets ``torch.distributed`` initialised through a ``FileStore``
in a fresh temporary folder (no ports to collide on), one intra-op thread on
CPU, and the usual RANK / WORLD_SIZE / LOCAL_RANK environment. The parent
watches every rank: the first exception or unexpected exit is raised at once,
naming the rank and carrying its traceback, and the other ranks are killed,
so a failure never turns into a hang.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["BACKENDS", "DistInfo", "RankError", "default_backend", "init_distributed", "launch"]

BACKENDS = ("gloo", "nccl")
_POLL_S = 0.05
_KILL_GRACE_S = 2.0
_SETTLE_S = 0.3  # how long to let a failure's echoes on other ranks arrive


class RankError(RuntimeError):
    """A rank raised or died; ``rank`` says which, the message carries its traceback."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def default_backend(world_size: int) -> str:
    """NCCL when every local rank can have its own GPU, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; use one of {BACKENDS} or None to choose automatically"
        )


def _local_device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout: float = 300.0) -> DistInfo:
    """Initialise from the environment ``torchrun`` sets; selects the local GPU for NCCL.

    Already initialised (for example by ``launch``): returns the current ranks.
    """
    _check_backend(backend)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if not dist.is_initialized() and missing:
        raise ValueError(
            f"environment variables {missing} are not set; run under torchrun "
            "(torchrun --nproc-per-node N script.py) or spawn ranks with pipeline.launch"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        world_size = int(os.environ["WORLD_SIZE"])
        backend = backend or default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        device = _local_device(backend, local_rank)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    else:
        device = _local_device(dist.get_backend(), local_rank)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _run_rank(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    timeout: float,
    threads: int | None,
    results: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size))
    try:
        if backend == "gloo":
            torch.set_num_threads(threads or 1)
        _local_device(backend, rank)
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(*args)
        # Plain pickle copies tensors into the message, so the result outlives this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop(processes: list[Any]) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 300.0,
    threads: int | None = None,
    store_dir: str | os.PathLike[str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new local processes; return their results by rank.

    ``timeout`` (seconds) bounds every collective and point-to-point wait inside
    the ranks. ``threads`` sets intra-op threads per rank on CPU (default 1, so
    that ranks do not fight over cores). ``store_dir`` holds the rendezvous
    file (default: a temporary folder removed afterwards).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    _check_backend(backend)
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise ValueError(
            f"fn and its arguments must be picklable to reach the spawned ranks ({exc}); "
            "define fn at module level (not a lambda or a local function)"
        ) from exc
    backend = backend or default_backend(world_size)
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"backend 'nccl' needs one GPU per rank: world_size {world_size}, "
            f"{torch.cuda.device_count()} GPUs visible; use backend='gloo' or fewer ranks"
        )

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    own_dir = store_dir is None
    folder = tempfile.mkdtemp(prefix="stagewise-store-") if store_dir is None else os.fspath(store_dir)
    store_path = tempfile.mktemp(prefix="store-", dir=folder)
    processes = [
        ctx.Process(
            target=_run_rank,
            args=(rank, world_size, backend, store_path, timeout, threads, results, fn, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in processes:
            proc.start()
        return _collect(processes, results)
    finally:
        _stop(processes)
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)


def _collect(processes: list[Any], results: Any) -> list[Any]:
    values: dict[int, Any] = {}
    while len(values) < len(processes):
        try:
            rank, ok, payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            if any(r not in values and p.exitcode is not None for r, p in enumerate(processes)):
                _raise_first_failure(processes, results, values, [])
            continue
        if not ok:
            _raise_first_failure(processes, results, values, [(rank, f"rank {rank} failed: {payload}")])
        values[rank] = pickle.loads(payload)
    return [values[rank] for rank in range(len(processes))]


def _raise_first_failure(
    processes: list[Any], results: Any, values: dict[int, Any], failures: list[tuple[int, str]]
) -> None:
    """Raise for the root cause: one failure usually makes its peers fail too, a moment later.

    A rank that died without a word comes first (its peers only report a lost
    connection), then exceptions in the order they arrived.
    """
    time.sleep(_SETTLE_S)
    while True:
        try:
            rank, ok, payload = results.get_nowait()
        except queue.Empty:
            break
        if ok:
            values[rank] = pickle.loads(payload)
        else:
            failures.append((rank, f"rank {rank} failed: {payload}"))
    reported = {rank for rank, _ in failures} | set(values)
    dead = [
        (
            rank,
            f"rank {rank} exited with code {proc.exitcode} before returning a result "
            "(killed, os._exit, or a crash in native code)",
        )
        for rank, proc in enumerate(processes)
        if rank not in reported and proc.exitcode is not None
    ]
    ordered = dead + failures
    rank, message = ordered[0]
    others = "".join(f"\n\nthen {m.splitlines()[0]}" for _, m in ordered[1:])
    raise RankError(rank, message + others)
