"""Every rank at a Pipeline's construction before NCCL makes communicators (``runtime.comm.arrival``).

Under the NCCL emulation a communicator's creation is what it is on GPUs: a rendezvous of its ranks
that nothing of the pipeline's watches (``emulation._rendezvous``; a new group's own barrier, too).
A peer that never comes, dies after coming, or raises while building its stages must be named by
the ranks waiting for it, within the pipeline's timeout, never left to those rendezvous.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.launch import FORKSERVER_PRELOAD, RankError
from pipeline.plan import Plan
from pipeline.runtime.comm import emulation
from pipeline.runtime.comm.arrival import CREATION_EXIT, arrive
from pipeline.runtime.comm.board import FailureBoard
from pipeline.runtime.comm.watchdog import Liveness, PeerFailure, PipelineTimeout, _machine
from pipeline.runtime.pipe import Pipeline
from tests.dist import run_ranks

# ---- arrive() alone, in one process: peers as a store's entries


def _store(tmp_path: Path) -> Any:
    return dist.FileStore(str(tmp_path / "store"), 1)


def _key(members: tuple[int, ...]) -> str:
    """arrive's key for its first call on ``members`` in this process (unused elsewhere here)."""
    return f"stagewise/arrive0/{'_'.join(map(str, members))}"


def test_arriving_returns_once_every_rank_has_come(tmp_path: Path) -> None:
    store, members = _store(tmp_path), (11, 12)
    store.set(f"{_key(members)}/1", f"{_machine()}|{os.getpid()}|0")  # rank 12 came first
    start = time.monotonic()
    arrive(store, members, 11, 5.0, "the test")
    assert time.monotonic() - start < 1.0
    assert store.check([f"{_key(members)}/0"])  # and rank 11 is recorded for the others


def test_a_peer_that_came_and_died_is_named_at_once(tmp_path: Path) -> None:
    store, members = _store(tmp_path), (21, 22, 23)
    gone = subprocess.Popen(["true"])
    gone.wait()  # exited and reaped: its pid is gone
    store.set(f"{_key(members)}/2", f"{_machine()}|{gone.pid}|0")  # rank 23 came, then died
    start = time.monotonic()
    with pytest.raises(PeerFailure) as info:
        arrive(store, members, 21, 60.0, "the test's point")
    assert time.monotonic() - start < 2.0  # not the timeout
    assert str(info.value) == (
        f"rank 23's process (pid {gone.pid}) is gone: it arrived and then died (SIGKILL, the OOM "
        "killer, a native crash) while rank 21 waited for ranks [22] at the test's point"
    )


def test_a_failure_published_on_the_board_ends_the_wait(tmp_path: Path) -> None:
    store, members = _store(tmp_path), (31, 32)
    board = FailureBoard(store, None, "stagewise/test", 0, [31, 32])
    board.publish_as(32, "ValueError: bad")
    with pytest.raises(PeerFailure, match=r"^rank 32 failed while rank 31 waited for ranks \[32\] at "
                       r"the point: ValueError: bad$"):  # fmt: skip
        arrive(store, members, 31, 60.0, "the point", board)


def test_a_peer_that_never_comes_is_named_at_the_timeout(tmp_path: Path) -> None:
    store, members = _store(tmp_path), (41, 42, 43)
    store.set(f"{_key(members)}/0", f"{_machine()}|{os.getpid()}|0")
    start = time.monotonic()
    with pytest.raises(
        PipelineTimeout, match=r"^rank 42 timed out after 0.3 s waiting for ranks \[43\] at x"
    ):
        arrive(store, members, 42, 0.3, "x")
    assert 0.3 <= time.monotonic() - start < 2.0


def test_the_creation_guard_lets_the_main_thread_raise_a_failure_itself(tmp_path: Path) -> None:
    """Within the grace the guard only watches: a main thread that left the creation (raising its own
    error) keeps its process; the peer's death is what ``failure`` reports."""
    store, members = _store(tmp_path), (51, 52)
    peer = subprocess.Popen(["sleep", "30"])
    try:
        store.set(f"{_key(members)}/1", f"{_machine()}|{peer.pid}|0")
        arrived = arrive(store, members, 51, 5.0, "the test")
        assert arrived.failure() is None
        peer.kill()
        peer.wait()
        with arrived.creating("the test's communicator"):
            time.sleep(1.0)  # inside the grace: the guard must not end this process
        assert arrived.failure() == f"rank 52's process (pid {peer.pid}) is gone"
    finally:
        peer.kill()
        peer.wait()


def _leaves_the_creation_in_time(folder: str) -> None:
    """A peer dies; the creation is left within the grace; the process outlives every grace after."""
    from pipeline.runtime.comm import arrival

    arrival._GRACE_S, arrival._WATCH_AFTER_S = 0.2, 0.2
    store, members = _store(Path(folder)), (71, 72)
    peer = subprocess.Popen(["sleep", "30"])
    store.set(f"{_key(members)}/1", f"{_machine()}|{peer.pid}|0")
    arrived = arrive(store, members, 71, 5.0, "the test")
    peer.kill()
    peer.wait()
    with arrived.creating("the test's communicator"):
        time.sleep(0.05)
    time.sleep(1.0)  # past both graces: a guard or a watch still armed would end this process now
    arrived.close()


def _exit_code(target: Any, tmp_path: Path) -> int | None:
    """``target(folder)``'s exit status in a process of its own (a guard may end it), 30 s at most."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    proc = ctx.Process(target=target, args=(str(tmp_path),))
    proc.start()
    proc.join(30.0)
    proc.kill()
    return proc.exitcode


def test_neither_guard_ends_a_process_that_left_the_creation(tmp_path: Path) -> None:
    assert _exit_code(_leaves_the_creation_in_time, tmp_path) == 0


def test_a_failure_on_the_board_is_what_the_creation_guard_reports(tmp_path: Path) -> None:
    store, members = _store(tmp_path), (61, 62)
    store.set(f"{_key(members)}/1", f"{_machine()}|{os.getpid()}|0")
    board = FailureBoard(store, None, "test", 0, [61, 62])
    arrived = arrive(store, members, 61, 5.0, "the test", board)
    board.publish_as(62, "rank 62 raised in its init_fn")
    assert arrived.failure() == "rank 62 failed: rank 62 raised in its init_fn"


# ---- peers on another host: their pids mean nothing here


def _dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()  # exited and reaped: no process of this host has that pid now
    return gone.pid


def test_a_peer_on_another_host_is_never_judged_by_a_pid_of_this_one(tmp_path: Path) -> None:
    # its pid names no process here (or another one): read as ours, a live remote peer would be gone
    store, pid = _store(tmp_path), _dead_pid()
    store.set("test/proc/1", f"not-{_machine()}|{pid}|1")  # on another host, serving the store
    store.set("test/proc/2", f"{_machine()}|{os.getpid()}|0")
    live = Liveness(store, "test/proc", 0, 3)
    live.learn()
    assert live.pids == {2: os.getpid()} and live.dead() == []
    assert live.store_host is None and not live.store_lost()  # the store's host is not this one
    board = FailureBoard(store, None, "test", 0, [0, 1, 2])  # on gloo: who failed is asked of it
    assert board.blame_dead() is None and board.first() is None  # nobody to blame, nothing published


def test_arriving_waits_for_a_remote_peer_as_for_one_that_came(tmp_path: Path) -> None:
    store, members = _store(tmp_path), (81, 82)
    store.set(f"{_key(members)}/1", f"not-{_machine()}|{_dead_pid()}|0")
    arrived = arrive(store, members, 81, 5.0, "the test")  # came: no wait, and not gone
    assert arrived.failure() is None
    arrived.close()


def _creates_beside_a_remote_peer(folder: str) -> None:
    """Inside the creation past every grace, beside a remote peer whose pid is dead on this host."""
    from pipeline.runtime.comm import arrival

    arrival._GRACE_S, arrival._WATCH_AFTER_S = 0.2, 0.2
    store, members = _store(Path(folder)), (91, 92)
    store.set(f"{_key(members)}/1", f"not-{_machine()}|{_dead_pid()}|0")
    arrived = arrive(store, members, 91, 5.0, "the test")
    with arrived.creating("the test's communicator"):
        time.sleep(1.5)  # making a communicator takes long: a guard that judged the pid would end us
    arrived.close()


def test_the_creation_guard_never_ends_a_rank_for_a_remote_peers_pid(tmp_path: Path) -> None:
    assert _exit_code(_creates_beside_a_remote_peer, tmp_path) == 0


# ---- in a Pipeline, under the emulation


def _pipeline(model: nn.Module, timeout: float, **kw: Any) -> Pipeline:
    return Pipeline(model, Plan(balance=[2, 2], n_microbatches=2), loss_fn=nn.functional.mse_loss,
                    timeout=timeout, **kw)  # fmt: skip


def _model() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])


def _outcome(folder: str, fn: Any) -> None:
    """Rank 0's outcome of ``fn()`` (its error's type and text, and the seconds it took) in a file."""
    start = time.monotonic()
    try:
        fn()
        kind, text = "ok", ""
    except Exception as exc:
        kind, text = type(exc).__name__, str(exc)
    Path(folder, "rank0").write_text(f"{kind}|{time.monotonic() - start:.2f}|{text}")


def _absent(folder: str) -> None:
    if dist.get_rank() == 0:
        _outcome(folder, lambda: _pipeline(_model(), timeout=2.0))
    else:  # never constructs: waits until rank 0 has given up
        while not Path(folder, "rank0").exists():
            time.sleep(0.05)


class _Tied(nn.Module):
    """One weight in stage 0 and stage 1: the pipeline makes a group for it after building its stages."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _reset(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()


def _init_fails_on_rank_1(module: nn.Module) -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1's init_fn failed")
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()


def _raised_before_the_tie_group(folder: str) -> None:
    with torch.device("meta"):
        model = nn.Sequential(_Tied(), nn.ReLU(), _Tied())
    model[2].a.weight = model[0].a.weight  # tied across the cut

    def build() -> None:
        Pipeline(model, Plan(balance=[2, 1], n_microbatches=2), loss_fn=nn.functional.mse_loss,
                 timeout=60.0, init_fn=_init_fails_on_rank_1)  # fmt: skip

    if dist.get_rank() == 0:
        _outcome(folder, build)
        return
    try:
        build()
    finally:  # the launcher ends the other ranks once this one exits: let rank 0 say what it saw first
        deadline = time.monotonic() + 10.0
        while not Path(folder, "rank0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def _rank0(tmp_path: Path) -> tuple[str, float, str]:
    kind, seconds, text = (tmp_path / "rank0").read_text().split("|", 2)
    return kind, float(seconds), text


def test_a_rank_that_never_comes_is_named_after_the_timeout(tmp_path: Path) -> None:
    run_ranks(tmp_path, _absent, 2, str(tmp_path), timeout=60.0, backend="nccl-emulated")
    kind, seconds, text = _rank0(tmp_path)
    assert kind == "PipelineTimeout" and seconds < 10.0  # the group's own barrier would wait 60 s
    assert text.startswith("rank 0 timed out after 2 s waiting for ranks [1] at the Pipeline's construction")


def test_a_rank_that_raised_building_its_stages_is_named_before_the_tie_groups(tmp_path: Path) -> None:
    with pytest.raises(RankError, match=r"rank 1's init_fn failed"):
        run_ranks(tmp_path, _raised_before_the_tie_group, 2, str(tmp_path), timeout=60.0,
                  backend="nccl-emulated")  # fmt: skip
    kind, seconds, text = _rank0(tmp_path)
    assert kind == "PeerFailure" and seconds < 10.0, text  # the tie group's barrier would wait 60 s
    assert "rank 0 waited for ranks [1] at the tied weights' groups" in text
    assert text.endswith("RuntimeError: rank 1's init_fn failed")


# ---- the emulation's model of NCCL's communicator creation


def _creation(folder: str) -> None:
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    lone = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=1))
    if dist.get_rank() == 1:
        time.sleep(1.0)
    start = time.monotonic()
    emulation.first_use(group, 2, 2, "the test's first collective")
    dist.all_reduce(torch.zeros(1), group=group)
    Path(folder, f"rank{dist.get_rank()}").write_text(f"{time.monotonic() - start:.2f}")
    if dist.get_rank() == 0:  # a group whose other rank never comes
        try:
            emulation.first_use(lone, 2, 2, "a collective rank 1 never joins")
            Path(folder, "lone").write_text("made")
        except RuntimeError as exc:
            Path(folder, "lone").write_text(str(exc))


def test_the_emulation_makes_a_communicator_as_a_rendezvous_nothing_watches(tmp_path: Path) -> None:
    run_ranks(tmp_path, _creation, 2, str(tmp_path), timeout=30.0, backend="gloo")
    assert float((tmp_path / "rank0").read_text()) >= 0.9  # rank 0 waited there for rank 1
    assert (tmp_path / "rank1").exists()
    assert (
        (tmp_path / "lone")
        .read_text()
        .startswith(
            "NCCL emulation: a collective rank 1 never joins made its group's communicator, a rendezvous of "
            "the group's 2 ranks that waited 1 s for the others"
        )
    )


# ---- a peer that dies inside the creation, after every rank arrived


def _rank_of_a_creation_that_loses_rank_1(rank: int, folder: str, gil: str) -> None:
    """One rank of two, a plain process (not one of ``launch``'s, which would end rank 0 as soon as
    rank 1 died): rank 1 dies as its channels' communicators are made, or with ``gil`` "ties" as its
    tied weights' group is first used (a weight tied across the cut). With ``gil`` "held", rank 0
    is then inside a C call that holds the interpreter (as torch's binding of NCCL's split does), where
    no thread of its own can run. stderr goes to a file."""
    from pipeline.runtime.comm.collectives import Collectives

    os.dup2(os.open(Path(folder, f"stderr{rank}"), os.O_WRONLY | os.O_CREAT), 2)
    os.environ[emulation.ENV] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder, "store")), 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    from pipeline.runtime.trace.ties import TiedGrads

    # the creation: the tied weights' group's first use (made there, on NCCL), else the channels'
    owner: Any = TiedGrads if gil == "ties" else Collectives
    name = "sync" if gil == "ties" else "make_communicators"
    inside = Path(folder, "rank0-inside")  # rank 1 dies only once rank 0 is past gloo's own connects
    if rank == 1:

        def die(self: Any) -> None:
            deadline = time.monotonic() + 20.0
            while not inside.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)

        setattr(owner, name, die)
    else:
        made = getattr(owner, name)

        def enter(self: Any) -> None:
            inside.write_text("")
            if gil == "held":
                ctypes.PyDLL(None).sleep(60)  # PyDLL: the GIL stays held
            made(self)

        setattr(owner, name, enter)
    if gil == "ties":
        with torch.device("meta"):
            model = nn.Sequential(_Tied(), nn.ReLU(), _Tied())
        model[2].a.weight = model[0].a.weight  # tied across the cut
        Pipeline(model, Plan(balance=[2, 1], n_microbatches=2), loss_fn=nn.functional.mse_loss,
                 timeout=60.0, init_fn=_reset)  # fmt: skip
    else:
        _pipeline(_model(), timeout=60.0)
    Path(folder, f"constructed{rank}").write_text("")


@pytest.mark.parametrize("gil", ["released", "held", "ties"])
def test_a_peer_dying_while_nccl_makes_communicators_ends_the_ranks_waiting_in_it(
    tmp_path: Path, gil: str
) -> None:
    """Rank 0 waits in the emulated creation (NCCL's rendezvous, which nothing of ours can enter): its
    guard thread names rank 1 and ends the process (status 75) after its 2 s of grace, where the
    rendezvous would wait 60 s; inside a call that holds the GIL, its watch process does, 3 s later."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # as launch does, in case this starts the server
    ranks = [
        ctx.Process(target=_rank_of_a_creation_that_loses_rank_1, args=(r, str(tmp_path), gil))
        for r in (0, 1)
    ]
    try:
        start = time.monotonic()
        for proc in ranks:
            proc.start()
        ranks[0].join(30.0)
        seconds = time.monotonic() - start
    finally:
        for proc in ranks:
            proc.kill()
            proc.join()
    err = (tmp_path / "stderr0").read_text()
    assert ranks[1].exitcode == -signal.SIGKILL
    assert not (tmp_path / "constructed0").exists()
    made = "the pipeline's channels and communicators" if gil != "ties" else "the tied weights' groups"
    if gil != "held":
        assert ranks[0].exitcode == CREATION_EXIT, err
        assert 2.0 <= seconds < 10.0, seconds
        assert (
            f"rank 0 is ending its process (exit status {CREATION_EXIT}): rank 1's process "
            f"(pid {ranks[1].pid}) is gone while NCCL made {made}" in err
        )
    else:
        assert ranks[0].exitcode == -signal.SIGKILL, err
        assert 5.0 <= seconds < 15.0, seconds
        assert (
            f"rank 0's creation watch is ending it (SIGKILL): rank 1's process (pid {ranks[1].pid}) is "
            f"gone while NCCL made {made}, a call that holds the interpreter" in err
        )
