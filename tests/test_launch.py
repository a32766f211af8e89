from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline import startup
from pipeline.launch import EMULATE_NCCL_ENV, RankError, default_backend, init_distributed, launch
from pipeline.runtime.comm.arrival import CREATION_EXIT
from tests.dist import free_port, run_ranks


def _group_timeout() -> float:
    """The default process group's timeout, in seconds (what its collectives wait at most)."""
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return float(backend.options._timeout.total_seconds())


def _rank_info(offset: int) -> tuple[int, int, int, str, float]:
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    return dist.get_rank() + offset, dist.get_world_size(), int(total), os.environ["RANK"], _group_timeout()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order(tmp_path: Path, world_size: int) -> None:
    """And the default group waits the launch's timeout (37 s), not torch's 30 minutes."""
    results = run_ranks(tmp_path, _rank_info, world_size, 100, timeout=37.0)
    expected_sum = sum(range(world_size))
    assert results == [(100 + r, world_size, expected_sum, str(r), 37.0) for r in range(world_size)]


def _one_thread() -> int:
    return torch.get_num_threads()


def test_one_intra_op_thread_per_rank(tmp_path: Path) -> None:
    assert run_ranks(tmp_path, _one_thread, 2) == [1, 1]


def _say(tag: str) -> None:
    # one write per line: print writes the text and its newline apart, and two ranks' writes to one
    # stream may interleave between them (as two spawned ranks' would)
    sys.stdout.write(f"{tag}: rank {dist.get_rank()} out\n")
    sys.stderr.write(f"{tag}: rank {dist.get_rank()} err\n")
    sys.stdout.flush()
    sys.stderr.flush()


def test_forked_ranks_print_to_the_callers_streams_as_they_are_at_the_launch(tmp_path: Path) -> None:
    """Spawned ranks inherit the caller's stdout and stderr; forked ones must too, not the server's
    (the caller's when the server started: here, or an earlier test's capture)."""
    run_ranks(tmp_path / "a", _say, 2, "before")  # the server is started by now
    files = [open(tmp_path / name, "w+") for name in ("out", "err")]  # noqa: SIM115
    saved = [os.dup(1), os.dup(2)]
    try:
        for f, fd in zip(files, (1, 2), strict=True):
            os.dup2(f.fileno(), fd)
        run_ranks(tmp_path / "b", _say, 2, "redirected")
    finally:
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)
    out, err = ((tmp_path / name).read_text() for name in ("out", "err"))
    for f in files:
        f.close()
    assert sorted(out.splitlines()) == ["redirected: rank 0 out", "redirected: rank 1 out"], out
    assert sorted(err.splitlines()) == ["redirected: rank 0 err", "redirected: rank 1 err"], err


def _tensor_result() -> torch.Tensor:
    return torch.arange(4) * dist.get_rank()


def test_tensors_outlive_their_rank(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, _tensor_result, 2)
    assert torch.equal(results[1], torch.tensor([0, 1, 2, 3]))


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise KeyError("boom on the second rank")
    dist.barrier()  # the others block here until they are killed


def test_exception_names_rank_and_message_and_leaves_no_rank(tmp_path: Path) -> None:
    import multiprocessing

    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 failed: KeyError: 'boom on the second rank'") as info:
        run_ranks(tmp_path, _raise_on_rank_one, 3, timeout=120.0)
    assert info.value.rank == 1
    assert "_raise_on_rank_one" in str(info.value)  # the remote traceback travels
    assert time.monotonic() - start < 30  # far below the collective timeout: nobody waited for it
    assert multiprocessing.active_children() == []


def _die_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        os._exit(7)
    dist.barrier()


def test_dead_rank_is_reported(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 0 exited with code 7") as info:
        run_ranks(tmp_path, _die_on_rank_zero, 2, timeout=120.0)
    assert info.value.rank == 0
    assert time.monotonic() - start < 30


def _rank_1_dies_rank_2_raises_and_rank_0_ends_itself_in_a_creation() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if dist.get_rank() == 2:
        raise ValueError("rank 2 saw rank 1 go")
    time.sleep(0.1)  # rank 0's creation guard (arrival.py) saw rank 1 gone
    os._exit(CREATION_EXIT)


def test_a_rank_its_creation_guard_ended_is_named_after_the_peers_that_failed(tmp_path: Path) -> None:
    fn = _rank_1_dies_rank_2_raises_and_rank_0_ends_itself_in_a_creation
    with pytest.raises(RankError, match=r"^rank 1 exited with code -9 ") as info:
        run_ranks(tmp_path, fn, 3, timeout=120.0)
    assert info.value.rank == 1
    text = str(info.value)
    ended = (
        f"then rank 0 ended itself (exit status {CREATION_EXIT}): a peer failed while NCCL made a "
        "communicator, which cannot be aborted (its stderr names the peer)"
    )
    assert "then rank 2 failed: ValueError: rank 2 saw rank 1 go" in text and ended in text
    assert text.index("then rank 2 failed") < text.index(ended)


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_bad_world_size(world_size: object) -> None:
    with pytest.raises(ValueError, match=r"world_size must be an integer >= 1, got"):
        launch(_one_thread, world_size)  # type: ignore[arg-type]


def test_unpicklable_fn() -> None:
    with pytest.raises(ValueError, match=r"must be picklable.*define fn at module level"):
        launch(lambda: 0, 1)


def test_unknown_start_method() -> None:
    with pytest.raises(ValueError, match=r"start_method \('fork'\) must be one of 'spawn', 'forkserver'"):
        launch(_rank_info, 2, start_method="fork")


def test_unknown_backend() -> None:
    with pytest.raises(
        ValueError, match=r"unknown backend 'mpi'; use one of \('gloo', 'nccl', 'nccl-emulated'\)"
    ):
        launch(_one_thread, 1, backend="mpi")


def test_nccl_without_gpus() -> None:
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(ValueError, match=r"backend 'nccl' needs one GPU per rank"):
        launch(_one_thread, 2, backend="nccl")


def test_init_distributed_outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match=r"run under torchrun"):
        init_distributed()


def _init_from_env() -> tuple[int, int, str, float]:
    dist.destroy_process_group()  # start as a torchrun worker would: only the environment
    info = init_distributed(timeout=41.0)
    return info.rank, info.world_size, info.device.type, _group_timeout()


def _torchrun_like(tmp_path: Path) -> list[tuple[int, int, str, float]]:
    return run_ranks(tmp_path, _init_from_env, 2)


def test_init_distributed_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert _torchrun_like(tmp_path) == [(0, 2, "cpu", 41.0), (1, 2, "cpu", 41.0)]  # the timeout given


ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = """
import pipeline

def work():
    return 7

{call}
"""


def _run_script(tmp_path: Path, call: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT.format(call=textwrap.dedent(call)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )


def test_launch_outside_the_main_guard_is_one_short_clear_error(tmp_path: Path) -> None:
    proc = _run_script(tmp_path, "print(pipeline.launch(work, 2))")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "calls pipeline.launch when it is imported" in out, out
    assert 'Put the launch call under `if __name__ == "__main__":`' in out, out
    assert "os._exit" not in out and "bootstrapping phase" not in out, out
    assert len(out.splitlines()) < 20, out  # the parent's one traceback, no rank's


def _backend_seen() -> tuple[str, str | None, int, str, str]:
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)  # the group works
    try:
        init_distributed("nccl")
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    info = init_distributed()
    return dist.get_backend(), os.environ.get(EMULATE_NCCL_ENV), int(total), info.backend, refused


def test_none_is_gloo_even_where_gpus_are_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EMULATE_NCCL_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as far as launch can tell
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert default_backend() == "gloo"
    results = run_ranks(tmp_path, _backend_seen, 2, backend=None)
    assert [r[:4] for r in results] == [("gloo", None, 3, "gloo")] * 2


def test_nccl_emulated_is_a_gloo_group_with_the_variable_set_in_every_rank(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, _backend_seen, 2, backend="nccl-emulated")
    assert [r[:4] for r in results] == [("gloo", "1", 3, "nccl-emulated")] * 2
    assert all("already runs 'gloo'" in r[4] for r in results)  # init_distributed refuses a contradiction


def test_the_environment_asks_for_emulation_and_explicit_gloo_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EMULATE_NCCL_ENV, "1")  # what a torchrun user exports
    assert default_backend() == "nccl-emulated"
    assert [r[:4] for r in run_ranks(tmp_path / "a", _backend_seen, 2, backend=None)] == [
        ("gloo", "1", 3, "nccl-emulated")
    ] * 2
    assert [r[:4] for r in run_ranks(tmp_path / "b", _backend_seen, 2, backend="gloo")] == [
        ("gloo", None, 3, "gloo")
    ] * 2


def _torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", "1")  # never reached: the backend is refused first


def test_init_distributed_nccl_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(
        ValueError, match=r"backend 'nccl' needs one GPU per local rank: local rank 0, 0 GPUs"
    ):
        init_distributed("nccl")
    assert not dist.is_initialized()


def test_init_distributed_sets_the_emulation_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch)
    monkeypatch.setenv(EMULATE_NCCL_ENV, "0")  # so that undo removes what init_distributed sets
    monkeypatch.setattr(startup, "join", lambda rank, world_size, timeout: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **_: calls.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    calls: list[str] = []
    info = init_distributed("nccl-emulated")
    assert calls == ["gloo"] and info.backend == "nccl-emulated" and info.device == torch.device("cpu")
    assert os.environ[EMULATE_NCCL_ENV] == "1"


def test_a_restart_does_not_see_the_keys_of_the_attempt_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent keeps one store over restarts: attempt 1 must not count attempt 0's ranks."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the agent serves the store
    agent = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    agent.set("stagewise/attempt0/joined/1", "a worker that was killed since")
    assert startup.join(0, 2, timeout=5.0) is not None  # attempt 0: rank 1 had joined
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    start = time.monotonic()
    with pytest.raises(startup.StartupError, match=r"rank 0 \(attempt 1\) waited 0.5 s for ranks \[1\] of 2"):
        startup.join(0, 2, timeout=0.5)
    assert time.monotonic() - start < 5


def test_an_unreachable_store_is_a_bounded_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody serves it
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    start = time.monotonic()
    expected = (
        r"rank 1 \(attempt 0\) gave up after .* waiting for the store at 127.0.0.1:\d+ \(served by torchrun's"
    )
    with pytest.raises(startup.StartupError, match=expected):
        startup.join(1, 2, timeout=1.0)
    assert time.monotonic() - start < 10


def _ctrl_c_while_the_ranks_start() -> int:
    """The exit status of a Ctrl-C sent while the ranks start; 1 when something else happened."""
    from pipeline.launch import _parent_signals, _ranks_ignore_sigint

    # as run from a terminal: pytest started as a background job inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with _parent_signals():
            with _ranks_ignore_sigint():
                os.kill(os.getpid(), signal.SIGINT)  # as the ranks start
                if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # what they inherit
                    return 1
            time.sleep(5)  # not reached: the pending SIGINT arrived as the handler came back
    except SystemExit as exc:
        unblocked = signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        return int(exc.code or 0) if unblocked else 1
    return 1


def test_a_ctrl_c_while_the_ranks_start_is_not_lost() -> None:
    """While the ranks start, the parent ignores SIGINT (they inherit that); a Ctrl-C then stays
    pending and stops the launch once the parent's handler is back, instead of vanishing. That
    needs the parent's other threads to block SIGINT, or none: a process-directed signal goes to
    any thread that does not block it, where an ignored one is dropped. pytest's process holds
    torch's intra-op threads, so this runs in a forked child: one thread."""
    pid = os.fork()
    if pid == 0:  # the child: this thread alone, which never returns into pytest's session
        status = 1
        try:
            status = _ctrl_c_while_the_ranks_start()
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 130
