"""The watchdog's footprint: store failures without C++ traces, and no thread outliving a dropped Pipeline.

A store call that meets a dead store host raises our error only (torch's
client would print its C++ frames first); a Pipeline dropped without
``close()`` lets its watchdog thread end and its ``Comm`` (with the process
group's connections it watches) be collected.
"""

from __future__ import annotations

import datetime
import gc
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.plan import Plan
from pipeline.runtime.comm.watchdog import Watchdog, _stop_all, quiet_store
from pipeline.runtime.pipe import Pipeline
from tests.dist import job

_WATCHDOG = "stagewise-p2p-watchdog"


def _store_whose_host_died() -> Any:
    """A TCPStore client whose server (in this process) is gone: its next call fails."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    server = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)  # type: ignore[attr-defined]
    client = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=10)
    )
    client.set("key", "value")
    del server
    gc.collect()
    return client


def test_a_store_call_that_meets_a_dead_host_prints_no_cpp_trace(capfd: pytest.CaptureFixture[str]) -> None:
    client = _store_whose_host_died()
    with pytest.raises(Exception, match=r"closed|reset|pipe|recv"), quiet_store():
        client.check(["key"])
    err = capfd.readouterr().err
    assert "frame #" not in err and "TCPStore.cpp" not in err, err
    # the level is restored: the next failing call outside quiet_store prints as torch prints it
    with pytest.raises(Exception, match=r"closed|reset|pipe|recv"):
        client.check(["key"])
    assert "TCPStore.cpp" in capfd.readouterr().err


def _dropped_unclosed(dp: int) -> tuple[int, list[bool], bool]:
    """(watchdog threads of this Pipeline, which of them still run 1 s after it is dropped without
    close(), whether its Comm was collected)."""
    torch.manual_seed(0)
    before = set(threading.enumerate())
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plan = Plan(balance=[1, 1], schedule="1f1b", n_microbatches=2, dp=dp)
    pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, timeout=60.0)
    x, y = torch.randn(4 * dp, 4), torch.randn(4 * dp, 4)
    pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)  # starts the watchdog
    dogs = [t for t in threading.enumerate() if t.name == _WATCHDOG and t not in before]
    assert pipe.comm is not None
    comm = weakref.ref(pipe.comm)
    del pipe, model
    gc.collect()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(t.is_alive() for t in dogs):
        time.sleep(0.01)
    return len(dogs), [t.is_alive() for t in dogs], comm() is None


_DROPPED = {
    "gloo": job(2, _dropped_unclosed, 1),
    "nccl-emulated": job(2, _dropped_unclosed, 1, backend="nccl-emulated"),
    # the replicas' Comm too: the gradient reducer's hooks (dp.py), in autograd's C++ state where the
    # garbage collector cannot see, hold it only weakly
    "dp": job(4, _dropped_unclosed, 2),
}


@pytest.mark.parametrize(
    "kind",
    [
        "gloo",
        "nccl-emulated",
        "dp",
    ],
)
def test_a_pipeline_dropped_without_close_lets_its_watchdog_thread_end(
    tmp_path_factory: pytest.TempPathFactory, kind: str
) -> None:
    for rank, (n, running, collected) in enumerate(_DROPPED[kind].results(tmp_path_factory)):
        assert n >= 1, f"rank {rank}: the step started no watchdog thread"
        assert not any(running), f"rank {rank}: {running.count(True)} of {n} watchdog threads still run"
        assert collected, f"rank {rank}: the dropped Pipeline's Comm was not collected"


def test_a_watchdog_thread_never_owns_the_backends_it_watches(tmp_path: Path) -> None:
    """The backend goes with its last reference outside the thread, while the thread runs: were the
    thread its last owner, the backend's destructor (which releases the GIL to join gloo's workers and
    takes it back) could run in the thread as the interpreter finalizes, and abort the process. And the
    exit hook stops and joins the thread of a Watchdog that was dropped."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group = dist.new_group(backend="gloo")
        backend = group._get_backend(torch.device("cpu"))
        dog = Watchdog(dist.HashStore(), "failed", [(backend, 0)])
        dog.start()
        thread, owned = dog.thread, weakref.ref(backend)
        del backend, dog
        dist.destroy_process_group(group)
        del group
        assert thread is not None and thread.is_alive()
        assert owned() is None  # freed here, with the thread still running
    finally:
        dist.destroy_process_group()
    _stop_all()
    assert not thread.is_alive()
