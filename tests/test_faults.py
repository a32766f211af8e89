"""Process faults: a killed rank is the one named, exits are clean, restarts come back, nothing is orphaned.

Each scenario runs real processes (SIGKILL cannot be simulated in one), each
in its own session, killed as a group in ``finally``: no test leaves a process
behind. Ranks started by hand use MASTER_ADDR / MASTER_PORT (rank 0 serves
the TCPStore, as without torchrun's agent) on a port the OS picked.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.launch import RankError
from pipeline.runtime.pipe import Pipeline
from tests.dist import free_port, run_ranks

ROOT = Path(__file__).resolve().parent.parent

# one rank of a tiny pipeline; KILL=r:k SIGKILLs rank r at step k, ranks print DONE or one ERROR line
_WORKER = """
import os, signal, sys, time
import torch
import torch.nn.functional as F
from torch import nn
from pipeline.launch import init_distributed
from pipeline.runtime.pipe import Pipeline

info = init_distributed(timeout=float(os.environ.get("TIMEOUT", "60")))
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
kill_rank, kill_step = map(int, os.environ.get("KILL", "-1:-1").split(":"))
torch.manual_seed(0)
p = info.world_size
pipe = Pipeline(nn.Sequential(*[nn.Linear(4, 4) for _ in range(p)]), [1] * p, n_microbatches=2,
                loss_fn=F.mse_loss, timeout=float(os.environ.get("TIMEOUT", "60")))
x, y = torch.randn(4, 4), torch.randn(4, 4)
for step in range(int(os.environ.get("STEPS", "1000"))):
    if info.rank == kill_rank and step == kill_step and attempt == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
print(f"DONE rank {info.rank} attempt {attempt}", flush=True)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    env.pop("STAGEWISE_EMULATE_NCCL", None)
    return env


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _ranks_by_hand(tmp_path: Path, world_size: int, kill: str) -> list[tuple[int, str]]:
    """(return code, output) of each rank started from MASTER_ADDR / MASTER_PORT, in its own session."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=_env(
                RANK=str(r),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                KILL=kill,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in range(world_size)
    ]
    try:
        outs = [proc.communicate(timeout=120)[0] for proc in procs]
        return [(proc.returncode, out) for proc, out in zip(procs, outs, strict=True)]
    finally:
        for proc in procs:
            _kill_group(proc)


@pytest.mark.parametrize(
    ("world_size", "dead"),
    [
        pytest.param(4, 1, id="rank-1-of-4"),
        # the store goes with its host: a rank inside a store call then (often, on a loaded machine)
        # must still print no C++ trace (watchdog.quiet_store)
        pytest.param(3, 0, id="rank-0-the-store-host"),
    ],
)
def test_a_killed_rank_is_named_by_every_other_rank_in_a_few_lines(
    tmp_path: Path, world_size: int, dead: int
) -> None:
    results = _ranks_by_hand(tmp_path, world_size, f"{dead}:3")
    assert results[dead][0] == -signal.SIGKILL
    for r, (rc, out) in enumerate(results):
        if r == dead:
            continue
        assert rc == 1, (r, rc, out)  # a Python error's status: no abort at exit (rc -6), no hang
        assert f"PeerFailure: rank {dead} failed while rank {r} waited for" in out, (r, out)
        assert f"rank {dead}'s process (pid" in out, (r, out)
        if dead == 0:
            assert "the store it served went with it" in out, (r, out)
        assert "frame #" not in out and "terminate called" not in out, (r, out)  # no C++ traces
        assert len(out.splitlines()) < 30, (r, out)


def _evaluate_on_rank_zero() -> str:
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], n_microbatches=2,
                    loss_fn=nn.functional.mse_loss, timeout=60.0)  # fmt: skip
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    if dist.get_rank() == 0:
        pipe.evaluate(x, None)
    else:
        pipe.step(None, y)
    return "no error"


def test_step_on_one_rank_and_evaluate_on_another_is_named_at_once(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(tmp_path, _evaluate_on_rank_zero, 2, timeout=60.0)
    message = str(info.value)
    assert "rank 1 is in step() (its call number 2 on this Pipeline) but rank 0 in evaluate() " in message
    assert time.monotonic() - start < 30  # not the 60 s timeout


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "parent.py"
    script.write_text(body)
    return script


_PARENT = """
import os, signal, sys, time
import pipeline

def work():
    ignores = signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the parent decides for the ranks
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # as the parent had it
    os.write(1, f"RANK {os.getpid()} {ignores} {blocked}\\n".encode())  # one write: the ranks share the pipe
    time.sleep(300)

if __name__ == "__main__":
    # as run from a terminal: the test runner may have been started as a background job, whose
    # children inherit SIGINT ignored (and launch then rightly leaves it so)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.argv[1] == "forkserver":  # a server this program started before, with SIGINT as it was
        import multiprocessing.forkserver
        multiprocessing.forkserver.ensure_running()
    pipeline.launch(work, 2, timeout=60.0, start_method=sys.argv[1])
"""


def _ranks_of(proc: subprocess.Popen[bytes], n: int) -> list[int]:
    """The pids the ranks print once they run (their fn started), read from the unbuffered pipe."""
    assert proc.stdout is not None
    fd, text = proc.stdout.fileno(), b""
    deadline = time.monotonic() + 120
    while text.count(b"RANK ") < n or not text.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"the ranks did not start within 120 s (printed: {text!r})"
        chunk = os.read(fd, 4096)
        assert chunk, f"the parent ended before its ranks started (printed: {text!r})"
        text += chunk
    lines = [line.split() for line in text.decode().splitlines() if line.startswith("RANK ")]
    assert all(words[2] == "True" for words in lines), f"a rank does not ignore SIGINT: {text!r}"
    assert all(words[3] == "False" for words in lines), f"a rank keeps SIGINT blocked: {text!r}"
    return [int(words[1]) for words in lines]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between it and the read
        return False


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize(
    ("how", "start"),
    [("SIGKILL", "spawn"), ("SIGTERM", "spawn"), ("SIGINT", "spawn"), ("SIGKILL", "forkserver"),
     ("SIGINT", "forkserver")],  # forked from the server: its ranks end with the launcher too
)  # fmt: skip
def test_the_ranks_end_with_launchs_parent(tmp_path: Path, how: str, start: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(_script(tmp_path, _PARENT)), start], env=_env(), cwd=tmp_path, bufsize=0,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    ranks: list[int] = []
    try:
        ranks = _ranks_of(proc, 2)
        if how == "SIGINT":  # Ctrl-C: the terminal signals the whole process group
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, getattr(signal, how))
        proc.wait(timeout=30)
        assert _gone_within(ranks, 5.0) == [], f"ranks left behind after {how} of the parent"
        if how != "SIGKILL":
            assert proc.stderr is not None
            err = proc.stderr.read().decode()  # EOF: nobody holds the pipe any more
            assert proc.returncode == 128 + getattr(signal, how), err
            assert err.strip() == f"pipeline.launch: {how}: stopping the ranks", err  # no traceback, no leak
    finally:
        _kill_group(proc)
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_torchrun_restart_after_sigkill_comes_back_quickly(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.1",
        str(script),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=_env(KILL="1:3", STEPS="8", TIMEOUT="40"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=100)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, out
    assert "DONE rank 0 attempt 1" in out and "DONE rank 1 attempt 1" in out, out
    assert time.monotonic() - start < 90, out


# a watchdog thread inside a torch call (GIL released) when the interpreter finalizes: CPython ends
# it with pthread_exit as it retakes the GIL, the unwinding meets pybind11's noexcept destructor,
# and std::terminate aborts the process; the __del__ keeps finalization busy while the call returns
_EXIT_WHILE_WATCHING = """
import datetime, sys, time
import torch.distributed as dist
from pipeline.runtime.comm.watchdog import Watchdog

files = dist.FileStore(sys.argv[1], 1)

class InTorch:
    def check(self, keys):
        files.wait(["never set"], datetime.timedelta(seconds=1))  # C++, the GIL released

class SlowTeardown:
    def __del__(self):
        time.sleep(2)

dog = Watchdog(InTorch(), "failed", [])
dog.blocked = 1
dog.start()
time.sleep(0.3)  # the thread is inside the wait
keep = SlowTeardown()
raise SystemExit(3)
"""


def test_exit_while_the_watchdog_is_inside_a_torch_call_is_a_normal_exit(tmp_path: Path) -> None:
    script = _script(tmp_path, _EXIT_WHILE_WATCHING)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], env=_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr  # not -6 (SIGABRT)
    assert "terminate called" not in proc.stderr, proc.stderr
