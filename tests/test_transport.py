"""``pipeline.runtime.comm.transport``: the path is chosen from the backend once, and each path refuses
what its backend cannot take (in process, no process group: the multi-rank behaviour is
test_p2p's, test_comm_device's and test_nccl_emulation's)."""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import pytest
import torch

from pipeline.runtime.comm import emulation
from pipeline.runtime.comm.transport import (
    EmulatedNccl,
    GlooTransport,
    NcclTransport,
    Transport,
    transport_class,
)
from pipeline.runtime.comm.watchdog import PeerFailure, PipelineTimeout


def test_the_path_follows_the_backend_and_the_emulation_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(emulation.ENV, raising=False)
    assert transport_class("gloo") is GlooTransport and transport_class("nccl") is NcclTransport
    monkeypatch.setenv(emulation.ENV, "1")
    assert transport_class("gloo") is EmulatedNccl
    assert EmulatedNccl.nccl and EmulatedNccl.emulated and EmulatedNccl.device_for() == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^STAGEWISE_EMULATE_NCCL runs the NCCL code path on a gloo "
                       r"process group, but this group's backend is 'nccl': unset"):  # fmt: skip
        transport_class("nccl")


def _bare(path: type[Transport]) -> Transport:
    """A transport of ``path`` with only what ``check`` reads (no process group behind it)."""
    t = object.__new__(path)
    t.me, t.device, t.backend = 3, torch.device("cpu"), "nccl-emulated" if path.emulated else "gloo"
    return t


def test_the_nccl_path_refuses_what_nccl_cannot_take_and_gloo_takes_it() -> None:
    strided = torch.zeros(4, 4).t()
    int16 = torch.zeros(2, dtype=torch.int16)
    gloo, nccl = _bare(GlooTransport), _bare(EmulatedNccl)
    gloo.check(strided, "x")  # gloo copies it
    gloo.check(int16, "x")
    with pytest.raises(ValueError, match=r"^rank 3: 1SEND_F0 to rank 2 was handed a non-contiguous tensor "
                       r"\(\[4, 4\] float32, strides \(1, 4\)\), which NCCL refuses"):  # fmt: skip
        nccl.check(strided, "1SEND_F0 to rank 2")
    with pytest.raises(ValueError, match=r"a int16 tensor \(\[2\] int16\), which NCCL cannot send"):
        nccl.check(int16, "x")
    for t in (gloo, nccl):  # every path: the device guard
        with pytest.raises(ValueError, match=r"handed a tensor on meta .* runs on cpu; it was made without"):
            t.check(torch.empty(2, device="meta"), "x")


class _Board:
    """A failure board's answers, without a store: ``failed`` is (rank, message) or None."""

    def __init__(self, failed: tuple[int, str] | None) -> None:
        self.failed = failed

    def first(self) -> tuple[int, str] | None:
        return self.failed

    def blame_dead(self) -> tuple[int, str] | None:
        return self.failed


def _failing(board: _Board, backend_error: Exception, aborts: list[int] | None = None) -> BaseException:
    """What ``fail`` raises for ``backend_error``, raised as the backend would, inside its handler;
    each ``abort`` call appends to ``aborts``."""
    t = _bare(GlooTransport)
    t.board, t.liveness = board, SimpleNamespace(store_gone=False)  # type: ignore[assignment]
    t.timeout = t.requested_timeout = 5.0
    called = [] if aborts is None else aborts
    t.abort = lambda: called.append(1)  # type: ignore[method-assign]
    with pytest.raises(Exception) as info:
        try:
            raise backend_error
        except RuntimeError as exc:
            t.fail("1RECV_F0 from rank 2", exc)
    return info.value


def test_a_named_peer_failure_stands_alone_and_any_other_error_keeps_the_backends_as_cause() -> None:
    echo = RuntimeError("Connection reset by peer")  # what gloo says once the failed peer's socket closed
    aborts: list[int] = []
    err = _failing(_Board((2, "ValueError: bad")), echo, aborts)
    assert isinstance(err, PeerFailure)
    assert aborts == [1]  # a peer failed: the transfers still in flight are stopped (NCCL's would hang)
    assert str(err) == "rank 2 failed while rank 3 waited for 1RECV_F0 from rank 2: ValueError: bad"
    printed = "".join(traceback.format_exception(err))
    assert "Connection reset" not in printed and "direct cause" not in printed
    assert "During handling" not in printed
    own = _failing(_Board((3, "ValueError: mine")), echo)  # this rank's own failure: not an echo of it
    assert isinstance(own, PeerFailure) and own.__cause__ is echo
    timeout = RuntimeError("Timed out waiting 5000ms for recv operation")  # no peer failed: the cause stays
    err = _failing(_Board(None), timeout)
    assert isinstance(err, PipelineTimeout) and err.__cause__ is timeout


def test_a_collective_after_close_is_refused_before_the_backend() -> None:
    import weakref

    from pipeline.runtime.comm.collectives import Collectives

    t = _bare(GlooTransport)
    t.group, t._close = None, weakref.finalize(t, lambda: None)
    t.close()
    c = Collectives(t, 0, [0, 1], [0, 1])
    with pytest.raises(RuntimeError, match=r"^rank 3: cannot post the loss's broadcast: this pipeline's "
                       r"communication was closed \(Pipeline\.close\(\)\)"):  # fmt: skip
        c.broadcast(torch.zeros(1), 1, "the loss's broadcast")
