"""Start ranks: ``launch`` spawns local processes, ``init_distributed`` joins a ``torchrun`` job.

    results = pipeline.launch(train_fn, 4, config)   # train_fn(config) on ranks r = 0..3

Each spawned rank gets ``torch.distributed`` initialised through a ``FileStore``
in a fresh temporary folder (no ports to collide on), one intra-op thread on
CPU, and the usual RANK / WORLD_SIZE / LOCAL_RANK environment. The parent
watches every rank: the first exception or unexpected exit is raised at once,
naming the rank and carrying its traceback, and the other ranks are killed,
so a failure never turns into a hang.

Backends (``backend=`` of both functions):

    None             "gloo", unless the environment sets STAGEWISE_EMULATE_NCCL=1
                     ("nccl-emulated"); never chosen from the GPUs present, so a
                     CPU run on a GPU host does not touch CUDA
    "gloo"           CPU tensors; clears STAGEWISE_EMULATE_NCCL in the ranks
    "nccl"           one CUDA device per local rank (a ValueError when too few)
    "nccl-emulated"  a gloo group, with STAGEWISE_EMULATE_NCCL=1 set in every rank
                     before ``fn`` runs: the runtime then takes its NCCL code path,
                     checked on CPU. Under torchrun, export STAGEWISE_EMULATE_NCCL=1
                     yourself (or pass backend="nccl-emulated" to init_distributed).

The ranks never outlive the parent. Each rank asks the kernel for SIGKILL
when its parent dies (``prctl(PR_SET_PDEATHSIG)`` on Linux; a thread that
watches the parent's pid elsewhere, and as a fallback), so that SIGKILL of the
parent (an OOM kill, ``kill -9``) ends them. SIGTERM of the parent (what
``timeout`` and job schedulers send) and Ctrl-C stop the ranks and exit with
one line and the usual status (143, 130), without a traceback: the ranks
ignore SIGINT (the parent decides for them) and report nothing of it.

Under torchrun (``init_distributed``) see startup.py: a store per restart,
so that a restart never reads the keys of the attempt before it, and start-up
waits that name what they waited for.

Ranks are started with multiprocessing's "spawn" by default: each one imports
torch and the caller's main module again before running ``fn`` (seconds per
launch). ``start_method="forkserver"`` forks them instead from a server
process that imported torch and this package once (the first launch starts
it): a launch then starts its ranks in milliseconds, for programs (a test
suite, a notebook) that launch many times. Modules appended to
``FORKSERVER_PRELOAD`` before that first launch are imported by the server too:
a rank whose ``fn`` or arguments live in them then does not import them again.
Each rank still gets the caller's environment and standard output and error
as they are at the launch (not the server's, which are the caller's when the
server started), and SIGINT ignored, as under spawn, and ends with the caller
(it watches the caller's pid itself: its parent is the server). Under both,
each rank imports the caller's main module again before running ``fn``. A script whose
``launch(...)`` call is not under ``if __name__ == "__main__":`` would launch
again from every rank; the rank notices (its process is a launched rank that
has not started ``fn`` yet), exits with a reserved code, and the parent raises
one error that says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import multiprocessing
import multiprocessing.reduction
import os
import pickle
import queue
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline import startup
from pipeline.runtime.comm import emulation
from pipeline.runtime.comm.arrival import CREATION_EXIT
from pipeline.runtime.comm.emulation import ENV as EMULATE_NCCL_ENV  # "1": the runtime emulates NCCL on gloo
from pipeline.runtime.comm.watchdog import process_alive

__all__ = [
    "BACKENDS",
    "CPU_THREADS",
    "EMULATE_NCCL_ENV",
    "FORKSERVER_PRELOAD",
    "DistInfo",
    "RankError",
    "default_backend",
    "init_distributed",
    "launch",
]

BACKENDS = ("gloo", "nccl", "nccl-emulated")
CPU_THREADS = 1  # intra-op threads per rank on CPU unless launch(threads=) says (ranks share the cores)
_POLL_S = 0.05
_KILL_GRACE_S = 2.0
_SETTLE_S = 0.3  # how long to let a failure's echoes on other ranks arrive
_RANK_NAME = "stagewise-rank-"  # process-name prefix of the ranks launch starts
_START_METHODS = ("spawn", "forkserver")
# what the fork server imports when it starts (the first forkserver launch); a program may add its own
# modules before that, so that its ranks find them imported instead of importing them each
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "pipeline.launch",
    "pipeline.runtime.pipe",
    # what a first step imports to infer its stages' shapes on fake tensors (stage.infer): about 900
    # modules (dynamo, sympy), a second of CPU per rank otherwise
    "torch._subclasses.fake_tensor",
    "torch.fx.experimental.symbolic_shapes",
    "torch._dynamo",
]
_EXIT_UNGUARDED_MAIN = 87  # a rank's exit code when its import of the main module called launch
_rank_started = False  # set in a rank once its fn may run: launch() from inside fn is deliberate
_PARENT_POLL_S = 0.2  # how often a rank's fallback thread checks that its parent lives
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
    backend: str  # one of BACKENDS


def default_backend() -> str:
    """``backend=None``: "nccl-emulated" when STAGEWISE_EMULATE_NCCL=1, else "gloo" (never probes CUDA)."""
    return "nccl-emulated" if emulation.enabled() else "gloo"


def _check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; use one of {BACKENDS} or None (gloo, or nccl-emulated "
            f"when {EMULATE_NCCL_ENV}=1)"
        )


def _group_backend(backend: str) -> str:
    """The torch.distributed backend behind one of ours."""
    return "nccl" if backend == "nccl" else "gloo"


# NCCL's watchdog, on an error or a timeout, aborts the communicators without killing the process
# (mode 2; torch's default 3 SIGABRTs it), so that the pipeline's own waits raise and name the failed
# rank and action; a user's setting wins
_NCCL_ERRORS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def _set_backend_env(backend: str) -> None:
    if backend == "nccl":
        os.environ.setdefault(*_NCCL_ERRORS)
    if backend == "nccl-emulated":
        os.environ[EMULATE_NCCL_ENV] = "1"
    else:
        os.environ.pop(EMULATE_NCCL_ENV, None)


def _local_device(backend: str, local_rank: int) -> torch.device:
    """This rank's device; only "nccl" touches CUDA."""
    if backend != "nccl":
        return torch.device("cpu")
    if torch.cuda.device_count() <= local_rank:
        raise ValueError(
            f"backend 'nccl' needs one GPU per local rank: local rank {local_rank}, "
            f"{torch.cuda.device_count()} GPUs visible; use backend='gloo' or fewer ranks per node"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(backend: str | None = None, timeout: float = 300.0) -> DistInfo:
    """Initialise from the environment ``torchrun`` sets; selects the local GPU for NCCL.

    Already initialised (for example by ``launch``): returns the current ranks,
    and refuses a ``backend`` that contradicts the running group.
    """
    _check_backend(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        running = dist.get_backend()
        if backend is not None and _group_backend(backend) != running:
            raise ValueError(
                f"init_distributed(backend={backend!r}) but the process group already runs {running!r}; "
                "pass backend=None, or the backend the ranks were started with"
            )
        chosen = backend or ("nccl" if running == "nccl" else default_backend())
        _set_backend_env(chosen)
        return DistInfo(
            dist.get_rank(), dist.get_world_size(), local_rank, _local_device(chosen, local_rank), chosen
        )
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(
            f"environment variables {missing} are not set; run under torchrun "
            "(torchrun --nproc-per-node N script.py) or spawn ranks with pipeline.launch"
        )
    chosen = backend or default_backend()
    device = _local_device(chosen, local_rank)
    _set_backend_env(chosen)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = startup.join(rank, world_size, timeout)
    td = datetime.timedelta(seconds=timeout)
    with startup.bounded(rank, "every rank's connection to every other (init_process_group)", timeout):
        dist.init_process_group(
            _group_backend(chosen), store=store, rank=rank, world_size=world_size, timeout=td
        )
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, chosen)


def _die_with_parent(parent: int, forked: bool) -> None:
    """SIGKILL this rank when ``parent`` (the launching process) dies: the kernel's parent-death
    signal on Linux, and a thread that watches the parent's pid (the only guard elsewhere; on Linux
    it covers the moment before prctl, when the parent may have died already). A rank forked from
    the server is the server's child, and the server lives while any of its children holds its
    "alive" pipe (every rank does): its thread watches the launcher itself."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    watch = _watch_launcher if forked else _watch_parent
    threading.Thread(target=watch, args=(parent,), name="stagewise-parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:  # an orphan is re-parented (to init or a subreaper)
        time.sleep(_PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_launcher(launcher: int) -> None:
    """Until ``launcher``, not this process's parent, has ended (a pidfd turns readable then, a
    zombie included; without pidfds, until it is gone or a zombie)."""
    try:
        fd = os.pidfd_open(launcher)
    except ProcessLookupError:
        pass  # gone already
    except (AttributeError, OSError):  # no pidfd here: poll the pid
        while process_alive(launcher):
            time.sleep(_PARENT_POLL_S)
    else:
        select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def _run_rank(
    parent: int,
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    timeout: float,
    threads: int | None,
    results: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    caller_env: dict[str, str] | None = None,
    caller_streams: tuple[int | None, int | None] = (None, None),
) -> None:
    global _rank_started
    _rank_started = True
    gc.freeze()  # the inherited heap (torch's modules): never scanned again by this rank's collections
    if caller_env is not None:  # forked from the server: its environment and SIGINT are not the caller's
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.environ.clear()
        os.environ.update(caller_env)
    for fd, own in zip(caller_streams, (1, 2), strict=True):  # nor its stdout and stderr (_CallerStream)
        if fd is not None:
            os.dup2(fd, own)
            os.close(fd)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # spawned: blocked as the parent was
    _die_with_parent(parent, forked=caller_env is not None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size))
    _set_backend_env(backend)
    try:
        if _group_backend(backend) == "gloo":
            torch.set_num_threads(threads or CPU_THREADS)
        _local_device(backend, rank)
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
        with startup.bounded(rank, f"the other ranks to connect (init_process_group, {store_path})", timeout):
            dist.init_process_group(
                _group_backend(backend),
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
            # every rank has finished connecting before any may return and close its sockets: gloo's
            # full-mesh connect of a slow peer fails if a fast rank finishes fn and exits first
            dist.barrier()
        value = fn(*args)
        # Plain pickle copies tensors into the message, so the result outlives this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _CallerStream:
    """One of the caller's standard streams, for a rank forked from the server: pickled (as the rank
    starts) into a duplicate of its descriptor that the rank receives, so that what the rank prints
    goes where the caller's prints go now, as a spawned rank's do, not to the server's streams."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_received_fd, (multiprocessing.reduction.DupFd(self.fd),))


def _received_fd(duplicate: Any) -> int:
    return int(duplicate.detach())


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # closed (a daemon's): the rank keeps the server's
        return False
    return True


def _reimported_by_a_rank() -> bool:
    """True while a rank launch started imports the main module, before its fn may run."""
    return multiprocessing.current_process().name.startswith(_RANK_NAME) and not _rank_started


def _stop(processes: list[Any]) -> None:
    processes = [proc for proc in processes if proc.pid is not None]  # started
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
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new local processes; return their results by rank.

    ``backend``: see the module docstring (None: gloo, or nccl-emulated when
    STAGEWISE_EMULATE_NCCL=1). ``timeout`` (seconds) bounds every collective and
    point-to-point wait inside the ranks. ``threads`` sets intra-op threads per
    rank on CPU (default 1, so that ranks do not fight over cores). ``store_dir``
    holds the rendezvous file (created if missing; default: a temporary folder
    removed afterwards). ``start_method``: "spawn" (default) or "forkserver"
    (ranks forked from a server that imported torch once: see the module docstring).
    Call it under ``if __name__ == "__main__":``: every rank imports the main module.
    """
    if _reimported_by_a_rank():
        # This script's launch call runs at import; the parent explains, so stay silent here.
        raise SystemExit(_EXIT_UNGUARDED_MAIN)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    _check_backend(backend)
    if start_method not in _START_METHODS:
        raise ValueError(
            f"start_method ({start_method!r}) must be one of {', '.join(map(repr, _START_METHODS))}: "
            "'spawn' starts each rank afresh, 'forkserver' forks it from a server that imported torch once"
        )
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise ValueError(
            f"fn and its arguments must be picklable to reach the spawned ranks ({exc}); "
            "define fn at module level (not a lambda or a local function)"
        ) from exc
    backend = backend or default_backend()
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"backend 'nccl' needs one GPU per rank: world_size {world_size}, "
            f"{torch.cuda.device_count()} GPUs visible; use backend='gloo' or fewer ranks"
        )

    caller_env = dict(os.environ) if start_method == "forkserver" else None
    ctx = mp.get_context("forkserver") if caller_env is not None else mp.get_context("spawn")
    if caller_env is not None:
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # read when the server starts: the first launch
    results = ctx.Queue()
    own_dir = store_dir is None
    folder = tempfile.mkdtemp(prefix="stagewise-store-") if store_dir is None else os.fspath(store_dir)
    os.makedirs(folder, exist_ok=True)  # a FileStore in a missing folder would retry until its timeout
    store_path = tempfile.mktemp(prefix="store-", dir=folder)
    streams = tuple(_CallerStream(fd) if caller_env is not None and _open(fd) else None for fd in (1, 2))
    shared = (world_size, backend, store_path, timeout, threads, results, fn, args, caller_env, streams)
    processes = [
        ctx.Process(
            target=_run_rank,
            args=(os.getpid(), rank, *shared),
            name=f"{_RANK_NAME}{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        with _parent_signals():
            with _ranks_ignore_sigint():
                for proc in processes:
                    proc.start()
            return _collect(processes, results)
    finally:
        _stop(processes)
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)


class _Stopped(BaseException):
    """SIGTERM or SIGINT reached launch's process: stop the ranks, then exit with ``status``."""

    def __init__(self, name: str, status: int) -> None:
        super().__init__(name)
        self.name, self.status = name, status


def _on_signal(signum: int, frame: Any) -> None:
    raise _Stopped(signal.Signals(signum).name, 128 + signum)


@contextlib.contextmanager
def _parent_signals() -> Iterator[None]:
    """In the main thread: SIGTERM and SIGINT stop the ranks (the ``finally`` of ``launch``) and
    exit with one line; a handler the program installed itself is kept."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = [
        sig for sig in (signal.SIGTERM, signal.SIGINT)
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler)
    ]  # fmt: skip
    previous = {sig: signal.signal(sig, _on_signal) for sig in ours}
    try:
        yield
    except (_Stopped, KeyboardInterrupt) as exc:
        name, status = (exc.name, exc.status) if isinstance(exc, _Stopped) else ("SIGINT", 130)
        print(f"pipeline.launch: {name}: stopping the ranks", file=sys.stderr, flush=True)
        raise SystemExit(status) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _ranks_ignore_sigint() -> Iterator[None]:
    """Ranks started here inherit SIGINT ignored (Python then installs no handler of its own):
    Ctrl-C reaches the whole process group, and only the parent acts on it. A Ctrl-C meanwhile is
    not lost: SIGINT is blocked too (Linux keeps a blocked signal pending even while ignored), so
    it reaches the parent's own handler once that is back. Only this thread blocks it: a Ctrl-C
    that Linux gives another thread of the parent (one that does not block SIGINT: torch's
    intra-op threads, once a parallel op ran) is dropped, and a second Ctrl-C stops the launch."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending one is handled here


def _collect(processes: list[Any], results: Any) -> list[Any]:
    values: dict[int, Any] = {}
    while len(values) < len(processes):
        try:
            rank, ok, payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            rank = -1  # raise below, outside the handler: queue.Empty is not part of any failure
        if rank < 0:
            if any(r not in values and p.exitcode is not None for r, p in enumerate(processes)):
                _raise_first_failure(processes, results, values, [])
            continue
        if not ok:
            _raise_first_failure(processes, results, values, [(rank, f"rank {rank} failed: {payload}")])
        values[rank] = pickle.loads(payload)
    return [values[rank] for rank in range(len(processes))]


def _unguarded_main_error(rank: int) -> RankError:
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "the main module"
    return RankError(
        rank,
        f"rank {rank} stopped while starting: {script} calls pipeline.launch when it is imported, and "
        "every rank imports the main module again (multiprocessing's spawn), so each rank tried to "
        'launch ranks of its own. Put the launch call under `if __name__ == "__main__":`.',
    )


def _died(rank: int, status: int) -> str:
    if status == CREATION_EXIT:
        return (
            f"rank {rank} ended itself (exit status {status}): a peer failed while NCCL made a "
            "communicator, which cannot be aborted (its stderr names the peer)"
        )
    return (
        f"rank {rank} exited with code {status} before returning a result "
        "(killed, os._exit, or a crash in native code)"
    )


def _raise_first_failure(
    processes: list[Any], results: Any, values: dict[int, Any], failures: list[tuple[int, str]]
) -> None:
    """Raise for the root cause: one failure usually makes its peers fail too, a moment later.

    A launch call outside ``if __name__ == "__main__":`` comes first (every rank
    stops for it), then a rank that died without a word (its peers only report
    a lost connection), then exceptions in the order they arrived, then ranks
    that ended themselves because a peer failed while NCCL made a communicator.
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
    unguarded = [r for r, proc in enumerate(processes) if proc.exitcode == _EXIT_UNGUARDED_MAIN]
    if unguarded:
        raise _unguarded_main_error(unguarded[0])
    reported = {rank for rank, _ in failures} | set(values)
    dead = [
        (rank, _died(rank, proc.exitcode))
        for rank, proc in enumerate(processes)
        if rank not in reported and proc.exitcode is not None
    ]
    # a rank its creation guard ended (arrival.py) only reacted to another's death or failure: after all
    ended = [d for d in dead if processes[d[0]].exitcode == CREATION_EXIT]
    ordered = [d for d in dead if d not in ended] + failures + ended
    rank, message = ordered[0]
    others = "".join(f"\n\nthen {m.splitlines()[0]}" for _, m in ordered[1:])
    raise RankError(rank, message + others)
