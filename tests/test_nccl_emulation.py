"""The NCCL code path under the strict emulation: every schedule equals one process; failures are named.

The emulation's own rules first (one process, stand-in works), then the runtime
under it on 2 and 4 gloo ranks, each world size running all its configurations as
one job of the shared launch (tests/dist.py): every schedule (interleaved with m = p
and m > p) x recomputation off and on, step and evaluate, on an MLP and on a model that passes an integer
tensor between every pair of stages (a poisoned integer is an index out of
range). Then a rank that raises, a rank too slow for the timeout and a killed rank.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.launch import RankError
from pipeline.plan import Plan
from pipeline.reference.models import mlp
from pipeline.runtime.comm import emulation, stream
from pipeline.runtime.comm.emulation import DEFAULT, EmuStream, EmuTransfer
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.step.steps import host_sync_site
from tests.dist import job, run_ranks
from tests.host_reads import host_reads, innermost_library_line
from tests.pipe_common import CarriesIds

BATCH, WIDTH, DEPTH = 8, 8, 8
CHECKPOINTS = ("never", "always")


# ---- the emulation's rules, in one process


class _Work:
    """A stand-in for a gloo work: done when waited for."""

    def __init__(self) -> None:
        self.waited = False

    def wait(self, *_: Any) -> bool:
        self.waited = True
        return True


def _wait_all(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _received(value: float, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, EmuTransfer]:
    buf = torch.empty(3, dtype=dtype)
    transfer = EmuTransfer(
        [_Work()], [], [(buf, torch.full((3,), value, dtype=dtype))], "1RECV_F0 from rank 0"
    )
    return buf, transfer


def test_received_data_is_poison_until_compute_is_ordered_after_it() -> None:
    buf, t = _received(2.0)
    assert buf.isnan().all()
    t.complete(_wait_all)
    assert buf.isnan().all()  # done on the host, but no stream ordered: compute would race
    side = EmuStream("side")
    emulation.order(side, [t])
    assert buf.isnan().all()  # a side stream's ordering does not reach compute
    stream.wait_event(DEFAULT, stream.record_event(side))  # ... until compute waits for it
    assert buf.tolist() == [2.0] * 3
    buf, t = _received(3.0)
    t.complete(_wait_all)
    emulation.order(side, [t])
    stream.wait_stream(DEFAULT, side)
    assert buf.tolist() == [3.0] * 3


def test_integers_and_bools_are_poisoned_too() -> None:
    ints, _ = _received(5, torch.int64)
    assert ints.tolist() == [torch.iinfo(torch.int64).min] * 3
    flags, _ = _received(0, torch.bool)
    assert flags.all()


def test_ordering_needs_the_transfer_done_and_a_group_waits_for_every_op() -> None:
    _, t = _received(1.0)
    with pytest.raises(RuntimeError, match=r"1RECV_F0 from rank 0: ordered a stream after a transfer"):
        emulation.order(DEFAULT, [t])
    works = [_Work(), _Work()]
    group = EmuTransfer(works, [torch.zeros(1)], [(torch.empty(1), torch.ones(1))], "a block")
    group.complete(_wait_all)
    assert all(w.waited for w in works)


def test_writes_while_in_flight_are_caught() -> None:
    sent = torch.zeros(3)
    t = EmuTransfer([_Work()], [sent], [], "0SEND_F1 to rank 1")
    sent.add_(1)  # the stage changed its output after handing it to the send
    with pytest.raises(RuntimeError, match=r"0SEND_F1 to rank 1 was modified in place while the send"):
        t.complete(_wait_all)
    buf, t = _received(1.0)
    buf.zero_()  # someone wrote the receive buffer before ordering
    t.complete(_wait_all)
    with pytest.raises(RuntimeError, match=r"receive buffer of 1RECV_F0 from rank 0 was written"):
        emulation.order(DEFAULT, [t])


def test_the_step_default_device_is_meta_only_under_the_emulation() -> None:
    with emulation.strict_devices(True):
        assert torch.empty(1).is_meta
    with emulation.strict_devices(False):
        assert not torch.empty(1).is_meta


# ---- the runtime under the emulation, against one process


def _build(name: str) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        model, x = mlp(width=WIDTH, depth=DEPTH, batch_size=BATCH)
    else:
        model = nn.Sequential(*[CarriesIds(k == 0, k == DEPTH - 1, WIDTH) for k in range(DEPTH)])
        x = torch.randint(0, 16, (BATCH, 4))
    return model, x, torch.randn(BATCH, WIDTH)


def _configs(p: int) -> list[tuple[str, str, int, int]]:
    """(model, schedule, v, m): every schedule, interleaved with m = p and m > p."""
    plain = [("mlp", name, 1, 2 * p) for name in ("gpipe", "1f1b", "zb-h1")]
    interleaved = [("mlp", "interleaved-1f1b", 2, p), ("mlp", "interleaved-1f1b", 2, 2 * p)]
    return [*plain, *interleaved, ("tuple", "1f1b", 1, p), ("tuple", "interleaved-1f1b", 2, 2 * p)]


def _balance(n_stages: int) -> list[int]:
    return [DEPTH // n_stages + (1 if k < DEPTH % n_stages else 0) for k in range(n_stages)]


def _pipeline(model: nn.Sequential, name: str, v: int, m: int, ckpt: str, **kw: Any) -> Pipeline:
    plan = Plan(balance=_balance(dist.get_world_size() * v), schedule=name, n_microbatches=m, n_virtual=v,
                recompute=ckpt)  # fmt: skip
    return Pipeline(model, plan, loss_fn=nn.functional.mse_loss, **kw)


def _emulated_matrix() -> dict[str, Any]:
    assert os.environ.get(emulation.ENV) == "1"
    out: dict[str, Any] = {}
    for (model_name, name, v, m), ckpt in itertools.product(_configs(dist.get_world_size()), CHECKPOINTS):
        model, x, y = _build(model_name)
        pipe = _pipeline(model, name, v, m, ckpt, timeout=20.0)
        assert pipe.comm is not None and pipe.comm.emulated and pipe.comm.nccl
        ev = pipe.evaluate(x, y)
        loss = pipe.step(x, y)
        grads = {k: t.grad.detach().clone() for k, t in pipe.named_parameters() if t.grad is not None}
        out[f"{model_name}/{name}/m={m}/{ckpt}"] = (loss, ev, grads)
    # the optimizer step's companions (collectives on the group) and the state gather (p = 4: rank 2
    # is no neighbour of rank 0, so its message leaves the channels)
    model, x, y = _build("mlp")
    pipe = _pipeline(model, "1f1b", 1, 4, "never", timeout=20.0)
    pipe.step(x, y)
    finite = pipe.grads_finite()
    norm = pipe.clip_grad_norm_(0.1)
    clipped = {k: t.grad.detach().clone() for k, t in pipe.named_parameters() if t.grad is not None}
    out["clip"] = (finite, norm, clipped, pipe.gather_state_dict())
    return out


def _reference(model_name: str, m: int) -> tuple[float, float, dict[str, torch.Tensor]]:
    model, x, y = _build(model_name)
    with torch.no_grad():
        chunks = zip(x.chunk(m), y.chunk(m), strict=True)
        ev = float(torch.stack([nn.functional.mse_loss(model(a), b) for a, b in chunks]).mean())
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return float(loss.detach()), ev, {k: t.grad for k, t in model.named_parameters() if t.grad is not None}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


_MATRIX = {p: job(p, _emulated_matrix, timeout=120.0, backend="nccl-emulated") for p in (2, 4)}


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_equals_one_process_under_the_emulation(
    tmp_path_factory: pytest.TempPathFactory, p: int
) -> None:
    results = _MATRIX[p].results(tmp_path_factory)
    for (model_name, name, _, m), ckpt in itertools.product(_configs(p), CHECKPOINTS):
        key = f"{model_name}/{name}/m={m}/{ckpt}"
        loss_ref, ev_ref, grads_ref = _reference(model_name, m)
        for rank, res in enumerate(results):
            loss, ev, _ = res[key]
            assert _rel(loss, loss_ref) < 1e-5 and _rel(ev, ev_ref) < 1e-5, (key, rank, loss, ev)
        merged = {k: g for r in results for k, g in r[key][2].items()}
        assert set(merged) == set(grads_ref), key
        for k, g in merged.items():
            rel = float((g - grads_ref[k]).abs().max() / grads_ref[k].abs().max().clamp_min(1e-12))
            assert rel < 1e-5, f"{key}: {k} relative error {rel:.2e}"
    model, x, y = _build("mlp")
    nn.functional.mse_loss(model(x), y).backward()
    norm_ref = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
    clipped = {k: g for r in results for k, g in r["clip"][2].items()}
    for k, t in model.named_parameters():
        assert t.grad is not None and float((clipped[k] - t.grad).abs().max() / t.grad.abs().max()) < 1e-5
    for finite, norm, _, _ in (r["clip"] for r in results):
        assert finite is True and _rel(norm, norm_ref) < 1e-5
    state = results[0]["clip"][3]
    assert list(state) == list(model.state_dict()) and all(r["clip"][3] is None for r in results[1:])
    assert all(torch.equal(state[k], t) for k, t in model.state_dict().items())


# ---- failures under the emulation


class _Boom(nn.Module):
    def __init__(self, at: int = -1, kill_note: str = "") -> None:
        super().__init__()
        self.calls, self.at, self.kill_note, self.sleep = 0, at, kill_note, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            if self.kill_note:
                Path(self.kill_note).write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("boom in a stage")
        time.sleep(self.sleep)
        return x


def _scenario(kind: str) -> tuple[str, str, float]:
    group = dist.new_group(backend="gloo")  # spans the world; a failure leaves the world group healthy
    layers: list[nn.Module] = [nn.Linear(4, 4) for _ in range(4)]
    timeout = 20.0
    if kind == "raise":
        layers[2] = _Boom(at=3)  # stage 1 (rank 1) fails at its third forward
    elif kind == "timeout":
        layers[2], timeout = _Boom(), 1.0  # the last stage turns too slow after a good step
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(*layers), Plan(balance=[2, 2], n_microbatches=4),
                    loss_fn=nn.functional.mse_loss, group=group, timeout=timeout)  # fmt: skip
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    if kind == "timeout":  # set up before the clock starts: time the wait
        pipe.step(x, y)
        layers[2].sleep = 3.0  # type: ignore[assignment]
    if kind == "collective":  # rank 0 waits in a collective (polled on the NCCL path) when rank 1 fails
        pipe.step(x, y)
        if dist.get_rank() == 1:
            assert pipe.comm is not None and pipe.comm.channels is not None
            channels, aborted = pipe.comm.channels, []
            real = channels.abort
            channels.abort = lambda: (aborted.append(True), real())[1]  # type: ignore[method-assign]
            pipe.comm.publish("RuntimeError: boom after the step")
            # its own transfers stop at once, not only when a peer's watchdog closes the pairs
            return "published", f"own channels aborted: {aborted == [True]}", 0.0
    start = time.monotonic()
    try:
        if kind == "collective":
            pipe.grads_finite()
        for _ in range(2):
            pipe.step(x, y)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


_KEEP: list[Any] = []  # the silent rank's Comm: collected, its channels' sockets would close and wake rank 0


def _published_elsewhere() -> tuple[str, str, float]:
    """Rank 1 publishes a failure and stays silent, its channels open (as a rank busy in a long
    compute, or one that published in a dead peer's name): rank 0, blocked in a receive on a
    channel, is woken by its watchdog closing the channels' pairs too, not by its timeout."""
    from pipeline.runtime.comm.p2p import Comm

    comm = Comm(dist.new_group(backend="gloo"), "silent", timeout=10.0)
    _KEEP.append(comm)
    if dist.get_rank() == 1:
        comm.board.publish_as(1, "RuntimeError: failed elsewhere")
        return "published", "", 0.0
    start = time.monotonic()
    try:
        (works,) = comm.post([], [([torch.zeros(1)], 1)], "0RECV_F0 from rank 1")
        comm.wait(works, "0RECV_F0 from rank 1")
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _failures() -> dict[str, list[Any]]:
    out = {}
    for kind in ("raise", "timeout", "collective", "silent"):
        result = _published_elsewhere() if kind == "silent" else _scenario(kind)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        out[kind] = gathered
    return out


# last in its launch: the failed pipelines stay behind (on groups of their own)
_FAILURES = job(2, _failures, timeout=60.0, backend="nccl-emulated", last=True)


def test_a_raise_a_timeout_and_a_failure_during_a_collective_are_named(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    results = _FAILURES.results(tmp_path_factory)[0]
    (k0, m0, t0), (k1, m1, _) = results["raise"]
    assert (k1, m1) == ("RuntimeError", "boom in a stage")
    assert k0 == "PeerFailure" and t0 < 5.0
    # where rank 0 hears of it depends on how far it got: blocked in the receive of a gradient, or
    # posting its next forward's send on the connections the failure closed
    assert re.match(r"rank 1 failed while rank 0 waited for 0(RECV_B\d from|SEND_F\d to) rank 1\b", m0), m0
    assert m0.endswith("RuntimeError: boom in a stage")
    (k0, m0, t0), (k1, m1, _) = results["timeout"]
    assert k0 == "PipelineTimeout" and t0 < 3.0
    assert m0 == "rank 0 timed out after 1.0 s waiting for 0RECV_B0 from rank 1"
    assert k1 == "PeerFailure" and m1.endswith(m0)
    (k0, m0, t0), (k1, m1, _) = results["collective"]
    assert (k1, m1) == ("published", "own channels aborted: True")
    assert k0 == "PeerFailure" and t0 < 2.0  # the failure key is read while polling, not the timeout
    assert m0 == (
        "rank 1 failed while rank 0 waited for the all-finite flag's all-reduce (grads_finite): "
        "RuntimeError: boom after the step"
    )
    (k0, m0, t0), _ = results["silent"]
    assert (k0, m0) == (
        "PeerFailure",
        "rank 1 failed while rank 0 waited for 0RECV_F0 from rank 1: RuntimeError: failed elsewhere",
    )
    assert t0 < 2.0, t0  # the watchdog, not the timeout (10 s)


def _killed(folder: str) -> None:
    Path(folder, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    # stage 1 (rank 1) dies at its sixth call: the shape inference, the first step's 4 forwards, then
    # the second step's first forward
    boom = _Boom(at=6, kill_note=str(Path(folder, "killed_at")))
    layers: list[nn.Module] = [nn.Linear(4, 4), boom, nn.Linear(4, 4), nn.Linear(4, 4)]
    pipe = Pipeline(nn.Sequential(*layers), Plan(balance=[1, 1, 1, 1], n_microbatches=4),
                    loss_fn=nn.functional.mse_loss, timeout=30.0)  # fmt: skip
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    for _ in range(3):
        pipe.step(x, y)


def test_a_killed_rank_is_named_within_seconds_and_leaves_no_process(tmp_path: Path) -> None:
    with pytest.raises(RankError, match=r"rank 1 exited with code -9") as info:
        run_ranks(tmp_path, _killed, 4, str(tmp_path), timeout=60.0, backend="nccl-emulated")
    assert info.value.rank == 1
    assert time.time() - float((tmp_path / "killed_at").read_text()) < 5.0  # the pipeline's timeout is 30 s
    for r in range(4):
        pid = int((tmp_path / f"pid{r}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ---- host synchronisation inside a step

# On CUDA, reading a device tensor on the host (.item(), .tolist(), float(), .cpu()) waits for the
# device to drain: inside a step it stalls the host's run-ahead and the overlap. A step reads once, at
# the site the library names (steps.HOST_SYNC, the returned loss; scripts/gpu_check.py allows only it
# on a GPU); a new read anywhere fails the test below.


def _host_reads() -> tuple[list[tuple[str, int] | None], list[str]]:
    """Where (the innermost pipeline/ file and line) a second step reads tensors on the host, under
    the emulation; and the step headers still in the store after both steps (each is deleted by its
    last reader)."""
    p = dist.get_world_size() // 2
    model, _ = mlp(width=WIDTH, depth=DEPTH, batch_size=BATCH)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    plan = Plan(balance=[DEPTH // p] * p, schedule="zb-h1", n_microbatches=4, dp=2)
    pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, timeout=30.0)
    pipe.step(x, y)  # the first step: its setup reads what it needs once
    sites = [innermost_library_line(stack) for stack in host_reads(lambda: pipe.step(x, y))]
    dist.barrier()
    comm = pipe.comm
    assert comm is not None
    keys = [f"{comm.key_prefix}/header{n}{end}" for n in (1, 2) for end in ("", "/read")]
    return sites, [key for key in keys if comm.store.check([key])]


_READS = job(4, _host_reads, timeout=60.0, backend="nccl-emulated")


def test_a_step_reads_the_device_only_where_named(tmp_path_factory: pytest.TempPathFactory) -> None:
    """2 replicas of a 2-rank zb-h1 pipeline: every rank reads once in a step, at HOST_SYNC's line
    (the replicas' mean loss stays on the device until then)."""
    file, line = host_sync_site()
    for rank, (sites, headers_left) in enumerate(_READS.results(tmp_path_factory)):
        assert sites == [(str(Path(file).resolve()), line)], (rank, sites)
        assert headers_left == [], rank  # the store does not grow with the steps
