from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.runtime.comm.p2p import Comm, PeerFailure, PipelineTimeout
from pipeline.runtime.comm.watchdog import Liveness, process_alive
from tests.dist import run_ranks


def _exchange() -> list[Any]:
    """Batched exchange, a receive's timeout, a store key's timeout, then a published failure seen by
    a waiting rank."""
    rank, out = dist.get_rank(), []
    group = dist.new_group(backend="gloo")  # a timeout closes its connections: keep the world's healthy
    comm = Comm(group, "test", timeout=0.5)
    peer = 1 - rank
    send, recv = torch.full((3,), float(rank)), torch.zeros(3)
    sent, got = comm.post([([send], peer)], [([recv], peer)], "exchange")
    comm.wait(got, "exchange")
    comm.wait(sent, "exchange")
    out.append(recv.tolist())
    # rank 0 waits for a message rank 1 never sends: a timeout naming the action
    if rank == 0:
        start = time.monotonic()
        try:
            (works,) = comm.post([], [([torch.zeros(1)], 1)], "0RECV_F9 from rank 1")
            comm.wait(works, "0RECV_F9 from rank 1")
        except PipelineTimeout as exc:
            out.append((str(exc), time.monotonic() - start))
    # rank 0 waits for a store key rank 1 never sets: a timeout naming what it waited for
    if rank == 0:
        start = time.monotonic()
        try:
            comm.wait_key("test/never-set", "rank 1's output signature")
        except PipelineTimeout as exc:
            out.append((str(exc), time.monotonic() - start))
    dist.barrier()
    # rank 1 publishes a failure; rank 0, waiting on a store key, sees it at once
    comm.timeout = 30.0
    if rank == 1:
        comm.publish("ValueError: bad things")
        comm.publish("a later failure is not recorded")
        return out
    start = time.monotonic()
    try:
        comm.wait_key("never-set", "stage 3's output signature")
    except PeerFailure as exc:
        out.append((str(exc), time.monotonic() - start))
    return out


def test_exchange_timeout_and_failure(tmp_path: Path) -> None:
    r0, r1 = run_ranks(tmp_path, _exchange, 2)
    assert r0[0] == [1.0, 1.0, 1.0] and r1[0] == [0.0, 0.0, 0.0]
    message, elapsed = r0[1]
    assert message == "rank 0 timed out after 0.5 s waiting for 0RECV_F9 from rank 1"
    assert 0.4 < elapsed < 2.0
    message, elapsed = r0[2]
    assert message == "rank 0 timed out after 0.5 s waiting for rank 1's output signature"
    assert 0.4 < elapsed < 2.0
    message, elapsed = r0[3]
    assert message == (
        "rank 1 failed while rank 0 waited for stage 3's output signature: ValueError: bad things"
    )
    assert elapsed < 1.0


def test_a_peer_whose_process_is_gone_is_found_dead_on_its_host_only(tmp_path: Path) -> None:
    import subprocess

    store = dist.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    me = Liveness(store, "proc", 0, 3)
    me.register()
    gone = subprocess.Popen(["sleep", "30"])
    elsewhere = f"another-host/{me.machine}"
    store.set("proc/1", f"{me.machine}|{gone.pid}|1")  # on this host, and it served the store
    store.set("proc/2", f"{elsewhere}|{gone.pid}|0")  # a pid on another host means nothing here
    me.learn()
    assert me.dead() == [] and not me.store_lost() and process_alive(gone.pid)
    gone.kill()
    deadline = time.monotonic() + 10
    while process_alive(gone.pid) and time.monotonic() < deadline:  # a zombie until reaped: exited
        time.sleep(0.01)
    try:
        assert me.dead() == [1] and me.store_lost() and sorted(me.pids) == [1]
    finally:
        gone.wait()


def test_a_dead_peer_is_published_under_the_name_errors_give_it(tmp_path: Path) -> None:
    """In a mesh a group rank is ambiguous: a dead peer is named (and published) by its global rank."""
    import subprocess

    from pipeline.runtime.comm.board import FailureBoard

    store = dist.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    gone = subprocess.Popen(["true"])
    gone.wait()  # exited and reaped: no process of this host has that pid now
    board = FailureBoard(store, None, "t", 0, [5, 7])  # group ranks 0 and 1 are global ranks 5 and 7
    store.set("t/proc/1", f"{board.liveness.machine}|{gone.pid}|0")
    blamed = board.blame_dead()
    assert blamed is not None and blamed[0] == 7
    assert blamed[1].startswith(f"rank 7's process (pid {gone.pid}) is gone")
    assert board.first() == blamed  # published so, for every rank to read
